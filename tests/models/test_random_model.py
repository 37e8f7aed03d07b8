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


def test_the_default_models_shape_with_its_tokenizer_decodes_as_hf(tmp_path, monkeypatch, engine_f32):
    """The default model's shape (Llama: no biases), made smaller, with the default model's
    tokenizer copied in: our engine's greedy tokens are HF transformers' on the same random
    weights (what scripts/device_check.sh relies on where the GGUF cannot travel)."""
    import torch
    from transformers import AutoModelForCausalLM
    from runtime import LLM, SamplingParams
    tokenizer_dir = tmp_path / "tokenizer"
    engine_f32.tokenizer.save_pretrained(str(tokenizer_dir))
    with pytest.raises(ValueError, match="needs --tokenizer"):
        make_random_model.make_random_model("smollm2-135m", tmp_path / "none")
    monkeypatch.setitem(make_random_model.SHAPES, "tiny-llama", {
        **make_random_model.SHAPES["smollm2-135m"], "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2})
    out = make_random_model.make_random_model("tiny-llama", tmp_path / "tiny", dtype="float32", tokenizer=tokenizer_dir)
    llm = LLM(enforce_eager=True, model=str(out), device="cpu", dtype="float32", kv_cache_memory="64MiB")
    cfg = llm.engine.model_config
    assert (cfg.architecture, cfg.vocab_size, cfg.attention_bias, cfg.eos_token_ids) == ("llama", 49152, False, [2])
    prompt = "The capital of France is"
    ids = llm.engine.tokenize(prompt)
    assert ids == engine_f32.tokenize(prompt)
    ours = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=16,
                      min_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ours == ref[0, len(ids):].tolist()


def test_the_default_models_shape_has_its_parameter_count():
    cfg = make_random_model.hf_config("smollm2-135m")
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    per_layer = h * h * 2 + 2 * h * kv + 3 * h * inter + 2 * h
    total = cfg["vocab_size"] * h + layers * per_layer + h
    assert abs(total / 1e6 - 134.5) < 0.1, total
