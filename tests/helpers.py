"""Helpers the tests share (fixtures are in conftest.py)."""
from __future__ import annotations

from runtime.sampling_params import SamplingParams
from speculators.registry import Speculator, register


def greedy(max_tokens: int = 32, **kwargs) -> SamplingParams:
    """Greedy decoding of exactly max_tokens tokens (EOS ignored), with any other fields."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def run_to_completion(engine, prompts, params, max_steps: int = 100_000) -> list[list[int]]:
    """Add every prompt (with its SamplingParams, or one for all), step until all finish.

    Returns the output token ids of each prompt, in order. Whatever happens, the engine is
    left idle (unfinished requests are aborted), so a failing test cannot poison the next.
    """
    if not isinstance(params, (list, tuple)):
        params = [params] * len(prompts)
    ids = []
    finished: dict[str, list[int]] = {}
    try:
        ids.extend(engine.add_request(p, sp) for p, sp in zip(prompts, params))
        for _ in range(max_steps):
            if not engine.has_unfinished:
                break
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = list(out.token_ids)
        else:
            raise AssertionError(f"engine did not finish within {max_steps} steps")
    finally:
        for rid in ids:
            if rid not in finished:
                engine.abort(rid)
    return [finished[rid] for rid in ids]


def toy_speculator(name: str, proposer, num_speculative_tokens: int = 4, tree_width: int = 1) -> str:
    """Register a speculator whose proposer is the given object (replacing a toy of that
    name); a request asks for it by name. Returns the name."""
    register(Speculator(name, lambda config, target: proposer, num_speculative_tokens, tree_width), replace=True)
    return name


def new_engine(**settings):
    """A float32 CPU engine on the default model of its own (the session's engine_f32 is
    never reconfigured), eager, with these settings."""
    from runtime.engine import LLMEngine
    defaults = dict(enforce_eager=True, dtype="float32", device="cpu", kv_cache_memory="256MiB", quantization="none")
    return LLMEngine(**{**defaults, **settings})
