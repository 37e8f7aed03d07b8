"""The compiled decode step (target_gpu.compiled_decode): a plain decode step as one
torch.compile'd graph gives plain eager decoding's tokens (float32, the default model, one
and several sequences at once, prompts longer than a block) and frees every block."""
from __future__ import annotations

import pytest

from runtime.sampling_params import SamplingParams

PROMPTS = ["Explain how a hash table works.", "def fibonacci(n):",
           "Once upon a time in a small village by the sea, there lived an old fisherman who"]


@pytest.fixture(scope="module")
def compiled_engine():
    from runtime.engine import LLMEngine
    engine = LLMEngine(dtype="float32", device="cpu", kv_cache_memory="64MiB", quantization="none",
                       compile_decode=True)
    assert engine.runner.compiled_decode is not None
    return engine


def test_compiled_decode_gives_eager_decodings_tokens(compiled_engine, engine_f32, generate):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    calls = []
    step = compiled_engine.runner.compiled_decode
    compiled_engine.runner.compiled_decode = lambda *a: calls.append(1) or step(*a)
    try:
        assert generate(compiled_engine, PROMPTS[:1], params) == generate(engine_f32, PROMPTS[:1], params)
        assert generate(compiled_engine, PROMPTS, params) == generate(engine_f32, PROMPTS, params)
    finally:
        compiled_engine.runner.compiled_decode = step
    assert len(calls) >= 2 * 23  # every decode step of both runs went through the compiled graph
    blocks = compiled_engine.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks
