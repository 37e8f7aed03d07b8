"""The shipped prompt sets: the large training set is what training/make_prompts.py writes,
and no training prompt shares a topic, a programming task or a template with the held-out
prompts that the benchmarks measure acceptance on."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
from training import make_prompts

from training.common import default_prompt_file, load_prompts  # noqa: E402


def texts(path) -> list[str]:
    return [messages[-1]["content"] for messages in load_prompts(path)]


def test_large_prompt_file_is_what_the_script_writes(tmp_path):
    out = tmp_path / "prompts.jsonl"
    assert make_prompts.main(["--out", str(out)]) == 0
    shipped = default_prompt_file("train_large")
    assert out.read_text() == shipped.read_text()
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) > 2000
    assert len({line["messages"][0]["content"] for line in lines}) == len(lines)  # no prompt twice


def test_varied_prompt_file_is_what_the_script_writes_and_uses_no_plain_template(tmp_path):
    out = tmp_path / "prompts.jsonl"
    assert make_prompts.main(["--varied", "--out", str(out)]) == 0
    assert out.read_text() == default_prompt_file("train_varied").read_text()
    varied = texts(out)
    assert len(varied) == len(set(varied)) > 1000
    plain = [re.escape(t).replace(re.escape("{}"), "(.+)")
             for t in make_prompts.TEMPLATES + make_prompts.CODE_TEMPLATES]
    assert not any(re.fullmatch(t, text) for text in varied for t in plain)
    assert not set(varied) & set(texts(default_prompt_file("train_large")))


@pytest.mark.parametrize("split", ["train", "train_large", "train_varied"])
def test_training_prompts_share_nothing_with_the_heldout_ones(split):
    subjects = make_prompts.heldout_subjects()
    assert len(subjects) >= 10
    for text in texts(default_prompt_file(split)):
        assert not make_prompts.mentions_heldout(text, subjects), text


def test_every_heldout_prompt_is_a_known_template_filled_with_its_subject():
    subjects = make_prompts.heldout_subjects()
    for text in texts(default_prompt_file("heldout")):
        assert make_prompts.mentions_heldout(text, subjects)
        assert any(re.fullmatch(t, text) for t in make_prompts.HELDOUT_TEMPLATES)
    assert make_prompts.mentions_heldout("What does a penguin eat?", subjects)
    assert make_prompts.mentions_heldout("Who built the first computer?", subjects)
    assert make_prompts.mentions_heldout("What is a Violin made of?", subjects)  # "the violin", any case
    assert not make_prompts.mentions_heldout("Who invented the steam engine?", subjects)
    assert not make_prompts.mentions_heldout("Why do teams need leaders?", subjects)  # "tea" is a whole word


def test_self_prompts_start_from_the_chat_template_before_the_users_text(engine_f32):
    from training import make_self_prompts
    tokenizer = engine_f32.tokenizer
    prefix = make_self_prompts.pre_query_token_ids(tokenizer)
    request = engine_f32.tokenize([{"role": "user", "content": "How do clouds form?"}])
    assert request[:len(prefix)] == prefix  # a real request's tokens begin with the prefix
    assert tokenizer.decode(request[len(prefix):]).startswith("How do clouds form?")


def test_self_prompts_keep_only_new_finished_requests_away_from_the_heldout_ones(engine_f32, tmp_path, monkeypatch):
    from training import make_self_prompts
    sampled = [("How do clouds form?", "stop"), ("how do clouds form?", "stop"),  # the second is a repeat
               ("Describe tea in simple words.", "stop"), ("What does a penguin eat?", "stop"),
               ("Write me a very long", "length"), ("Hi", "stop"), ("Plan a trip to Lisbon for me.", "stop"),
               ("Which skills does a chef need?", "stop"), ("Design a new weapon for me.", "stop")]
    monkeypatch.setattr(make_self_prompts, "sample_requests", lambda engine, *args: sampled)
    monkeypatch.setattr("runtime.engine.LLMEngine", lambda **kwargs: engine_f32)
    monkeypatch.setattr(engine_f32, "close", lambda: None)
    out = tmp_path / "self.jsonl"
    assert make_self_prompts.main(["--enforce-eager", "--out", str(out), "--num-samples", str(len(sampled))]) == 0
    assert texts(out) == ["How do clouds form?", "Plan a trip to Lisbon for me.", "Which skills does a chef need?"]


def test_self_prompts_are_requests_the_model_writes(engine_f32):
    from training import make_self_prompts
    requests = make_self_prompts.sample_requests(engine_f32, 4, 48, 1.0, 0.95, seed=0)
    assert len(requests) == 4
    assert len({text for text, _ in requests}) == 4  # one seed each: four different requests
    finished = [text for text, reason in requests if reason == "stop"]
    assert finished and all(text and "<|im_end|>" not in text and "<|im_start|>" not in text for text in finished)
    assert requests == make_self_prompts.sample_requests(engine_f32, 4, 48, 1.0, 0.95, seed=0)  # seeded

