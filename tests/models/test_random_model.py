"""scripts/make_random_model.py: the directory it writes loads through our loader (config,
weights, tokenizer) and runs, and the shapes it claims are Qwen2.5-Coder's."""
from __future__ import annotations

import pytest

from scripts import make_random_model


def test_a_small_qwen2_shape_loads_and_generates(tmp_path, monkeypatch):
    monkeypatch.setitem(make_random_model.SHAPES, "tiny", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=True))
    out = make_random_model.make_random_model("tiny", tmp_path / "tiny", dtype="float32")
    from runtime import LLM, SamplingParams
    llm = LLM(enforce_eager=True, model=str(out), device="cpu", dtype="float32", kv_cache_memory="64MiB")
    cfg = llm.engine.model_config
    assert (cfg.architecture, cfg.vocab_size, cfg.num_layers, cfg.num_kv_heads) == ("qwen2", 151936, 2, 2)
    assert cfg.attention_bias and cfg.eos_token_ids == [151645]
    tokenizer = llm.engine.tokenizer
    assert len(tokenizer) == 151936 and tokenizer.eos_token_id == 151645
    ids = tokenizer("Hello, wörld").input_ids
    assert len(ids) == len("Hello, wörld".encode()) and tokenizer.decode(ids) == "Hello, wörld"  # byte-level
    result = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                          use_tqdm=False)[0]
    assert len(result.token_ids) == 4 and result.text.strip()


@pytest.mark.parametrize("shape, billions", [("qwen2.5-0.5b", 0.49), ("qwen2.5-1.5b", 1.54)])
def test_the_shapes_have_the_published_parameter_counts(shape, billions):
    cfg = make_random_model.hf_config(shape)
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    per_layer = h * h * 2 + 2 * h * kv + h + 2 * kv + 3 * h * inter + 2 * h
    total = cfg["vocab_size"] * h + layers * per_layer + h
    assert abs(total / 1e9 - billions) < 0.01
