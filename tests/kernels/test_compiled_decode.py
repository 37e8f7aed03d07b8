"""The compiled decode step (target_gpu.compiled_decode), the default on the CPU: a plain
decode step as one torch.compile'd graph gives plain eager decoding's tokens (float32, the
default model, one and several sequences at once, prompts longer than a block), for the
target and for a CPU draft model; both graphs are compiled when the engine starts, so no
request waits on compilation, and traced once; every block comes back."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from runtime.draft_tree import DraftTree
from runtime.sampling_params import SamplingParams

PROMPTS = ["Explain how a hash table works.", "def fibonacci(n):",
           "Once upon a time in a small village by the sea, there lived an old fisherman who"]


@pytest.fixture(scope="module")
def compiled_engine():
    from runtime.engine import LLMEngine
    engine = LLMEngine(dtype="float32", device="cpu", kv_cache_memory="64MiB", quantization="none")
    assert engine.runner.compiled_decode is not None  # the default: enforce_eager=False
    return engine


@pytest.mark.parametrize("thread", ["main", "own"])
def test_the_decode_step_is_traced_once(engine_f32, tmp_path, thread):
    """Dynamo (torch >= 2.6) traced every float module attribute (each RMSNorm's eps) as a
    symbol, specialized them afterwards and traced the whole decoder again: 53 of a 64 s
    start. A fresh eps (floats are guarded on) makes sure this model is traced here. Built on
    a thread of its own too, as the draft worker's runner is: torch >= 2.12 keeps Dynamo's
    settings per thread."""
    from runtime.engine import LLMEngine
    from tests.helpers import save_tiny_model
    save_tiny_model("llama3", tmp_path, engine_f32.tokenizer, rms_norm_eps=3.21e-5 if thread == "main" else 3.23e-5)
    metrics = torch._dynamo.utils.compilation_time_metrics
    for attempt in ("compile_attempt_0", "compile_attempt_1"):
        metrics.pop(attempt, None)
    build = lambda: LLMEngine(model=str(tmp_path), dtype="float32", device="cpu", kv_cache_memory="16MiB").close()  # noqa: E731
    if thread == "main":
        build()
    else:
        with ThreadPoolExecutor(1) as pool:
            pool.submit(build).result()
    assert "compile_attempt_0" in metrics and "compile_attempt_1" not in metrics


def counting(runner):
    """Count the runner's compiled steps; returns (calls list, restore function)."""
    calls, step = [], runner.compiled_decode
    runner.compiled_decode = lambda *a: calls.append(1) or step(*a)
    return calls, lambda: setattr(runner, "compiled_decode", step)


def test_compiled_decode_gives_eager_decodings_tokens(compiled_engine, engine_f32, generate):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    calls, restore = counting(compiled_engine.runner)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    try:
        assert generate(compiled_engine, PROMPTS[:1], params) == generate(engine_f32, PROMPTS[:1], params)
        assert generate(compiled_engine, PROMPTS, params) == generate(engine_f32, PROMPTS, params)
    finally:
        restore()
    assert len(calls) >= 2 * 23  # every decode step of both runs went through the compiled graph
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # compiled at start, not here
    blocks = compiled_engine.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks


def test_compiled_draft_model_gives_plain_eager_decodings_tokens(compiled_engine, engine_f32, generate):
    """The default model drafting for itself on the CPU, torch backend: its worker's decode
    steps are compiled too (the target's graphs: one compiled function serves every engine)."""
    from runtime.engine import LLMEngine
    engine = LLMEngine(dtype="float32", device="cpu", kv_cache_memory="64MiB", quantization="none",
                       speculator="draft", draft_model="smollm2-135m", draft_dtype="float32", draft_quantization="none",
                       draft_backend="torch",
                       num_speculative_tokens=3, adaptive_speculation=False)
    try:
        worker = engine.pool.get("draft").worker
        assert worker.runner.compiled_decode is not None
        calls, restore = counting(worker.runner)
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        try:
            assert generate(engine, PROMPTS, params) == generate(engine_f32, PROMPTS, params)
        finally:
            restore()
        assert calls  # the draft's one-token steps ran compiled
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        engine.close()


def first_decode_step(engine, compiled: bool, trees=None, hidden: bool = False) -> torch.Tensor:
    """Next-token probabilities [R, V] after PROMPTS[:2], prefilled eagerly but for their last
    token, which one decode step runs (compiled or eager; with draft trees below those
    tokens, a verify step), in blocks 0-3 of a fresh engine; with `hidden`, every token's
    hidden states [T, H'] instead."""
    from types import SimpleNamespace
    runner = engine.runner
    seqs = [SimpleNamespace(token_ids=engine.tokenize(p), num_computed_tokens=0, block_table=[2 * i, 2 * i + 1])
            for i, p in enumerate(PROMPTS[:2])]
    runner.execute(seqs, [len(s.token_ids) - 1 for s in seqs], [True, True])
    for s in seqs:
        s.num_computed_tokens = len(s.token_ids) - 1
    step = runner.compiled_decode
    if not compiled:
        runner.compiled_decode = None
    try:
        if hidden:
            return runner.execute(seqs, [1, 1], [True, True], trees, return_hidden="all")[1]
        return runner.execute(seqs, [1, 1], [True, True], trees).float().softmax(-1)
    finally:
        runner.compiled_decode = step


def test_compiled_step_over_prepacked_bf16_weights_is_as_close_to_float32_as_eager():
    """bf16, quantization none: oneDNN-prepacked linear layers (PackedLinear, where this CPU
    has bf16 math) go through the graph as an op of their own. Its next-token distribution
    is within bf16 noise of float32's, as the eager step's is (total variation 0.01-0.03)."""
    from runtime.engine import LLMEngine
    from runtime.models.packed_linear import PackedLinear, can_prepack
    engine = LLMEngine(dtype="bfloat16", device="cpu", kv_cache_memory="16MiB", quantization="none")
    packed = any(isinstance(m, PackedLinear) for m in engine.runner.model.modules())
    assert packed == can_prepack(torch.bfloat16, torch.device("cpu"))
    compiled, eager = first_decode_step(engine, True), first_decode_step(engine, False)
    reference = first_decode_step(LLMEngine(dtype="float32", device="cpu", kv_cache_memory="16MiB",
                                            quantization="none", enforce_eager=True), False)
    assert torch.equal(compiled.argmax(-1), eager.argmax(-1))
    total_variation = (compiled - reference).abs().sum(-1) / 2  # [2]
    assert total_variation.max().item() < 0.05, total_variation


def test_compiled_step_over_quantized_weights_at_any_batch_compiles_nothing_after_start(generate):
    """The default model's defaults where this CPU has bf16 math (bf16, --quantization auto:
    int4/int8 layers): 34 sequences at once (more rows than MANY_ROWS_AMX: on CPUs with AMX
    the layers switch to their bf16 GEMM inside their op) and one at a time run the start-up
    graphs only; against
    the same quantized weights computed exactly (float32), the 34 at once pick the first
    token as often as one at a time does."""
    from runtime.engine import LLMEngine
    from runtime.models.quant_linear import MANY_ROWS_AMX
    engine = LLMEngine(dtype="bfloat16", device="cpu", kv_cache_memory="64MiB")
    exact = LLMEngine(dtype="float32", device="cpu", kv_cache_memory="64MiB", enforce_eager=True)
    try:
        calls, restore = counting(engine.runner)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        prompts = [f"{PROMPTS[i % 3]} ({i})" for i in range(34)]
        assert len(prompts) > MANY_ROWS_AMX
        try:
            together = generate(engine, prompts, params)
            alone = [generate(engine, [p], params)[0] for p in prompts]
        finally:
            restore()
        assert len(calls) >= 35 * 5
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
        reference = generate(exact, prompts, params)
        together_agree = sum(a[0] == r[0] for a, r in zip(together, reference))
        alone_agree = sum(a[0] == r[0] for a, r in zip(alone, reference))
        assert together_agree >= max(alone_agree - 1, 0.8 * len(prompts)), (together_agree, alone_agree)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        engine.close()
        exact.close()


def first_verify_step(engine, compiled: bool) -> torch.Tensor:
    """first_decode_step's verify step: a branching draft tree below the first sequence's
    token, a chain below the second's."""
    trees = [DraftTree([11, 12, 13, 14, 15], [-1, -1, 0, 0, 2]), DraftTree([21, 22, 23], [-1, 0, 1])]
    return first_decode_step(engine, compiled, trees)


def test_compiled_verify_step_matches_eager(compiled_engine):
    """A verify step of two sequences, a tree and a chain below them, runs compiled (its
    [T, L] mask: context, self and tree ancestors) with eager's probabilities (float32), on
    the graphs compiled at start."""
    calls, restore = counting(compiled_engine.runner)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    try:
        compiled = first_verify_step(compiled_engine, True)
    finally:
        restore()
    eager = first_verify_step(compiled_engine, False)
    assert calls and compiled.shape == eager.shape == (2 + 5 + 3, compiled_engine.model_config.vocab_size)
    assert (compiled - eager).abs().max().item() < 1e-4
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_compiled_verify_steps_give_plain_decodings_tokens(compiled_engine, engine_f32, generate):
    """Lookahead's trees verified by the compiled step, greedy: plain eager decoding's tokens."""
    trees = []
    step = compiled_engine.runner.compiled_decode
    compiled_engine.runner.compiled_decode = lambda s, *a: trees.append(len(s.input_ids) > len(s.attn_inputs)) \
        or step(s, *a)
    before = compiled_engine.stats.num_draft_tokens
    try:
        got = generate(compiled_engine, PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                                 speculator="lookahead"))
    finally:
        compiled_engine.runner.compiled_decode = step
    assert got == generate(engine_f32, PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert compiled_engine.stats.num_draft_tokens > before and any(trees)
    blocks = compiled_engine.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks


def test_compiled_verify_step_returns_eagle3_features_as_eager(engine_f32, tmp_path):
    """EAGLE-3 reads the residual stream entering target layers after every token: a verify
    step run compiled returns them ([T, 3H], tiny two-layer Qwen2, both layers) as the eager
    step does (float32). Dynamo once compiled them away (`i in layers` over a tuple of
    ints), silently."""
    from runtime.engine import LLMEngine
    from tests.helpers import save_tiny_model
    save_tiny_model("qwen2", tmp_path, engine_f32.tokenizer)
    engine = LLMEngine(model=str(tmp_path), dtype="float32", device="cpu", kv_cache_memory="16MiB")
    engine.runner.set_feature_layers((0, 1))
    calls, restore = counting(engine.runner)
    try:
        trees = [DraftTree([11, 12], [-1, 0]), DraftTree([21], [-1])]
        compiled = first_decode_step(engine, True, trees, hidden=True)
    finally:
        restore()
    eager = first_decode_step(engine, False, trees, hidden=True)
    assert calls and compiled.shape == eager.shape == (2 + 2 + 1, 3 * engine.model_config.hidden_size)
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)


def test_models_that_differ_only_in_a_float_the_graph_bakes_in_get_graphs_of_their_own(engine_f32, tmp_path):
    """The compiled step checks the model's structure key, not the model itself
    (target_gpu.step_guards). Two tiny models with the same weights, whose norms' eps differ
    (a constant in the graphs), each decode as eager does, one after the other."""
    from runtime.engine import LLMEngine
    from tests.helpers import save_tiny_model
    for eps in (1.11e-6, 0.25):
        save_tiny_model("llama3", tmp_path / str(eps), engine_f32.tokenizer, rms_norm_eps=eps)
        engine = LLMEngine(model=str(tmp_path / str(eps)), dtype="float32", device="cpu", kv_cache_memory="16MiB")
        compiled, eager = first_decode_step(engine, True), first_decode_step(engine, False)
        assert (compiled - eager).abs().max().item() < 1e-4, eps
