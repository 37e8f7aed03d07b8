"""HF checkpoints with a quantization_config (runtime.models.hf_quantized): tiny random Qwen2
models (q/k/v biases, GQA) written in the GPTQ (both checkpoint formats), AWQ (gemm) and FP8
layouts load as int4 (FP8: upcast), and their float32 logits equal HF transformers' on the
same model with the dequantized weights written as plain float tensors. The layouts are
packed here from their public descriptions (GPTQ: eight 4-bit values a 32-bit word, lowest
bits first, inputs along qweight's rows, zeros stored minus one in the original format;
AWQ: outputs along the words in the order 0, 2, 4, 6, 1, 3, 5, 7).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from scripts import make_random_model

from runtime.models.quant_linear import DequantizedLinear, Int4Linear, linear_kernels  # noqa: E402
from runtime.models.quantized_weight import UnsupportedQuantizationError, quantize_int4  # noqa: E402

GROUP = 32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's packing: word nibble i holds output AWQ_ORDER[i] of its eight
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def pack_words(values: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """[R, C] 4-bit values -> int32 [R, C/8]: value order[i] of each eight in bits 4i..4i+3."""
    groups = values.reshape(values.shape[0], -1, 8).long()[..., list(order)]
    words = (groups << (4 * torch.arange(8))).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def asymmetric_int4(weight: torch.Tensor, min_zero: int = 0):
    """weight [N, K] -> q [N, K] (0..15), integer zeros z [N, G] (>= min_zero), scales s [N, G]
    (fp16-exact), with w = s (q - z), and the dequantized weight."""
    quantized = quantize_int4(weight, "test", GROUP)
    scales = quantized.scales.half().float()
    zeros = torch.round(-quantized.offsets / scales).clamp(min_zero, 15)
    n, k = weight.shape
    q = torch.round(weight.view(n, k // GROUP, GROUP) / scales[..., None] + zeros[..., None]).clamp(0, 15)
    q = q.view(n, k)
    dense = (scales.repeat_interleave(GROUP, 1) * (q - zeros.repeat_interleave(GROUP, 1))).float()
    return q.long(), zeros.long(), scales, dense


def write_layout(src: Path, out: Path, layout: str) -> Path:
    """Copy the float model at src into `layout` at out; returns a float directory beside it
    holding the dequantized weights (the reference)."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    packed, reference = {}, {}
    for name, tensor in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf != "weight" or prefix.rpartition(".")[2] not in LINEARS:
            packed[name] = reference[name] = tensor
            continue
        if layout == "fp8":
            scale = tensor.abs().amax(dim=1, keepdim=True) / 448.0  # [N, 1]
            fp8 = (tensor / scale).to(torch.float8_e4m3fn)
            packed[name], packed[f"{prefix}.weight_scale"] = fp8, scale
            reference[name] = fp8.float() * scale
            continue
        # the original GPTQ format stores z - 1 in 4 bits, so its zeros start at 1
        q, zeros, scales, dense = asymmetric_int4(tensor, min_zero=1 if layout == "gptq" else 0)
        reference[name] = dense
        n, k = q.shape
        if layout.startswith("gptq"):
            # qweight [K/8, N]: word (r, n) holds inputs 8r..8r+7 of output n
            packed[f"{prefix}.qweight"] = pack_words(q.t().reshape(k // 8, 8, n).transpose(1, 2).reshape(k // 8, 8 * n))
            packed[f"{prefix}.qzeros"] = pack_words((zeros - 1 if layout == "gptq" else zeros).t().contiguous())
            packed[f"{prefix}.g_idx"] = torch.arange(k, dtype=torch.int32) // GROUP
        else:
            packed[f"{prefix}.qweight"] = pack_words(q.t().contiguous(), AWQ_ORDER)  # [K, N/8]
            packed[f"{prefix}.qzeros"] = pack_words(zeros.t().contiguous(), AWQ_ORDER)  # [G, N/8]
        packed[f"{prefix}.scales"] = scales.t().contiguous().half()
    qc = {"fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"},
          "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False},
          "gptq_v2": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False,
                      "checkpoint_format": "gptq_v2"},
          "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm", "zero_point": True}}
    for directory, weights, extra in ((out, packed, {"quantization_config": qc[layout]}),
                                      (out.with_name(out.name + "-reference"), reference, {})):
        directory.mkdir(parents=True)
        (directory / "config.json").write_text(json.dumps({**config, **extra}))
        save_file(weights, str(directory / "model.safetensors"))
        make_random_model.write_tokenizer(directory, config["vocab_size"])
    return out.with_name(out.name + "-reference")


@pytest.fixture(scope="module")
def tiny_float(tmp_path_factory):
    make_random_model.SHAPES["tiny-quant"] = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2,
                                                  tie_word_embeddings=True)
    try:
        return make_random_model.make_random_model("tiny-quant", tmp_path_factory.mktemp("tiny") / "float",
                                                   dtype="float32", seed=1)
    finally:
        del make_random_model.SHAPES["tiny-quant"]


@torch.inference_mode()
@pytest.mark.parametrize("layout", ["gptq", "gptq_v2", "awq", "fp8"])
def test_quantized_checkpoints_match_hf_on_their_dequantized_weights(tiny_float, tmp_path, layout):
    from transformers import AutoModelForCausalLM

    from runtime.models.loader import load_model
    from tests.models.test_quantization import causal_attention
    reference_dir = write_layout(tiny_float, tmp_path / layout, layout)
    model, _, _ = load_model(str(tmp_path / layout), "float32", "cpu", quantization="auto")
    kernels = linear_kernels(model)
    if layout == "fp8":
        assert "int4" not in kernels and "float32" in kernels
    else:
        assert isinstance(model.layers[0].self_attn.qkv_proj, DequantizedLinear) and kernels.count("int4") == 1
    hf = AutoModelForCausalLM.from_pretrained(str(reference_dir), torch_dtype=torch.float32).eval()
    ids = torch.tensor([5, 17, 300, 42, 9, 1000, 77, 256])
    ours = model.compute_logits(model(ids, torch.arange(len(ids)), causal_attention))
    torch.testing.assert_close(ours, hf(ids[None]).logits[0].float(), atol=1e-4, rtol=0)
    if layout == "awq":  # the bf16 int4 kernel runs it too, within bf16's reach
        bf16, _, _ = load_model(str(tmp_path / layout), "bfloat16", "cpu", quantization="auto")
        assert isinstance(bf16.layers[0].mlp.down_proj, Int4Linear)
        close = bf16.compute_logits(bf16(ids, torch.arange(len(ids)), causal_attention))
        assert (close.argmax(-1) == ours.argmax(-1)).float().mean() >= 0.75


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 32}, "8 bits is not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True}, "desc_act"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, "version 'gemv'"),
])
def test_quantization_configs_we_cannot_run_are_refused_before_loading(tiny_float, tmp_path, config, message):
    from runtime.models.loader import load_model
    (tmp_path / "config.json").write_text(json.dumps({**json.loads((tiny_float / "config.json").read_text()),
                                                      "quantization_config": config}))
    (tmp_path / "model.safetensors").write_bytes(b"never read")
    with pytest.raises(UnsupportedQuantizationError, match=message):
        load_model(str(tmp_path), quantization="auto")
