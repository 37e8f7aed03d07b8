"""Linear weights prepacked for oneDNN (runtime.models.packed_linear) on a bf16 CPU target.

The packed matmul sums in another order than F.linear, so both are held to the same
reference: float32 math on the same bf16 operands, and HF transformers' float32 model for
the whole target. Packing must lose nothing against the unpacked bf16 path it replaces.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from runtime.models.packed_linear import PackedLinear, can_prepack, prepack_linears

pytestmark = pytest.mark.skipif(not can_prepack(torch.bfloat16, torch.device("cpu")),
                                reason="no bf16 math (AMX or AVX-512 BF16) or no oneDNN here")

PROMPTS = ["The capital of France is", "Write a short poem about the sea.\n"]
# a longer text, so that top-1 agreement is counted over ~100 positions, not a handful
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
        "combined movable metal type, oil-based ink and a wooden screw press. Books, which had been "
        "copied by hand for centuries, could now be produced quickly and cheaply, and within fifty "
        "years presses were running in more than two hundred cities across Europe. Ideas travelled "
        "faster than ever before, and scholars could compare identical copies of the same text.")


@pytest.mark.parametrize("shape", [(1, 576), (5, 576), (64, 576), (2, 3, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_as_close_to_float32_math_as_linear(shape, bias):
    torch.manual_seed(0)
    linear = nn.Linear(576, 1000, bias=bias).bfloat16()
    x = torch.randn(shape).bfloat16()
    reference = nn.functional.linear(x.float(), linear.weight.float(),
                                     None if linear.bias is None else linear.bias.float())
    plain = linear(x).float()
    packed = PackedLinear(linear)(x)
    assert packed.shape == plain.shape and packed.dtype == torch.bfloat16
    plain_err = (plain - reference).abs().max().item()
    packed_err = (packed.float() - reference).abs().max().item()
    assert packed_err <= 2 * plain_err + 1e-2, (packed_err, plain_err)


def test_prepack_keeps_the_lm_head_weight_and_unpacks_it():
    from runtime.models.loader import load_model
    from speculators.base import frozen_on

    model = load_model("smollm2-135m", "bfloat16")[0]
    num_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert prepack_linears(model) == num_linear > 0
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert model.lm_head.weight is model.embed_tokens.weight  # tied: kept at no cost
    assert model.layers[0].mlp.down_proj.weight is None  # the rest lives only packed
    as_float = frozen_on(model.lm_head, torch.device("cpu"), torch.float32)  # a float32 head's copy
    assert isinstance(as_float, nn.Linear) and as_float.weight.dtype == torch.float32
    torch.testing.assert_close(as_float.weight, model.embed_tokens.weight.float())
    assert frozen_on(model.lm_head, torch.device("cpu"), torch.bfloat16) is model.lm_head
    # a float32 target's LM head, copied for bf16 heads on the CPU, is packed (and keeps its weight)
    float_head = nn.Linear(576, 1000, bias=False)
    copied = frozen_on(float_head, torch.device("cpu"), torch.bfloat16)
    assert isinstance(copied, PackedLinear) and copied.weight.dtype == torch.bfloat16
    x = torch.randn(3, 576).bfloat16()
    torch.testing.assert_close(copied(x), nn.functional.linear(x, float_head.weight.bfloat16()), atol=0.05, rtol=0.02)


@pytest.fixture(scope="module")
def bf16_engines():
    from runtime.engine import LLMEngine

    packed = LLMEngine(enforce_eager=True, dtype="bfloat16", device="cpu", kv_cache_memory="64MiB", quantization="none")
    plain = LLMEngine(enforce_eager=True, dtype="bfloat16", device="cpu", kv_cache_memory="64MiB", cpu_weight_prepack=False,
                      quantization="none")
    assert any(isinstance(m, PackedLinear) for m in packed.model.modules())
    assert not any(isinstance(m, PackedLinear) for m in plain.model.modules())
    return packed, plain


@torch.inference_mode()
def model_logits(engine, ids: list[int]) -> torch.Tensor:
    """Logits [T, V] at every position of ids from the engine's target model (causal attention
    without the KV cache; the generation test below runs the engine's own steps)."""
    from speculators.training import dense_causal_attention

    hidden = engine.model(torch.tensor(ids), torch.arange(len(ids)), dense_causal_attention)  # [T, H]
    return engine.model.compute_logits(hidden).float()


def test_bf16_target_logits_are_as_close_to_hf_packed_as_unpacked(bf16_engines, hf_smollm):
    packed, plain = bf16_engines
    for prompt in PROMPTS + [TEXT]:
        ids = packed.tokenize(prompt)
        with torch.no_grad():
            reference = hf_smollm(torch.tensor([ids])).logits[0].float()  # [T, V]
        errors, top1 = {}, {}
        for name, engine in (("packed", packed), ("plain", plain)):
            logits = model_logits(engine, ids)
            errors[name] = (logits - reference).abs().mean().item()
            top1[name] = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
        assert errors["packed"] <= 1.25 * errors["plain"], (prompt, errors)
        if len(ids) >= 50:  # short prompts flip a near tie or two either way
            assert top1["packed"] >= top1["plain"] - 0.05, (prompt, top1)


def test_bf16_greedy_generation_runs_packed(bf16_engines, generate):
    from runtime.sampling_params import SamplingParams

    packed, plain = bf16_engines
    prompts = [packed.tokenize(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    out_packed = generate(packed, prompts, params)
    out_plain = generate(plain, prompts, params)
    # bf16 sums in another order may flip a near tie, but not the first tokens of these prompts
    assert [o[:4] for o in out_packed] == [o[:4] for o in out_plain]
    assert packed.block_manager.num_free_blocks == packed.block_manager.num_blocks


def test_int8_layers_run_prepacked_past_their_row_limit():
    from draft_cpu.backends import int8_linear

    torch.manual_seed(0)
    linear = nn.Linear(576, 300, bias=True).bfloat16()
    limited = int8_linear(linear, max_int8_rows=2)
    assert isinstance(limited.float_layer, PackedLinear)
    many = torch.randn(5, 576).bfloat16()
    torch.testing.assert_close(limited(many), PackedLinear(linear)(many), atol=0, rtol=0)
    few = torch.randn(2, 576).bfloat16()
    torch.testing.assert_close(limited(few), int8_linear(linear)(few), atol=0, rtol=0)


@pytest.mark.parametrize("speculator", ["medusa", "eagle"])
def test_heads_share_the_packed_lm_head(bf16_engines, generate, tmp_path, speculator):
    """Medusa heads and an EAGLE-1 head project through the target's LM head, which on a
    bf16 CPU target is a PackedLinear: they draft through it, every draft is verified, and
    every KV block comes back."""
    from runtime.sampling_params import SamplingParams
    from speculators.eagle_heads import EagleHead, save_head
    from speculators.medusa import MedusaHeads, save_heads

    packed, _ = bf16_engines
    model = packed.model
    torch.manual_seed(4)
    if speculator == "medusa":
        heads = MedusaHeads(model.config.hidden_size, model.config.vocab_size, 3, 1, model.lm_head)
        for p in heads.parameters():
            nn.init.normal_(p, std=0.05)
        packed.config.medusa_heads = str(save_heads(heads, tmp_path / "medusa"))
    else:
        head = EagleHead(model.config, model.embed_tokens, model.lm_head)
        for p in head.parameters():
            nn.init.normal_(p, std=0.02)
        packed.config.eagle_head = str(save_head(head, tmp_path / "eagle"))
    packed.spec_controller.adaptive = False
    drafted = packed.stats.num_draft_tokens
    try:
        prompts = [packed.tokenize(p) for p in PROMPTS]
        outputs = generate(packed, prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                            speculator=speculator))
    finally:
        packed.spec_controller.adaptive = True
        packed.proposers.clear()
        packed.sync_feature_layers()
    assert all(len(o) == 8 for o in outputs)
    assert packed.stats.num_draft_tokens > drafted
    assert packed.block_manager.num_free_blocks == packed.block_manager.num_blocks
