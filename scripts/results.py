"""What a benchmark's results file records about the run: the commit, the CPU, its cores and
the torch version (scripts write their tables under results/ with these lines on top)."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def machine() -> dict[str, str]:
    """{"commit", "cpu", "cores", "torch"}; the commit is marked when tracked files differ from it."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        except OSError:
            return ""
    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += " (working tree modified)"
    cpu = platform.processor() or "unknown"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"commit": commit, "cpu": cpu, "cores": f"{os.cpu_count()} (usable: {len(os.sched_getaffinity(0))})",
            "torch": torch.__version__}
