"""The EAGLE-3 head shipped for the default model (speculators/heads/smollm2-135m-eagle3):
`--speculator eagle` with no `--eagle-head` drafts with it on the default model, greedy
outputs stay the target's own, and it lands drafts; another model still needs a trained
head."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from runtime.models.loader import DEFAULT_MODEL, resolve_model
from runtime.sampling_params import SamplingParams
from speculators.heads import DEFAULT_EAGLE_HEAD, shipped_eagle_head

# Tokens per verify step with fixed trees (adaptive speculation off: the engine's 16-node
# EAGLE-2 trees every step, as the trainer's validation counts them) on the first 6
# held-out prompts, 64 tokens each, float32: 1.67 measured with the shipped head on a
# 2-core AVX-512 BF16 EPYC (its trainer's validation: 1.86 over all 35 held-out prompts,
# 192 tokens). An untrained head gives 1.0; the floor leaves room for other CPUs' float32
# sums flipping a near tie or two in the target's or the head's choices.
NUM_PROMPTS, MAX_TOKENS = 6, 64
MIN_ACCEPTANCE_LENGTH = 1.4


def test_the_shipped_head_is_the_default_models_and_small():
    assert shipped_eagle_head(DEFAULT_MODEL) == str(DEFAULT_EAGLE_HEAD)
    assert shipped_eagle_head(str(resolve_model(DEFAULT_MODEL).path)) == str(DEFAULT_EAGLE_HEAD)  # its file
    assert shipped_eagle_head("another-model") is None
    assert shipped_eagle_head(str(Path(__file__))) is None  # a file, not the default model's
    config = json.loads((DEFAULT_EAGLE_HEAD / "config.json").read_text())
    assert config["base_model"] == DEFAULT_MODEL and config["architectures"] == ["LlamaForCausalLMEagle3"]
    weights = DEFAULT_EAGLE_HEAD / "model.safetensors"
    assert weights.stat().st_size < 25 * 2**20  # committed to git
    from safetensors import safe_open
    with safe_open(str(weights), "pt") as f:
        assert {f.get_slice(name).get_dtype() for name in f.keys()} <= {"BF16", "I64"}


def test_another_model_still_needs_a_trained_head():
    from runtime.config import EngineConfig
    with pytest.raises(ValueError, match="needs a trained head"):
        EngineConfig(model="another-model.gguf", speculator="eagle")


def heldout_prompts(engine, n: int) -> list[list[int]]:
    """The first n held-out prompts (none of their kind was trained on), as token ids."""
    lines = (Path(__file__).resolve().parents[2] / "training" / "data" / "heldout_prompts.jsonl").read_text()
    return [engine.prompt_token_ids(json.loads(line)["messages"]) for line in lines.splitlines()[:n]]


def test_eagle_without_a_head_uses_the_shipped_one_losslessly(generate, caplog):
    """The default model in float32 speculating with eagle and no eagle_head (an engine of
    its own: the shared one must not change its speculator): the shipped head is loaded and
    logged, greedy outputs equal the same engine's plain decoding (per request:
    speculator="none"), and its drafts land. Plain requests afterwards do not pay for the
    loaded head: their steps ask the target for no per-token features (they once did, which
    took the compiled decode step away from every request: 2.5x the time per token)."""
    from runtime.engine import LLMEngine

    with caplog.at_level(logging.INFO, logger="speculators.eagle"):
        engine = LLMEngine(enforce_eager=True, dtype="float32", device="cpu", kv_cache_memory="128MiB",
                           quantization="none", speculator="eagle", adaptive_speculation=False)
        assert engine.config.eagle_head is None
        prompts = heldout_prompts(engine, NUM_PROMPTS)
        speculated = generate(engine, prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert str(DEFAULT_EAGLE_HEAD) in caplog.text and "shipped" in caplog.text  # which head was used
    stats = engine.stats
    steps, accepted = stats.num_verify_steps, stats.num_accepted_tokens
    assert steps > 0
    acceptance_length = stats.mean_acceptance_length
    print(f"shipped head: mean acceptance length {acceptance_length:.2f}, acceptance rate "
          f"{stats.acceptance_rate:.2f} over {steps} verify steps")
    asked = []  # what each plain step asks the target for besides logits
    execute = engine.runner.execute
    engine.runner.execute = lambda *args, **kwargs: asked.append(kwargs.get("return_hidden")) or execute(*args,
                                                                                                       **kwargs)
    plain = generate(engine, prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, speculator="none"))
    del engine.runner.execute
    assert engine.stats.num_verify_steps == steps and engine.stats.num_accepted_tokens == accepted  # plain: none
    assert asked and "all" not in asked  # no EAGLE sequence there: no per-token features, the compiled step stays
    assert speculated == plain
    assert acceptance_length > MIN_ACCEPTANCE_LENGTH, acceptance_length
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
