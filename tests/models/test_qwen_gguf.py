"""Opt-in: a real Qwen2.5 GGUF (q/k/v bias, GQA 14/2, no q/k permutation) against HF, and
its own chat template's tool calls read back by tool_choice auto.

Set HETEROSPEC_QWEN_GGUF to a file fetched with scripts/fetch_qwen_gguf.py; skipped
otherwise (too slow for the default CI path on 2 cores).
"""
import os
from pathlib import Path

import pytest
import torch

GGUF = os.environ.get("HETEROSPEC_QWEN_GGUF")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not GGUF, reason="set HETEROSPEC_QWEN_GGUF to a Qwen2.5 GGUF")]
PROMPTS = ["def quicksort(arr):", [{"role": "user", "content": "Write a Python function that reverses a string."}]]


def test_qwen_gguf_greedy_matches_hf():
    from transformers import AutoModelForCausalLM
    from runtime.engine import LLMEngine
    from runtime.sampling_params import SamplingParams
    path = Path(GGUF)
    engine = LLMEngine(enforce_eager=True, model=str(path), dtype="float32", device="cpu", kv_cache_memory="256MiB",
                       quantization="none")  # HF dequantizes the file to float32
    assert engine.model_config.architecture == "qwen2" and engine.model_config.attention_bias
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float32)
    ids = [engine.tokenize(p) for p in PROMPTS]
    for i, prompt_ids in enumerate(ids):
        engine.add_request(prompt_ids, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), f"r{i}")
    outputs = {}
    while engine.has_unfinished:
        outputs.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    for i, prompt_ids in enumerate(ids):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=24, do_sample=False,
                                   eos_token_id=None)[0, len(prompt_ids):].tolist()
        assert outputs[f"r{i}"] == expected


def test_qwen_auto_tool_calls_through_its_own_template():
    """Qwen2.5's template renders tools itself (no Hermes fallback) and the model answers a
    weather question with a Hermes call, which tool_choice auto reads back as a call."""
    from runtime import LLM, SamplingParams
    from runtime.prompts import chat_text
    from runtime.tool_calls import ToolChoice
    weather = {"name": "get_weather", "description": "The weather in a city",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    llm = LLM(model=GGUF, dtype="float32", max_num_seqs=2)
    tools = [{"type": "function", "function": weather}]
    text = chat_text(llm.engine.tokenizer, messages, tools)
    assert "get_weather" in text and "You may call functions" not in text  # the template's own rendering
    out = llm.generate({"messages": messages, "tools": tools}, SamplingParams(temperature=0, max_tokens=40),
                       use_tqdm=False)[0]
    content, calls = ToolChoice((weather,), "auto").parse(out.text)
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Oslo"}')], out.text
