"""Linear weights prepacked for oneDNN (runtime.models.packed_linear) on a bf16 CPU target.

The packed matmul sums in another order than F.linear, so both are held to the same
reference: float32 math on the same bf16 operands, and HF transformers' float32 model for
the whole target. Packing must lose nothing against the unpacked bf16 path it replaces.

The dtype rule (a linear layer returns its input's dtype, computed in its weight's) is
checked for every choice the code can make, whatever this CPU is: the CPU's bf16 math
(runtime.platform.cpu_has_bf16_math, which decides `can_prepack`) is forced both ways, so
packed and row-major layers of either weight dtype meet inputs of either dtype. An AMX
Xeon took the packed bf16 path with float32 inputs (a float32 EAGLE head in training over
a bf16 target's LM head) where the development CPUs never did.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import runtime.models.packed_linear as packed_linear
from runtime.models.packed_linear import PackedLinear, apply_linear, can_prepack, prepack_linears

# the tests below that run this CPU's own choices (the rule's tests force them)
needs_bf16_math = pytest.mark.skipif(not can_prepack(torch.bfloat16, torch.device("cpu")),
                                     reason="no bf16 math (AMX or AVX-512 BF16) or no oneDNN here")
DTYPES = [torch.float32, torch.bfloat16]

PROMPTS = ["The capital of France is", "Write a short poem about the sea.\n"]
# a longer text, so that top-1 agreement is counted over ~100 positions, not a handful
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
        "combined movable metal type, oil-based ink and a wooden screw press. Books, which had been "
        "copied by hand for centuries, could now be produced quickly and cheaply, and within fifty "
        "years presses were running in more than two hundred cities across Europe. Ideas travelled "
        "faster than ever before, and scholars could compare identical copies of the same text.")


@needs_bf16_math
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


@needs_bf16_math
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
    from training.common import dense_causal_attention

    hidden = engine.model(torch.tensor(ids), torch.arange(len(ids)), dense_causal_attention)  # [T, H]
    return engine.model.compute_logits(hidden).float()


@needs_bf16_math
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


@needs_bf16_math
def test_bf16_greedy_generation_runs_packed(bf16_engines, generate):
    from runtime.sampling_params import SamplingParams

    packed, plain = bf16_engines
    prompts = [packed.tokenize(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    out_packed = generate(packed, prompts, params)
    out_plain = generate(plain, prompts, params)
    # bf16 sums in another order may flip a near tie as early as the second token (the test
    # above bounds the packed logits' error against HF's); the first token is clear-cut
    assert [o[:1] for o in out_packed] == [o[:1] for o in out_plain]
    assert all(len(o) == 12 for o in out_packed)
    assert packed.block_manager.num_free_blocks == packed.block_manager.num_blocks


@needs_bf16_math
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


@needs_bf16_math
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
        settings = dict(medusa_heads=str(save_heads(heads, tmp_path / "medusa")))
    else:
        head = EagleHead(model.config, model.embed_tokens, model.lm_head)
        for p in head.parameters():
            nn.init.normal_(p, std=0.02)
        settings = dict(eagle_head=str(save_head(head, tmp_path / "eagle")))
    packed.update_speculation(adaptive_speculation=False, **settings)
    drafted = packed.stats.num_draft_tokens
    try:
        prompts = [packed.tokenize(p) for p in PROMPTS]
        outputs = generate(packed, prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                            speculator=speculator))
    finally:
        packed.update_speculation(adaptive_speculation=True, medusa_heads=None, eagle_head=None)
    assert all(len(o) == 8 for o in outputs)
    assert packed.stats.num_draft_tokens > drafted
    assert packed.block_manager.num_free_blocks == packed.block_manager.num_blocks


# ---- the dtype rule, for every choice the code can make -------------------------------------

def onednn_runs_bf16() -> bool:
    """Whether oneDNN has bf16 kernels on this CPU at all (emulated or native): a packed
    bf16 layer cannot run without them, whatever the code chooses."""
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and (supported is None or bool(supported())))


def tiny_bf16_target(seed: int):
    """(config, bf16 embedding, bf16 LM head) of a tiny random Llama target, for heads to share."""
    from runtime.models.config import ModelConfig
    cfg = ModelConfig("llama", vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=256)
    torch.manual_seed(seed)
    embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size).bfloat16()
    lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False).bfloat16()
    return cfg, embed, lm_head


def bf16_close(actual: torch.Tensor, reference: torch.Tensor) -> None:
    """Within bf16 rounding of the float32 reference (operands rounded to bf16, another order)."""
    scale = reference.abs().max().item()
    torch.testing.assert_close(actual.float(), reference, atol=0.02 * scale + 1e-3, rtol=0.02)


@pytest.mark.parametrize("bf16_math", [True, False], ids=["bf16-math", "no-bf16-math"])
@pytest.mark.parametrize("weight_dtype", DTYPES, ids=["w-f32", "w-bf16"])
@pytest.mark.parametrize("x_dtype", DTYPES, ids=["x-f32", "x-bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_every_linear_the_code_chooses_returns_the_inputs_dtype(monkeypatch, bf16_math, weight_dtype, x_dtype, bias):
    """prepack_linears (the target's load) and frozen_on (a head's copy of the target's LM
    head) choose packed or row-major by can_prepack; whichever they chose, the layer takes
    an input of either dtype through apply_linear (a PackedLinear also called directly), and
    gives F.linear's float32 result within bf16 rounding, in the input's dtype."""
    from speculators.base import frozen_on

    monkeypatch.setattr(packed_linear, "cpu_has_bf16_math", lambda: bf16_math)
    packs = can_prepack(weight_dtype, torch.device("cpu"))
    assert packs == (bf16_math and weight_dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
                     and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
    if packs and not onednn_runs_bf16():
        pytest.skip("oneDNN has no bf16 kernels on this CPU")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(576, 300, bias=bias)).to(weight_dtype)
    weight = model[0].weight.detach().float()
    b = None if model[0].bias is None else model[0].bias.detach().float()
    assert prepack_linears(model) == int(packs)
    layer = model[0]
    assert isinstance(layer, PackedLinear) == packs
    float_source = nn.Linear(576, 300, bias=bias)  # a float32 target's LM head, copied for a head in weight_dtype
    with torch.no_grad():
        float_source.weight.copy_(weight)
        if bias:
            float_source.bias.copy_(b)
    copied = frozen_on(float_source, torch.device("cpu"), weight_dtype)
    assert isinstance(copied, PackedLinear) == packs
    for shape in [(1, 576), (5, 576), (2, 3, 576)]:
        x = torch.randn(shape).to(x_dtype)
        reference = nn.functional.linear(x.float(), weight, b)
        calls = [apply_linear(layer, x), apply_linear(copied, x)]
        if packs:
            calls += [layer(x), copied(x)]
        for y in calls:
            assert y.dtype == x_dtype and y.shape == (*shape[:-1], 300)
            bf16_close(y, reference)


def test_packed_linear_takes_float32_input_over_a_bf16_weight():
    """The AMX Xeon's failure, forced on any CPU with oneDNN bf16: a float32 input to a
    packed bf16 weight (oneDNN's primitive wants one dtype) comes back in float32."""
    if not onednn_runs_bf16():
        pytest.skip("oneDNN has no bf16 kernels on this CPU")
    torch.manual_seed(1)
    linear = nn.Linear(576, 1000).bfloat16()
    x = torch.randn(4, 576)
    y = PackedLinear(linear)(x)
    assert y.dtype == torch.float32
    bf16_close(y, nn.functional.linear(x, linear.weight.float(), linear.bias.float()))


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "row-major"])
def test_eagle_head_drafts_float32_features_through_a_bf16_lm_head(packed):
    """A float32 EAGLE-1 head (as training keeps it) sharing a bf16 target's LM head: packed
    where bf16 math is native (the AMX Xeon), row-major where it is not (--dtype bfloat16
    on an AVX2 CPU). draft_logits and the proposer's drafting (EagleProposer._feed, the
    path of training's validation) both run, and the logits are the float32 ones within
    bf16 rounding."""
    from runtime.sampling_params import SamplingParams
    from speculators.base import ProposalRequest
    from speculators.eagle import EagleProposer
    from speculators.eagle_heads import EagleHead

    if packed and not onednn_runs_bf16():
        pytest.skip("oneDNN has no bf16 kernels on this CPU")
    cfg, embed, lm_head = tiny_bf16_target(seed=2)
    shared = PackedLinear(lm_head, keep_weight=True) if packed else lm_head
    head = EagleHead(cfg, embed, shared).float()
    for p in head.parameters():
        nn.init.normal_(p, std=0.1)
    features = torch.randn(6, cfg.hidden_size)  # float32
    logits = head.draft_logits(features)
    assert logits.dtype == torch.float32 and logits.shape == (6, cfg.vocab_size)
    bf16_close(logits, nn.functional.linear(features, lm_head.weight.float()))

    proposer = EagleProposer(head, torch.device("cpu"), 3, num_kv_tokens=128)
    ids = torch.randint(0, cfg.vocab_size, (12,)).tolist()
    request = ProposalRequest("0", ids, 8, 8, 2, SamplingParams(temperature=0.0),
                              new_features=[(0, torch.randn(len(ids) - 1, cfg.hidden_size))])
    tree = proposer.propose([request])[0]
    assert len(tree) > 0
    proposer.release("0")


def test_packed_linear_backpropagates_through_its_kept_weight():
    """oneDNN's packed op has no backward (autograd passed no gradient through it, with a
    warning only: a head trained through a packed LM head learned nothing from its logits).
    An input that requires grad goes through the kept row-major weight; a layer that kept
    none refuses; without grad the packed op runs."""
    if not onednn_runs_bf16():
        pytest.skip("oneDNN has no bf16 kernels on this CPU")
    torch.manual_seed(3)
    linear = nn.Linear(576, 300).bfloat16()
    kept, bare = PackedLinear(linear, keep_weight=True), PackedLinear(linear)
    for x_dtype in DTYPES:
        x = torch.randn(4, 576, dtype=x_dtype, requires_grad=True)
        y = kept(x)
        assert y.dtype == x_dtype
        bf16_close(y.detach(), nn.functional.linear(x.detach().float(), linear.weight.float(), linear.bias.float()))
        upstream = torch.randn(4, 300)
        (y.float() * upstream).sum().backward()
        assert x.grad is not None and x.grad.dtype == x_dtype
        bf16_close(x.grad, upstream @ linear.weight.float())  # dL/dx = g W
        with pytest.raises(RuntimeError, match="backpropagate"):
            bare(torch.randn(2, 576, dtype=x_dtype, requires_grad=True))
        with torch.no_grad():
            assert bare(x).dtype == x_dtype
    with torch.inference_mode():
        assert bare(torch.randn(2, 576)).dtype == torch.float32


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "row-major"])
def test_eagle_head_trains_through_a_bf16_lm_head(packed):
    """A float32 EAGLE-1 head trained over a bf16 target's shared LM head (packed where bf16
    math is native): the logits' cross-entropy reaches the head's own layers, as it does
    through a float32 copy of that LM head."""
    from speculators.eagle_heads import EagleHead

    if packed and not onednn_runs_bf16():
        pytest.skip("oneDNN has no bf16 kernels on this CPU")
    cfg, embed, lm_head = tiny_bf16_target(seed=5)
    heads = {}
    for name, shared in (("bf16", PackedLinear(lm_head, keep_weight=True) if packed else lm_head),
                         ("float32", nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False))):
        if name == "float32":
            shared.weight.data.copy_(lm_head.weight.float())
        torch.manual_seed(6)
        head = heads[name] = EagleHead(cfg, embed, shared).float()
        features = torch.randn(10, cfg.hidden_size)
        labels = torch.randint(0, cfg.vocab_size, (10,))
        loss = nn.functional.cross_entropy(head.draft_logits(head.fc(torch.cat([features, features], -1))), labels)
        loss.backward()
    grad, reference = heads["bf16"].fc.weight.grad, heads["float32"].fc.weight.grad
    assert grad is not None and grad.abs().sum() > 0
    bf16_close(grad, reference)
