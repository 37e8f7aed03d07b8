"""OpenMP teams (draft_cpu.placement): a thread's team ends with the thread, and shrinks
when asked to, so the teams alive add up to no more threads than the cores. Counted as
threads of a fresh process (its other threads do not come and go meanwhile)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent("""
    import json, os, time
    import torch
    from draft_cpu.placement import fit_openmp_team, on_a_thread_of_its_own

    def threads():
        time.sleep(0.2)  # workers told to go exit right after the region that lets them go
        return len(os.listdir("/proc/self/task"))

    def big_parallel_op(num_threads):
        torch.set_num_threads(num_threads)
        torch.ones(num_threads * 65536)

    big_parallel_op(1)
    start = threads()
    on_a_thread_of_its_own(big_parallel_op, 4)
    after_own_thread = threads()
    big_parallel_op(4)
    team_of_4 = threads()
    fit_openmp_team(2)
    team_of_2 = threads()
    try:
        on_a_thread_of_its_own(lambda: 1 / 0)
        error = None
    except ZeroDivisionError as e:
        error = type(e).__name__
    print(json.dumps({"start": start, "after_own_thread": after_own_thread, "team_of_4": team_of_4,
                      "team_of_2": team_of_2, "result": on_a_thread_of_its_own(max, 3, 5), "error": error}))
""")


def test_teams_end_with_their_thread_and_shrink_when_fitted():
    out = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["after_own_thread"] == got["start"]  # the loading thread's 3 workers went with it
    assert got["team_of_4"] == got["start"] + 3  # the main thread's team: itself and 3 workers
    assert got["team_of_2"] == got["start"] + 1
    assert got["result"] == 5 and got["error"] == "ZeroDivisionError"
