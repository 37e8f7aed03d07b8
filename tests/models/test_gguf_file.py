"""runtime.models.gguf_file against the gguf package's own reader and writer (llama.cpp's
gguf-py): the same metadata and tensor data, on the embedded model's file and on files the
package writes with every metadata type; malformed files are named errors. And the Q6_K
dequantization against the package's."""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from runtime.models.gguf_file import GGUFFile, GGUFFormatError  # noqa: E402
from runtime.models.loader import resolve_model  # noqa: E402
from runtime.models.quantized_weight import gguf_dequantize  # noqa: E402
from tests.models.test_quantization import random_q4_k_blocks  # noqa: E402


def assert_same_as_gguf_reader(path) -> GGUFFile:
    ours, theirs = GGUFFile(path), GGUFReader(str(path))
    fields = {key: field for key, field in theirs.fields.items() if not key.startswith("GGUF.")}  # its pseudo-keys
    assert list(ours.metadata) == list(fields)
    for key, field in fields.items():
        assert ours.metadata[key] == field.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors):
        assert mine.tensor_type == ref.tensor_type and mine.shape == tuple(ref.shape.tolist()), mine.name
        assert mine.data.dtype == ref.data.dtype and mine.data.shape == ref.data.shape, mine.name
        assert np.array_equal(mine.data, ref.data), mine.name
        assert not mine.data.flags.writeable
    return ours


def test_the_embedded_models_file_reads_as_gguf_reads_it():
    ours = assert_same_as_gguf_reader(resolve_model("smollm2-135m").path)
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152


def write_gguf(path, alignment: int | None = None) -> dict[str, np.ndarray]:
    """A file with every metadata value type and float, Q8_0 and Q6_K tensors; returns the
    tensors as written (float32)."""
    writer = GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "naïve ✓")
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.strs", ["a", "", "ü" * 100])
    writer.add_array("t.floats", [0.5, -1.25])
    rng = np.random.default_rng(0)
    tensors = {"f32": rng.standard_normal((3, 5)).astype(np.float32),
               "f16": rng.standard_normal((4, 7)).astype(np.float16),
               "q8": rng.standard_normal((6, 64)).astype(np.float32)}
    writer.add_tensor("f32", tensors["f32"])
    writer.add_tensor("f16", tensors["f16"])
    q8 = quantize(tensors["q8"], GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8", q8, raw_shape=q8.shape, raw_dtype=GGMLQuantizationType.Q8_0)
    q6 = random_q6_k_blocks(5, 512)
    writer.add_tensor("q6", q6, raw_shape=q6.shape, raw_dtype=GGMLQuantizationType.Q6_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


@pytest.mark.parametrize("alignment", [None, 64])
def test_files_the_gguf_package_writes_read_as_it_reads_them(tmp_path, alignment):
    path = tmp_path / "t.gguf"
    written = write_gguf(path, alignment)
    ours = assert_same_as_gguf_reader(path)
    assert ours.metadata["t.str"] == "naïve ✓" and ours.metadata["t.strs"] == ["a", "", "ü" * 100]
    assert ours.metadata["t.u64"] == 2**63 and ours.metadata["t.bool"] is True
    data = {t.name: t.data for t in ours.tensors}
    assert np.array_equal(data["f32"], written["f32"]) and np.array_equal(data["f16"], written["f16"])


def test_malformed_files_are_named_errors(tmp_path):
    path = tmp_path / "t.gguf"
    write_gguf(path)
    whole = path.read_bytes()
    bad = tmp_path / "bad.gguf"
    for content, words in [(b"GGML" + whole[4:], "no GGUF magic"),
                           (whole[:4] + (1).to_bytes(4, "little") + whole[8:], "version 1"),
                           (whole[:4] + (3).to_bytes(4, "big") + whole[8:], "big-endian"),
                           (whole[:200], "not a readable GGUF file"),
                           (whole[:-100], "runs past the end of the file")]:
        bad.write_bytes(content)
        with pytest.raises(GGUFFormatError, match=words):
            GGUFFile(bad)


def random_q6_k_blocks(n: int, k: int, seed: int = 0) -> np.ndarray:
    """Valid Q6_K bytes [n, k / 256 * 210]: random 6-bit values and int8 scales, finite fp16 d."""
    rng = np.random.default_rng(seed)
    nb = k // 256
    quants = rng.integers(0, 256, (n, nb, 208), dtype=np.uint8)  # ql, qh, scales: every pattern is valid
    d = rng.uniform(1e-4, 1e-2, (n, nb, 1)).astype(np.float16).view(np.uint8)  # [n, nb, 2]
    return np.concatenate([quants, d], axis=-1).reshape(n, nb * 210)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q5_0", "Q6_K", "Q4_0", "Q4_1", "Q4_K", "Q5_1"])
def test_dequantization_is_bit_for_bit_gguf_s(type_name):
    """Q8_0, Q5_0, Q6_K and the int4 types are ours; the others pass through to gguf."""
    qtype = GGMLQuantizationType[type_name]
    if type_name == "Q6_K":
        raw = random_q6_k_blocks(7, 768, seed=1)
    elif type_name == "Q4_K":
        raw = random_q4_k_blocks(7, 512)
    else:
        raw = quantize(np.random.default_rng(2).standard_normal((7, 96)).astype(np.float32) * 0.05, qtype)
    reference = dequantize(raw, qtype)
    assert np.isfinite(reference).all() and reference.shape[0] == 7 and np.abs(reference).max() > 0
    assert torch.equal(gguf_dequantize(raw, type_name), torch.from_numpy(reference))
    batch = raw.reshape(7, 1, -1)  # leading dimensions kept
    assert gguf_dequantize(batch, type_name).shape == (7, 1, reference.shape[1])
