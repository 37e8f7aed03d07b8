"""The engine with its target split over tensor-parallel ranks (target_gpu.tensor_parallel):
worker processes over gloo, one message a step. The default model at TP=3 (its 9 heads and
3 KV heads split in 3) gives the single-process engine's greedy outputs, plain and with
lookahead trees (tree masks and KV commits cross the process boundary), and close()
leaves no worker behind."""
import pytest

from runtime.config import EngineConfig
from tests.helpers import greedy, new_engine

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
           "List the planets of the solar system in order: Mercury, Venus,"]


def test_tp3_equals_tp1_greedy_plain_and_speculative(engine_f32, generate):
    plain = generate(engine_f32, PROMPTS, greedy(32))
    engine = new_engine(tensor_parallel_size=3, adaptive_speculation=False)
    workers = list(engine.runner.workers)
    try:
        assert len(workers) == 2 and all(w.is_alive() for w in workers)
        assert generate(engine, PROMPTS, greedy(32)) == plain
        drafted = engine.stats.num_draft_tokens
        assert generate(engine, PROMPTS, greedy(32, speculator="lookahead")) == plain
        assert engine.stats.num_accepted_tokens > 0 and engine.stats.num_draft_tokens > drafted
    finally:
        engine.close()
    assert not any(w.is_alive() for w in workers)


def test_bad_tensor_parallel_settings_are_refused():
    with pytest.raises(ValueError, match="quantization='none'"):
        EngineConfig(tensor_parallel_size=2)
    with pytest.raises(ValueError, match=">= 1"):
        EngineConfig(tensor_parallel_size=0, quantization="none")
    with pytest.raises(ValueError, match="9 attention heads, 3 KV heads"):
        new_engine(tensor_parallel_size=2)
