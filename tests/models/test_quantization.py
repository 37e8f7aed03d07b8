"""Quantized weights (runtime.models.quantized_weight, runtime.models.quant_linear, the loader).

- GGUF blocks unpack exactly where the formats map: Q4_0, Q4_1 (made by the gguf package's
  own quantize) and Q4_K (random valid blocks) dequantize bit for bit as gguf's dequantize.
  Q8_0 and Q5_0 are requantized, with the error they report equal to the error measured.
- The kernels compute what the weight says: int4 (PyTorch's int4 kernel, bf16 scales) and
  int8 layers against a float matmul over their own dequantized weight; float32 int4 layers
  compute exactly ggml's dequantized weight.
- The default model with --quantization auto: every linear layer quantized (int4 from its
  Q4_1 tensors, int8 LM head from the Q8_0 embedding, which stays float), its next-token
  distribution close to HF transformers' (which dequantizes the GGUF), in float32 and bf16.
- Speculation on a quantized target is lossless against plain decoding on that target:
  greedy with lookahead trees and a draft model; sampled with a draft model whose own
  probabilities differ (int8 draft, int4 target), checked by a Pearson chi-square test.
- Bad input: a tensor type or a quantization_config we cannot run is a one-line error.
"""
from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch

from runtime.models import quant_linear
from runtime.models.quant_linear import DequantizedLinear, Int4Linear, Int8Linear, linear_kernels, make_linear
from runtime.models.quantized_weight import (QuantizedWeight, UnsupportedQuantizationError, gguf_int4_exact,
                                             gguf_quantized, quantize_int4, quantize_int8, relative_rms_error)
from runtime.sampling_params import SamplingParams

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402
from tests.helpers import greedy

CPU = torch.device("cpu")


def random_rows(n: int, k: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05


def random_q4_k_blocks(n: int, k: int, seed: int = 0) -> np.ndarray:
    """Valid Q4_K bytes [n, k / 256 * 144]: finite fp16 d and dmin, random 6-bit scales and mins,
    random nibbles (every bit pattern of the scale bytes and nibbles is a valid block)."""
    rng = np.random.default_rng(seed)
    nb = k // 256
    d = (rng.uniform(1e-4, 1e-2, (n, nb, 1))).astype(np.float16).view(np.uint8)  # [n, nb, 2]
    dmin = (rng.uniform(1e-4, 1e-2, (n, nb, 1))).astype(np.float16).view(np.uint8)
    scales = rng.integers(0, 256, (n, nb, 12), dtype=np.uint8)
    qs = rng.integers(0, 256, (n, nb, 128), dtype=np.uint8)
    return np.concatenate([d, dmin, scales, qs], axis=-1).reshape(n, nb * 144)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
def test_gguf_q4_blocks_unpack_bit_exactly(type_name):
    qtype = GGMLQuantizationType[type_name]
    raw = quantize(random_rows(24, 128), qtype)  # [24, bytes per row]
    weight = gguf_int4_exact(raw, type_name, (24, 128))
    assert weight.bits == 4 and weight.group_size == 32 and weight.error == 0.0
    assert int(weight.q.min()) >= 0 and int(weight.q.max()) <= 15
    assert torch.equal(weight.dequantize(), torch.from_numpy(dequantize(raw, qtype)))


def test_gguf_q4_k_blocks_unpack_bit_exactly():
    raw = random_q4_k_blocks(8, 512)
    weight = gguf_int4_exact(raw, "Q4_K", (8, 512))
    reference = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_K))
    assert torch.isfinite(reference).all()
    assert torch.equal(weight.dequantize(), reference)


@pytest.mark.parametrize("type_name, bits", [("Q8_0", 8), ("Q5_0", 4), ("Q8_0", 4), ("Q4_1", 8)])
def test_requantized_gguf_weights_report_their_error(type_name, bits):
    qtype = GGMLQuantizationType[type_name]
    raw = quantize(random_rows(16, 256, seed=3), qtype)
    weight = gguf_quantized(raw, type_name, (16, 256), bits)
    source = torch.from_numpy(dequantize(raw, qtype))
    assert weight.bits == bits and "requantized" in weight.source
    assert weight.error == pytest.approx(relative_rms_error(weight.dequantize(), source), rel=1e-6)
    assert 0 < weight.error < (0.12 if bits == 4 else 0.01)


def test_unpacking_q4_rows_permutes_with_them():
    raw = quantize(random_rows(8, 64), GGMLQuantizationType.Q4_1)
    weight = gguf_int4_exact(raw, "Q4_1", (8, 64))
    order = torch.tensor([3, 1, 0, 2, 7, 6, 5, 4])
    assert torch.equal(weight.permute_rows(order).dequantize(), weight.dequantize()[order])
    parts = [weight.narrow_rows(0, 3), weight.narrow_rows(3, 5)]
    assert torch.equal(QuantizedWeight.cat_rows(parts).dequantize(), weight.dequantize())


def kernel_weight(weight: QuantizedWeight) -> torch.Tensor:
    """The weight the int4 kernels compute, (q - 8) s + z with s and z rounded to bf16."""
    scales = weight.scales.bfloat16().float()
    zeros = (weight.offsets + 8 * weight.scales).bfloat16().float()
    g = weight.group_size
    return (weight.q.float() - 8) * scales.repeat_interleave(g, 1) + zeros.repeat_interleave(g, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_linear_computes_its_weight(dtype):
    """PyTorch's int4 kernel (this project's: tests/kernels/test_quant_linear_kernel.py)."""
    raw = quantize(random_rows(96, 256, seed=1), GGMLQuantizationType.Q4_1)
    weight = gguf_int4_exact(raw, "Q4_1", (96, 256))
    bias = torch.randn(96) * 0.1
    layer = Int4Linear(weight, bias, dtype, CPU, many_rows=None)
    assert isinstance(layer, Int4Linear) and "int4" in layer.kernel
    assert 0 < layer.error < 0.01  # bf16 scales: a fraction of a percent of the weight
    x = torch.randn(5, 256, dtype=dtype)
    reference = torch.nn.functional.linear(x.bfloat16().float(), kernel_weight(weight), bias)  # [5, 96]
    out = layer(x)
    assert out.dtype == dtype and out.shape == (5, 96)
    torch.testing.assert_close(out.float(), reference, atol=0.02, rtol=0.02)
    torch.testing.assert_close(layer.dequantize().float(), kernel_weight(weight).to(dtype).float(),
                               atol=1e-2, rtol=1e-2)


def test_float32_int4_layers_compute_ggmls_weight_exactly():
    raw = quantize(random_rows(48, 128, seed=2), GGMLQuantizationType.Q4_0)
    weight = gguf_int4_exact(raw, "Q4_0", (48, 128))
    layer = make_linear(weight, None, torch.float32, CPU)
    assert isinstance(layer, DequantizedLinear)
    x = torch.randn(7, 128)
    reference = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_0))  # [48, 128]
    assert torch.equal(layer(x), torch.nn.functional.linear(x, reference))
    assert isinstance(make_linear(weight, None, torch.bfloat16, CPU), Int4Linear)


def test_int8_linear_computes_its_weight():
    w = torch.randn(64, 128)
    weight = quantize_int8(w, "float32 quantized")
    exact = make_linear(weight, None, torch.float32, CPU)  # float32: dequantized exactly
    assert isinstance(exact, DequantizedLinear)
    x = torch.randn(3, 128)
    assert torch.equal(exact(x), torch.nn.functional.linear(x, weight.dequantize()))
    layer = make_linear(weight, None, torch.bfloat16, CPU)
    assert isinstance(layer, Int8Linear)
    reference = x.bfloat16().float() @ weight.dequantize().T
    out = layer(x.bfloat16()).float()  # bf16: int8 activations where this project's kernel runs
    assert (out - reference).norm() / reference.norm() < 0.02
    assert weight.error == pytest.approx(relative_rms_error(weight.dequantize(), w))


def test_float_weights_quantize_within_their_precision():
    w = torch.randn(32, 256)
    assert 0.03 < quantize_int4(w, "x").error < 0.12  # 4 bits, group 32
    assert 0.002 < quantize_int8(w, "x").error < 0.01


# ---- the default model -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def default_int4():
    from runtime.models.loader import load_model
    return load_model("smollm2-135m", "float32", "cpu", quantization="auto")


def causal_attention(layer_idx, q, k, v):
    """q [T, Hq, D], k, v [T, Hkv, D] -> [T, Hq, D], plain causal attention."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                           is_causal=True)
    return out.transpose(0, 1)


def test_auto_keeps_the_default_models_precision_classes(default_int4):
    model, _, config = default_int4
    kernels = linear_kernels(model)
    assert f"{4 * config.num_layers} int4" in kernels and "(Q4_1" in kernels
    assert "1 int8" in kernels and "Q8_0 requantized" in kernels
    assert isinstance(model.lm_head, DequantizedLinear) and isinstance(model.layers[0].mlp.down_proj, DequantizedLinear)
    assert model.embed_tokens.weight.dtype == torch.float32  # the embedding table stays float
    assert "aten.linear" not in kernels and "prepacked" not in kernels


@pytest.fixture(scope="module")
def default_int4_bf16():
    from runtime.models.loader import load_model
    return load_model("smollm2-135m", "bfloat16", "cpu", quantization="auto")


LONG_PROMPT = ("Alice was beginning to get very tired of sitting by her sister on the bank, and of having "
               "nothing to do: once or twice she had peeped into the book her sister was reading, but it had "
               "no pictures or conversations in it, and what is the use of a book, thought Alice")


@torch.inference_mode()
@pytest.mark.parametrize("precision,prompt,regime", [("float32", "short", None), ("bfloat16", "short", "default"),
                                                     ("bfloat16", "long", "default"), ("bfloat16", "long", "gemm")])
def test_auto_quantized_default_model_stays_close_to_hf(request, precision, prompt, regime, hf_smollm):
    """bf16: the int4/int8 layers' default regime (int8 activations without AMX), and their
    bf16 GEMM regime forced (what CPUs with AMX run above MANY_ROWS_AMX rows)."""
    model, tokenizer, _ = request.getfixturevalue("default_int4" if precision == "float32" else "default_int4_bf16")
    layers = [m for m in model.modules() if isinstance(m, quant_linear.QuantizedLinear)]
    if precision == "bfloat16":
        assert isinstance(model.layers[0].mlp.down_proj, Int4Linear)  # the int4 kernel
    text = LONG_PROMPT if prompt == "long" else "The capital of France is Paris. The largest planet of the solar system is"
    ids = tokenizer(text)["input_ids"]
    assert (len(ids) > quant_linear.MANY_ROWS_AMX) == (prompt == "long")
    default_rows = [layer.many_rows for layer in layers]
    if regime == "gemm":
        if None in default_rows:
            pytest.skip("the CPU kernel did not build here")
        for layer in layers:
            layer.many_rows = 0
    try:
        logits = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), causal_attention))  # [T, V]
    finally:
        for layer, rows in zip(layers, default_rows):
            layer.many_rows = rows
    reference = hf_smollm(torch.tensor([ids])).logits[0].float()  # [T, V]
    log_p, log_q = reference.log_softmax(-1), logits.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # [T]
    assert kl.mean() < (0.01 if precision == "float32" else 0.02), kl
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9


def test_a_tensor_type_we_cannot_run_is_a_one_line_error():
    from runtime.models.loader import gguf_linear_bits
    tensor = types.SimpleNamespace(name="blk.3.ffn_down.weight", tensor_type=GGMLQuantizationType.IQ2_XXS)
    with pytest.raises(UnsupportedQuantizationError, match=r"blk\.3\.ffn_down\.weight.*IQ2_XXS"):
        gguf_linear_bits(tensor, "auto")


def test_an_unknown_quantization_config_is_refused_before_loading(tmp_path):
    from runtime.models.loader import load_model
    config = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2,
                  quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True})
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"not read")
    with pytest.raises(UnsupportedQuantizationError, match="quant_method 'bitsandbytes' is not supported"):
        load_model(str(tmp_path), quantization="auto")


# ---- speculation on a quantized target ---------------------------------------------------------

PROMPTS = ["def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
           "def factorial(n):", "List five tips for learning a new language:", "The three primary colors are red, blue and"]


@pytest.fixture(scope="module")
def quantized_engine():
    from runtime.engine import LLMEngine
    engine = LLMEngine(enforce_eager=True, dtype="float32", device="cpu", kv_cache_memory="128MiB", quantization="auto",
                       draft_model="smollm2-135m", draft_dtype="float32", draft_quantization="int8",
                       draft_backend="torch", adaptive_speculation=False, seed=0)
    yield engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_greedy_speculation_on_a_quantized_target_is_lossless(quantized_engine, generate):
    plain = generate(quantized_engine, PROMPTS, greedy(speculator="none"))
    for speculator in ("lookahead", "draft"):
        drafted = quantized_engine.stats.num_draft_tokens
        assert generate(quantized_engine, PROMPTS, greedy(speculator=speculator)) == plain, speculator
        assert quantized_engine.stats.num_draft_tokens > drafted


@torch.inference_mode()
def test_sampled_draft_speculation_on_a_quantized_target_follows_the_target(quantized_engine, generate):
    """600 requests of three tokens: the first from the prefill, the second from verifying the
    draft model's tree. Given the commonest first token, the second must follow the quantized
    target's own next-token distribution (Pearson chi-square, p > 0.01)."""
    from tests.unit.test_rejection_sampler import chi2_sf
    engine, prompt = quantized_engine, PROMPTS[2]
    params = [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=1000 + i, speculator="draft")
              for i in range(600)]
    drafted = engine.stats.num_draft_tokens
    pairs = generate(engine, [prompt] * len(params), params)
    assert engine.stats.num_draft_tokens > drafted and engine.stats.num_accepted_tokens > 0
    first = max(set(p[0] for p in pairs), key=[p[0] for p in pairs].count)
    seconds = torch.tensor([p[1] for p in pairs if p[0] == first])
    assert len(seconds) >= 150
    ids = engine.tokenizer(prompt)["input_ids"] + [first]
    model = engine.model
    probs = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), causal_attention))[-1].softmax(-1)
    expected = probs * len(seconds)  # [V]
    frequent = torch.nonzero(expected >= 5).squeeze(1)
    observed = torch.stack([(seconds == t).sum() for t in frequent]).float()
    rest_observed, rest_expected = len(seconds) - observed.sum(), len(seconds) - expected[frequent].sum()
    stat = float(((observed - expected[frequent]) ** 2 / expected[frequent]).sum()
                 + (rest_observed - rest_expected) ** 2 / rest_expected)
    assert len(frequent) >= 2
    assert chi2_sf(stat, len(frequent)) > 0.01, (stat, len(frequent))


@pytest.mark.parametrize("bf16_math, isa, quantization, expected", [
    (True, "portable", "none", "bfloat16"),  # AMX or AVX-512 BF16: always
    (False, "AVX2", "auto", "bfloat16"),  # the default model's Q4_1 layers run in the int8-activation kernel
    (False, "AVX-512 VNNI", "int8", "bfloat16"),
    (False, "AVX2", "none", "float32"),  # float weights: oneDNN would emulate bf16
    (False, "portable", "auto", "float32"),  # no vector kernel: PyTorch's, dequantized in float32
])
def test_auto_dtype_on_a_cpu_follows_its_math_and_the_linear_layers(monkeypatch, bf16_math, isa, quantization,
                                                                     expected):
    from runtime import config as engine_config
    from runtime.models import cpu_kernels
    monkeypatch.setattr(engine_config, "cpu_has_bf16_math", lambda: bf16_math)
    monkeypatch.setattr(cpu_kernels, "cpu_kernels_available", lambda: True)
    monkeypatch.setattr(cpu_kernels, "kernel_isa", lambda: isa)
    settings = engine_config.EngineConfig(model="smollm2-135m", quantization=quantization)
    assert settings.resolved_dtype(CPU) == expected
    assert settings.resolved_dtype(torch.device("cuda")) == "bfloat16"
    draft = engine_config.EngineConfig(draft_model="smollm2-135m", draft_quantization=quantization)
    assert draft.resolved_draft_dtype(CPU, torch.device("cuda"), "bfloat16") == expected
    heads = engine_config.EngineConfig(draft_quantization=quantization)  # EAGLE/Medusa heads: no draft model
    assert heads.resolved_draft_dtype(CPU, torch.device("cuda"), "bfloat16") == (
        "bfloat16" if bf16_math or (isa != "portable" and quantization in ("int4", "int8")) else "float32")


@pytest.mark.parametrize("quantization_config, expected", [
    (None, False), ({"quant_method": "gptq", "bits": 4}, True), ({"quant_method": "awq", "bits": 4}, True),
    ({"quant_method": "fp8"}, False)])  # FP8 is upcast to float on the CPU
def test_which_hf_checkpoints_keep_quantized_linears(tmp_path, quantization_config, expected):
    from runtime.models.loader import keeps_quantized_linears
    config = {"architectures": ["LlamaForCausalLM"]}
    if quantization_config:
        config["quantization_config"] = quantization_config
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"")  # only the header is read, and not even that
    assert keeps_quantized_linears(str(tmp_path), "auto") is expected
    assert keeps_quantized_linears(str(tmp_path), "int4") and not keeps_quantized_linears(str(tmp_path), "none")
    assert keeps_quantized_linears("smollm2-135m", "auto")  # Q4_1 and Q8_0 tensors
    assert not keeps_quantized_linears(str(tmp_path / "missing"), "auto")  # load_model says why
