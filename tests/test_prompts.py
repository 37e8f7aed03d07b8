"""The shipped prompt sets: the large training set is what scripts/make_prompts.py writes,
and no training prompt shares a topic, a programming task or a template with the held-out
prompts that the benchmarks measure acceptance on."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import make_prompts  # noqa: E402

from speculators.training import default_prompt_file, load_prompts  # noqa: E402

HELDOUT_TEMPLATES = [
    r"Write a short story that involves (.+)\.",
    r"Tell me something surprising about (.+)\.",
    r"Describe (.+) in simple words\.",
    r"Show me Python code that (.+)\.",
]


def texts(path) -> list[str]:
    return [messages[-1]["content"] for messages in load_prompts(path)]


def heldout_subjects() -> set[str]:
    subjects = set()
    for text in texts(default_prompt_file("heldout")):
        match = next((re.fullmatch(t, text) for t in HELDOUT_TEMPLATES if re.fullmatch(t, text)), None)
        assert match, f"held-out prompt of an unknown template: {text!r}"
        subjects.add(match.group(1))
    return subjects


def test_large_prompt_file_is_what_the_script_writes(tmp_path):
    out = tmp_path / "prompts.jsonl"
    assert make_prompts.main(["--out", str(out)]) == 0
    shipped = default_prompt_file("train_large")
    assert out.read_text() == shipped.read_text()
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) > 2000
    assert len({line["messages"][0]["content"] for line in lines}) == len(lines)  # no prompt twice


@pytest.mark.parametrize("split", ["train", "train_large"])
def test_training_prompts_share_nothing_with_the_heldout_ones(split):
    subjects = heldout_subjects()
    assert len(subjects) >= 10
    for text in texts(default_prompt_file(split)):
        assert not any(re.fullmatch(t, text) for t in HELDOUT_TEMPLATES), text
        assert not any(re.search(rf"\b{re.escape(subject)}\b", text) for subject in subjects), text
