"""Training lives apart from the inference packages (issue 35): training/ holds the code,
the prompt sets and the default model's answers; the wheel (pyproject's packages and
package data) holds none of them, and the entry points run as modules of scripts/."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_holds_no_training_code_or_corpora():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools = project["tool"]["setuptools"]
    assert not any(name.startswith("training") for name in setuptools["packages"]["find"]["include"])
    package_data = setuptools.get("package-data", {})
    assert not any("jsonl" in pattern for patterns in package_data.values() for pattern in patterns)
    assert "speculators" in package_data  # the shipped EAGLE head is package data
    assert not (ROOT / "speculators" / "data").exists()


def test_prompt_sets_and_corpora_are_in_training_data():
    from training.common import DATA, default_prompt_file, shipped_corpora

    assert DATA == ROOT / "training" / "data"
    for split in ("train", "train_large", "train_varied", "heldout"):
        assert default_prompt_file(split).is_file()
    assert [p.parent for p in shipped_corpora("smollm2-135m")] == [DATA] * 3
    assert shipped_corpora("another-model") == []


def test_the_training_entry_points_run_as_modules():
    for name in ("train_eagle", "train_medusa", "make_prompts"):
        out = subprocess.run([sys.executable, "-m", f"scripts.{name}", "--help"], cwd=ROOT, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0 and "usage" in out.stdout, out.stderr
