"""`python -m runtime.generate`: JSONL in, JSONL out, bad lines skipped and reported.

The greedy reference is `runtime.LLM.generate` on the same prompts and settings.
"""
from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import LLM, SamplingParams
from runtime.generate import LineError, main, parse_line
from runtime.sampling_params import GuidedSpec

REPO = Path(__file__).resolve().parents[2]
ENGINE_ARGS = ["--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "128MiB"]
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]

LINES = [
    json.dumps({"prompt": "The quick brown fox"}),                                 # 1
    json.dumps({"messages": MESSAGES}),                                            # 2
    "",                                                                            # 3 blank: ignored
    json.dumps({"id": "q-7", "prompt": "Once upon a time", "max_tokens": 4, "tags": ["a"]}),  # 4
    '{"prompt": "unterminated',                                                    # 5 invalid JSON
    json.dumps({"prompt": "Hello", "temperature": -1}),                            # 6 invalid temperature
    json.dumps({"text": "neither prompt nor messages"}),                           # 7
]


@pytest.fixture(scope="module")
def llm():
    return LLM(enforce_eager=True, model="smollm2-135m", dtype="float32", device="cpu", kv_cache_memory="128MiB")


@pytest.fixture(scope="module")
def run(llm, tmp_path_factory):
    """Run the CLI once on LINES (two batches of two) and keep what it returned and printed."""
    tmp = tmp_path_factory.mktemp("generate")
    src, dst = tmp / "prompts.jsonl", tmp / "out.jsonl"
    src.write_text("\n".join(LINES) + "\n")
    with contextlib.redirect_stderr(io.StringIO()) as stderr:
        code = main(["--input", str(src), "--output", str(dst), "--max-tokens", "8", "--temperature", "0",
                     "--batch-size", "2", *ENGINE_ARGS], llm=llm)
    outputs = [json.loads(line) for line in dst.read_text().splitlines()]
    return code, outputs, stderr.getvalue(), src


def test_outputs_in_input_order_with_carried_keys(run):
    code, outputs, _, _ = run
    assert len(outputs) == 3
    first, second, third = outputs
    assert set(first) == {"text", "token_ids", "finish_reason", "metrics"}
    assert set(second) == set(first)
    assert third["id"] == "q-7" and third["tags"] == ["a"]
    assert "prompt" not in third and "max_tokens" not in third
    for out in outputs:
        assert {"ttft_s", "tpot_s", "e2e_s", "num_tokens"} <= set(out["metrics"])
        assert out["metrics"]["num_tokens"] == len(out["token_ids"])
        assert out["finish_reason"] in ("stop", "length")
    assert len(first["token_ids"]) <= 8 and len(third["token_ids"]) <= 4  # the line's max_tokens wins


def test_bad_lines_are_reported_by_line_number_and_exit_1(run):
    code, _, stderr, src = run
    assert code == 1
    skipped = [line for line in stderr.splitlines() if ": skipped: " in line]
    assert [line.split(": skipped: ")[0] for line in skipped] == [f"{src}:5", f"{src}:6", f"{src}:7"]
    assert "invalid JSON" in skipped[0]
    assert "temperature" in skipped[1]
    assert "prompt" in skipped[2] and "messages" in skipped[2]
    assert "summary: requests: 3" in stderr


def test_near_misses_of_the_keys_a_line_takes_are_typos(llm):
    """Copied to the output, a misspelt key would leave its line running without the setting."""
    defaults = SamplingParams(max_tokens=8)
    for line, meant in [({"prompt": "Hi", "max_token": 4}, "max_tokens"), ({"prompts": "Hi"}, "prompt"),
                        ({"prompt": "Hi", "Top-P": 0.5}, "top_p"), ({"prompt": "Hi", "stops": ["."]}, "stop")]:
        with pytest.raises(LineError, match=f"did you mean '{meant}'"):
            parse_line(json.dumps(line).encode(), llm, defaults)
    job = parse_line(json.dumps({"prompt": "Hi", "custom_id": 1, "messages_id": 2, "temp": 3}).encode(), llm, defaults)
    assert job.carried == {"custom_id": 1, "messages_id": 2, "temp": 3} and job.params.max_tokens == 8


def test_greedy_text_matches_llm_generate(run, llm):
    _, outputs, _, _ = run
    prompts = ["The quick brown fox", MESSAGES, "Once upon a time"]
    params = [SamplingParams(max_tokens=8, temperature=0), SamplingParams(max_tokens=8, temperature=0),
              SamplingParams(max_tokens=4, temperature=0)]
    expected = llm.generate(prompts, params, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == [r.token_ids for r in expected]
    assert [o["text"] for o in outputs] == [r.text for r in expected]


def test_llm_generate_takes_one_prompt_or_a_list_of_any_form(llm):
    """A chat with tools ({"messages", "tools"}) alone or in a list, beside the other forms:
    one result per prompt, the same for the same prompt."""
    tools = {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}
    params = SamplingParams(max_tokens=4, temperature=0)
    alone, = llm.generate(tools, params, use_tqdm=False)
    listed = llm.generate([tools, MESSAGES, "Hi"], params, use_tqdm=False)
    assert len(listed) == 3 and listed[0].token_ids == alone.token_ids
    assert listed[1].token_ids == llm.generate(MESSAGES, params, use_tqdm=False)[0].token_ids


def test_messages_alone_in_a_dict_are_a_chat_and_bad_prompts_are_named(llm):
    params = SamplingParams(max_tokens=3, temperature=0)
    wrapped, = llm.generate({"messages": MESSAGES}, params, use_tqdm=False)
    assert wrapped.token_ids == llm.generate(MESSAGES, params, use_tqdm=False)[0].token_ids
    for prompt, sp, words in [("\ud800", params, "not valid Unicode"),
                              ({"messages": MESSAGES, "extra": 1}, params, "a prompt is"),
                              ("x", SamplingParams(guided=GuidedSpec("json", "{not json")), "JSON schema")]:
        with pytest.raises(ValueError, match=words):
            llm.generate(prompt, sp, use_tqdm=False)


def test_llm_generate_leaves_nothing_queued_when_a_request_is_refused(llm):
    for prompts, params in [(["A", "B"], [SamplingParams(max_tokens=2), SamplingParams(speculator="psychic")]),
                            (None, None), (5, None)]:
        with pytest.raises(ValueError):
            llm.generate(prompts, params, use_tqdm=False)
        assert not llm.engine.has_unfinished and not llm.engine.requests


def test_llm_generate_returns_logprobs_when_asked(llm):
    """Per output token, its own logprob and the 3 most likely, the greedy token first among them."""
    plain, scored = llm.generate(["The quick brown fox"] * 2, [SamplingParams(max_tokens=5, temperature=0),
                                 SamplingParams(max_tokens=5, temperature=0, logprobs=3)], use_tqdm=False)
    assert plain.logprobs is None and scored.token_ids == plain.token_ids
    assert [entry.token_id for entry in scored.logprobs] == scored.token_ids
    for entry in scored.logprobs:
        assert len(entry.top) == 3 and entry.top[0] == (entry.token_id, entry.logprob) and entry.logprob <= 0


def test_n_completions_are_the_requests_seeded_seed_plus_i(llm):
    """SamplingParams(n=3, seed=s): completion i is what one request seeded s + i samples
    (the reference: three plain requests); the summary counts every completion's tokens,
    and every KV block comes back."""
    free_blocks = llm.engine.block_manager.num_free_blocks
    many, other = llm.generate(["Once upon a time", "Hi"], [SamplingParams(max_tokens=8, n=3, seed=5),
                                                            SamplingParams(max_tokens=4)], use_tqdm=False)
    one_by_one = llm.generate(["Once upon a time"] * 3, [SamplingParams(max_tokens=8, seed=5 + i) for i in range(3)],
                              use_tqdm=False)
    assert [c.index for c in many.outputs] == [0, 1, 2] and len(other.outputs) == 1
    assert [c.token_ids for c in many.outputs] == [r.token_ids for r in one_by_one]
    assert [c.text for c in many.outputs] == [r.text for r in one_by_one]
    assert len({tuple(c.token_ids) for c in many.outputs}) > 1  # the seeds differ, and so do the samples
    assert many.text == many.outputs[0].text and many.metrics is many.outputs[0].metrics
    generated = llm.generate(["Once upon a time", "Hi"], [SamplingParams(max_tokens=8, n=3, seed=5),
                                                          SamplingParams(max_tokens=4)], use_tqdm=False)
    assert llm.last_summary.num_requests == 2
    assert llm.last_summary.num_output_tokens == sum(len(c.token_ids) for r in generated for c in r.outputs)
    assert llm.engine.block_manager.num_free_blocks == free_blocks and not llm.engine.requests


def test_n_is_checked_before_anything_runs_and_the_engine_takes_one_completion_a_request(llm):
    for bad in [0, -1, 1.5, True, "2"]:
        with pytest.raises(ValueError, match="n must be an integer >= 1"):
            SamplingParams(n=bad)
    with pytest.raises(ValueError, match="seed"):  # choice 1 would be seeded past a torch.Generator's range
        llm.generate(["A", "B"], [SamplingParams(max_tokens=2), SamplingParams(n=2, seed=2**64 - 1)], use_tqdm=False)
    assert not llm.engine.has_unfinished and not llm.engine.requests
    with pytest.raises(ValueError, match="one completion"):
        llm.engine.add_request("Hi", SamplingParams(n=2))
    assert [p.seed for p in SamplingParams(n=3, seed=7).choices()] == [7, 8, 9]
    assert [(p.n, p.seed) for p in SamplingParams(n=2).choices()] == [(1, None), (1, None)]


def test_missing_input_exits_2(tmp_path, capsys, llm):
    code = main(["--input", str(tmp_path / "nope.jsonl"), "--output", str(tmp_path / "out.jsonl")], llm=llm)
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().count("\n") == 0 and "nope.jsonl" in err
    assert not (tmp_path / "out.jsonl").exists()


def test_missing_model_exits_2_with_one_line(tmp_path):
    src = tmp_path / "prompts.jsonl"
    src.write_text(json.dumps({"prompt": "Hi"}) + "\n")
    proc = subprocess.run([sys.executable, "-m", "runtime.generate", "--model", "/nonexistent", "--input", str(src),
                           "--output", str(tmp_path / "out.jsonl")], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "/nonexistent" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_lines_may_hold_their_output_to_a_constraint(llm, tmp_path):
    """guided_choice and guided_json lines keep to them; a regex that does not compile, and
    two constraints on one line, are skipped lines."""
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 12}},
              "required": ["capital"], "additionalProperties": False}
    src, dst = tmp_path / "guided.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps(line) for line in [
        {"id": 1, "messages": MESSAGES, "guided_choice": ["Paris", "Lyon"]},
        {"id": 2, "messages": MESSAGES, "guided_json": schema, "max_tokens": 24},
        {"id": 3, "prompt": "Hi", "guided_regex": "(abc"},
        {"id": 4, "prompt": "Hi", "guided_regex": "a", "guided_choice": ["a"]}]) + "\n")
    with contextlib.redirect_stderr(io.StringIO()) as stderr:
        code = main(["--input", str(src), "--output", str(dst), "--max-tokens", "8", "--temperature", "0",
                     *ENGINE_ARGS], llm=llm)
    first, second = [json.loads(line) for line in dst.read_text().splitlines()]
    assert code == 1 and first["text"] in ("Paris", "Lyon") and "guided_choice" not in first
    assert second["finish_reason"] == "stop" and set(json.loads(second["text"])) == {"capital"}
    skipped = [line.split(": skipped: ")[1] for line in stderr.getvalue().splitlines() if ": skipped: " in line]
    assert "regex does not compile" in skipped[0] and "one constraint a line" in skipped[1], skipped


def test_lines_take_sampling_params_fields_and_tools_and_refuse_unimplemented_openai_fields(llm, tmp_path):
    """logprobs, ignore_eos, n and tools beside messages act as LLM.generate's (a line
    with n lists its completions in "outputs"); response_format is refused by line, not
    silently ignored."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    src, dst = tmp_path / "lines.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps(line) for line in [
        {"id": 1, "prompt": "The quick brown fox", "logprobs": 2, "ignore_eos": True},
        {"id": 2, "messages": MESSAGES, "tools": tools},
        {"id": 3, "prompt": "Hi", "n": 2, "temperature": 1.0, "seed": 11},
        {"id": 4, "prompt": "Hi", "response_format": {"type": "json_object"}},
        {"id": 5, "prompt": "Hi", "tools": tools}]) + "\n")
    with contextlib.redirect_stderr(io.StringIO()) as stderr:
        code = main(["--input", str(src), "--output", str(dst), "--max-tokens", "6", "--temperature", "0",
                     *ENGINE_ARGS], llm=llm)
    first, second, third = [json.loads(line) for line in dst.read_text().splitlines()]
    expected = llm.generate(["The quick brown fox", {"messages": MESSAGES, "tools": tools}, "Hi", "Hi"],
                            [SamplingParams(max_tokens=6, temperature=0, logprobs=2, ignore_eos=True),
                             SamplingParams(max_tokens=6, temperature=0), SamplingParams(max_tokens=6, seed=11),
                             SamplingParams(max_tokens=6, seed=12)], use_tqdm=False)
    assert code == 1 and [first["token_ids"], second["token_ids"]] == [r.token_ids for r in expected[:2]]
    assert set(third) == {"id", "outputs"} and [o["token_ids"] for o in third["outputs"]] == \
        [r.token_ids for r in expected[2:]]
    assert all(set(o) == {"text", "token_ids", "finish_reason", "metrics"} for o in third["outputs"])
    assert [entry["token_id"] for entry in first["logprobs"]] == first["token_ids"] and len(first["token_ids"]) == 6
    # float32, in batches of other shapes (the second run reads the prefix cache)
    assert first["logprobs"][0]["logprob"] == pytest.approx(expected[0].logprobs[0].logprob, abs=1e-4)
    assert "logprobs" not in second and "tools" not in second
    skipped = [line.split(": skipped: ")[1] for line in stderr.getvalue().splitlines() if ": skipped: " in line]
    assert len(skipped) == 2 and "'response_format'" in skipped[0] and "messages" in skipped[1], skipped


def test_an_output_that_cannot_be_written_is_one_line_and_exit_2(llm, tmp_path, capsys):
    src = tmp_path / "prompts.jsonl"
    src.write_text(json.dumps({"prompt": "Hi"}) + "\n")
    for output, words in [(src / "out.jsonl", "is not a directory"), (tmp_path, "is a directory"),
                          (Path("/dev/full"), "No space left")]:
        code = main(["--input", str(src), "--output", str(output), "--max-tokens", "2", *ENGINE_ARGS], llm=llm)
        err = capsys.readouterr().err
        assert code == 2 and words in err and "Traceback" not in err, err
