"""Where the draft worker runs on the host: which cores, how many threads.

`--draft-cpu-cores 0-15,32` names the cores (a Linux CPU list). The draft worker's own
thread pins itself to them before its first torch op and sets its OpenMP thread count
to their number; OpenMP threads inherit the affinity of the thread that starts them, and
libgomp keeps one thread team per calling thread, so the draft's team lives on the draft
cores. Every other thread of the process (the engine loop, the HTTP loop, the target's
OpenMP team) is moved off them, onto the remaining cores.

Without a core list: with the target on a GPU, the draft takes every core but one, which
is left to the engine and HTTP loops; with the target on the CPU, nothing is pinned and
draft and target take turns on all cores (on a small CPU, splitting the cores between
them costs each more than overlapping gains; `scripts/bench_draft.py` measures both).
Taking turns, the draft runs on the engine's own thread, not a thread of its own.

One OpenMP thread team per core set: libgomp counts the worker threads of every team in
the process, and when they outnumber the cores it stops its waiting threads spinning
(100 spins, not 300,000) and puts them to sleep between two parallel regions. A compiled
decode step is a few hundred short parallel regions, each then paying a futex wake-up:
a second team, even an idle one, makes a step measurably slower. Pinned, the draft's
team and the rest's add up to the cores; unpinned, draft and target share the one team
of the engine thread. A team lasts as long as its thread, or until it runs a parallel region with fewer
threads: the target loads on a thread of its own (`on_a_thread_of_its_own`), and the
engine thread's team shrinks to the cores left to it once a draft takes some
(`fit_openmp_team`).
"""
from __future__ import annotations

import logging
import os
import re
import threading
from concurrent.futures import Future

import torch

log = logging.getLogger("draft_cpu.placement")


_PROCESS_CORES = sorted(os.sched_getaffinity(0))  # before anything here pins a thread


def available_cores() -> list[int]:
    """The cores the calling thread may run on now."""
    return sorted(os.sched_getaffinity(0))


def parse_core_list(spec: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]; ValueError on bad syntax or cores this
    process may not use."""
    cores: set[int] = set()
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not match:
            raise ValueError(f"--draft-cpu-cores: cannot read {spec!r} (example: 0-15 or 0-3,8-11)")
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        if last < first:
            raise ValueError(f"--draft-cpu-cores: range {part.strip()!r} runs backwards")
        cores.update(range(first, last + 1))
    allowed = set(_PROCESS_CORES)
    outside = sorted(cores - allowed)
    if outside:
        raise ValueError(f"--draft-cpu-cores: cores {outside} are not available to this process "
                         f"(available: {format_core_list(sorted(allowed))})")
    return sorted(cores)


def format_core_list(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    parts, start = [], None
    for i, core in enumerate(cores):
        if start is None:
            start = core
        if i + 1 == len(cores) or cores[i + 1] != core + 1:
            parts.append(str(start) if start == core else f"{start}-{core}")
            start = None
    return ",".join(parts)


def default_draft_cores(target_device: torch.device) -> list[int] | None:
    """None (no pinning) with the target on the CPU; otherwise all cores but the first."""
    cores = available_cores()
    if target_device.type == "cpu" or len(cores) < 2:
        return None
    return cores[1:]


def pin_current_thread(cores: list[int]) -> None:
    """Pin the calling thread to `cores` and give its OpenMP team one thread per core."""
    os.sched_setaffinity(0, cores)  # Linux: pid 0 is the calling thread
    # torch sets a thread's OpenMP count lazily from a process-wide value on its first
    # parallel op; trigger that first so the count set next stays this thread's own
    torch.get_num_threads()
    torch.set_num_threads(len(cores))


def fit_openmp_team(num_threads: int) -> None:
    """Give the calling thread's OpenMP team `num_threads` threads, and let the workers
    past them go now: libgomp does so when the team next runs a parallel region with
    fewer threads, which a large fill is (torch parallelises it in chunks of 32768). A
    team of one thread runs no region, so it keeps the workers it had."""
    torch.set_num_threads(num_threads)
    if num_threads > 1:
        torch.ones(num_threads * 65536)  # one parallel region of num_threads threads


def on_a_thread_of_its_own(fn, *args, **kwargs):
    """fn(*args, **kwargs) on a new thread that ends when fn returns; its result, or its
    exception raised here. The OpenMP workers fn's torch ops start end with that thread."""
    result = Future()

    def run() -> None:
        try:
            result.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - raised again on the calling thread
            result.set_exception(e)
    thread = threading.Thread(target=run, name="loader", daemon=True)
    thread.start()
    thread.join()
    return result.result()


def move_other_threads(cores: list[int], keep: set[int]) -> int:
    """Pin every thread of this process except the thread ids in `keep` to `cores`;
    returns how many were moved. Threads that exit meanwhile are skipped."""
    moved = 0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) in keep:
            continue
        try:
            os.sched_setaffinity(int(tid), cores)
            moved += 1
        except (ProcessLookupError, PermissionError, OSError):
            pass
    return moved


def split_cores(cores: list[int], parts: int, reserved: list[int] = ()) -> list[list[int]] | None:
    """`parts` disjoint contiguous shares of `cores` minus `reserved`, the first share
    taking the remainder; None when there are fewer such cores than parts."""
    free = [c for c in cores if c not in set(reserved)]
    if len(free) < parts:
        return None
    size = len(free) // parts
    first = size + len(free) % parts
    return [free[:first]] + [free[first + i * size:first + (i + 1) * size] for i in range(parts - 1)]


def pin_process(cores: list[int]):
    """Pin every thread of this process to `cores`, and the calling thread's OpenMP team to
    one thread per core; threads started later inherit it. Returns a function that undoes it."""
    before, threads = available_cores(), torch.get_num_threads()
    move_other_threads(cores, keep=set())
    pin_current_thread(cores)

    def restore() -> None:
        move_other_threads(before, keep=set())
        torch.set_num_threads(threads)
    return restore


def place(draft_cores: list[int], draft_thread_id: int, all_cores: list[int]) -> list[int]:
    """Give the draft thread its cores and move the rest of the process onto the other
    cores of `all_cores` (the process's, read before any pinning); returns the cores left
    to the rest (all of them when nothing is left)."""
    rest = [c for c in all_cores if c not in set(draft_cores)]
    if not rest:
        log.warning("the draft worker was given every core (%s); the target and the engine loop share them",
                    format_core_list(draft_cores))
        return list(all_cores)
    me = threading.get_native_id()
    move_other_threads(rest, keep={draft_thread_id, me})
    if me != draft_thread_id:
        pin_current_thread(rest)
    return rest
