"""The target on a GPU: plain, lookahead and a draft model (on the host CPU, overlapped or
not, and on the GPU), at several batch sizes, in one run. One table, printed last.

Rows (systems), each at every --concurrency (requests given at once; 1 = single stream):
  - plain:             the target alone (speculator "none");
  - lookahead:         the lookahead proposer;
  - draft cpu serial:  the draft model on the host CPU, draft_overlap "off";
  - draft cpu overlap: the draft model on the host CPU, drafting ahead while the GPU verifies;
  - draft gpu:         the draft model on the target's GPU;
  - eagle host / eagle target: an EAGLE head (--eagle-head) on the host CPU / on the target's
                       device, the engine's default tree (5 deep, top-4, 16 nodes);
  - eagle target, EAGLE-2's tree: the head on the target's device with EAGLE-2's published
                       tree (6 deep, top-10, 60 nodes), which a GPU verifies almost for free.
With --enforce-eager-rows, the plain row is also run without CUDA graphs.

Greedy, every request generating exactly --max-tokens tokens (ignore_eos), so tok/s counts the
same work in every row. With --requests-per-slot K > 1 a round at batch N gives N x K requests,
at most N running (a finished request's slot is refilled, as in serving), and tok/s is the
steady state: output tokens over time until the queue empties, the drain excluded. Speculation
finishes requests unevenly, so a round of exactly N requests ends with steps at a smaller batch
that a server would have filled: on the CPU at batch 4 an EAGLE round spent a fifth of its
time there. For random-weight models (scripts/make_random_model.py) acceptance is
~0 and adaptive speculation would switch drafting off, so --fixed-speculation K always drafts K
tokens: those rows then time the mechanism (draft ms, verify ms), not a speed-up.

Each system gets an engine of its own (CUDA graphs or not, where the draft runs); the engine
is driven through its public add_request / step, at most N requests in flight. The table goes
to stdout and to benchmarks/results/<date>-bench_gpu.md (and .json).

    python -m scripts.bench_gpu --model smollm2-135m --draft-model smollm2-135m
    python -m scripts.bench_gpu --model /tmp/qwen15 --draft-model /tmp/qwen05 --fixed-speculation 4
    python -m scripts.bench_gpu --device cpu --systems plain,lookahead --concurrency 1,2 --max-tokens 8 \\
        --repeats 1 --enforce-eager     # smoke test on a machine without a GPU
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

import torch

from runtime import LLM
from scripts.harness import PAPER_TREE, Report, System, add_results_args, fmt, greedy, log

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain how a hash table works.",
    "What is the difference between a process and a thread?",
    "Write a SQL query that lists the ten customers with the most orders.",
    "Summarize the plot of Romeo and Juliet.",
    "How do vaccines train the immune system?",
    "Write a bash script that counts the lines of every .py file in a folder.",
    "Give me three ideas for a birthday party.",
]


SYSTEMS = [
    System("plain", "plain", "none"),
    System("plain-eager", "plain, eager (no CUDA graphs)", "none", engine={"enforce_eager": True}),
    System("lookahead", "lookahead", "lookahead"),
    System("draft-cpu-serial", "draft on CPU, serial", "draft", {"draft_device": "cpu", "draft_overlap": "off"}),
    System("draft-cpu-overlap", "draft on CPU, overlapped", "draft", {"draft_device": "cpu", "draft_overlap": "on"}),
    System("draft-gpu", "draft on GPU", "draft", {"draft_device": "cuda"}),
    System("eagle-host", "EAGLE head on the host CPU", "eagle", {"draft_device": "cpu"}),
    System("eagle-target", "EAGLE head on the target's device", "eagle", {"draft_device": "target"}),
    System("eagle-target-wide", f"EAGLE head on the target's device, EAGLE-2's tree ({PAPER_TREE})", "eagle",
           {"draft_device": "target", **PAPER_TREE.settings()}),
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="target: alias, .gguf file or HF directory")
    p.add_argument("--draft-model", default=None, help="draft model (same vocabulary); draft rows need it")
    p.add_argument("--eagle-head", default=None, help="an EAGLE head for the target; eagle rows need it")
    p.add_argument("--device", default="cuda", help="the target's device (default: cuda)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated request counts (default: %(default)s)")
    p.add_argument("--kv-cache-memory", default=None, help="each engine's KV cache (default: the engine's, 0.8 of "
                                                            "free GPU memory)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="timed rounds; the median is shown")
    p.add_argument("--fixed-speculation", type=int, default=None, metavar="K",
                   help="always draft K tokens (adaptive speculation off); for random-weight models")
    p.add_argument("--systems", default=",".join(s.key for s in SYSTEMS if s.key != "plain-eager"),
                   help="comma-separated subset of: " + ", ".join(s.key for s in SYSTEMS))
    p.add_argument("--draft-cpu-cores", default=None, help="cores for the CPU draft (default: the engine's)")
    p.add_argument("--requests-per-slot", type=int, default=1, metavar="K",
                   help="batch N: N x K requests per round, at most N running; K > 1 reports the steady "
                        "state (default: %(default)s)")
    p.add_argument("--label", default=None, help="a name for this model pair in the table")
    p.add_argument("--enforce-eager", action="store_true", help="every engine eager (no CUDA graphs, no compiled "
                                                                "CPU decode step)")
    add_results_args(p, "bench_gpu")
    args = p.parse_args(argv)
    args.concurrency = sorted({int(c) for c in args.concurrency.split(",")})
    keys = {s.key: s for s in SYSTEMS}
    unknown = [k for k in args.systems.split(",") if k not in keys]
    if unknown:
        p.error(f"unknown system(s): {', '.join(unknown)}")
    args.systems = [keys[k] for k in args.systems.split(",")]
    if args.draft_model is None:
        args.systems = [s for s in args.systems if s.speculator != "draft"]
    if args.eagle_head is None:
        args.systems = [s for s in args.systems if s.speculator != "eagle"]
    return args


def make_llm(args, system: System) -> LLM:
    extra = dict(system.settings)
    if system.speculator == "draft":
        extra["draft_model"] = args.draft_model
        if args.draft_cpu_cores and extra.get("draft_device") == "cpu":
            extra["draft_cpu_cores"] = args.draft_cpu_cores
    if system.speculator == "eagle":
        extra["eagle_head"] = args.eagle_head
        if extra.get("draft_device") == "target":
            extra["draft_device"] = args.device
    if args.fixed_speculation is not None:
        extra.update(num_speculative_tokens=args.fixed_speculation, adaptive_speculation=False)
    engine = {"enforce_eager": args.enforce_eager, **dict(system.engine)}
    return LLM(model=args.model, device=args.device, dtype=args.dtype, speculator=system.speculator, seed=0,
               max_num_seqs=max(args.concurrency), kv_cache_memory=args.kv_cache_memory, **engine, **extra)


def timed_round(llm: LLM, prompts: list[str], max_tokens: int, slots: int) -> tuple[float, float | None, float]:
    """(output tok/s, mean acceptance length, ms per engine step) of the prompts, at most
    `slots` in flight (a finished request's slot is refilled from the queue). With more
    prompts than slots, tok/s and ms per step are the steady state's: the steps until the
    queue empties (every slot busy), not the drain after."""
    params = greedy(max_tokens, ignore_eos=True)
    engine = llm.engine
    stats = engine.stats
    accepted, verify_steps = stats.num_accepted_tokens, stats.num_verify_steps
    queue, in_flight = list(prompts), set()
    steps: list[tuple[float, int, bool]] = []  # per engine step: (seconds, output tokens, all slots busy)
    start = time.perf_counter()
    while queue or engine.has_unfinished:
        while queue and len(in_flight) < slots:
            in_flight.add(engine.add_request(queue.pop(0), params))
        busy = len(in_flight) + len(queue) >= slots
        step_start = time.perf_counter()
        outputs = engine.step()
        steps.append((time.perf_counter() - step_start, sum(len(o.new_token_ids) for o in outputs), busy))
        in_flight -= {o.request_id for o in outputs if o.finished}
    elapsed = time.perf_counter() - start
    verify_steps = stats.num_verify_steps - verify_steps
    acceptance = 1 + (stats.num_accepted_tokens - accepted) / verify_steps if verify_steps else None
    if len(prompts) > slots:
        steps = [s for s in steps if s[2]]
        seconds = sum(s[0] for s in steps)
        return sum(s[1] for s in steps) / seconds, acceptance, 1000 * seconds / max(len(steps), 1)
    return sum(s[1] for s in steps) / elapsed, acceptance, 1000 * elapsed / max(len(steps), 1)


def run_system(args, system: System) -> list[tuple]:
    """(system, batch, tok/s, acceptance length, ms per step) at every --concurrency."""
    start = time.perf_counter()
    llm = make_llm(args, system)
    log(f"{system.label}: engine ready in {time.perf_counter() - start:.1f} s")
    rows = []
    try:
        for n in args.concurrency:
            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n * args.requests_per_slot)]
            timed_round(llm, prompts[:n], min(8, args.max_tokens), n)  # warm-up (and graph capture) at this size
            rounds = [timed_round(llm, prompts, args.max_tokens, n) for _ in range(args.repeats)]
            rate = statistics.median(r[0] for r in rounds)
            acc = [r[1] for r in rounds if r[1] is not None]
            step_ms = statistics.median(r[2] for r in rounds)
            rows.append((system, n, rate, statistics.mean(acc) if acc else None, step_ms))
            log(f"  batch {n}: {rate:.1f} tok/s, {step_ms:.1f} ms/step")
    finally:
        llm.engine.close()
    return rows


def main(argv=None) -> None:
    args = parse_args(argv)
    label = args.label or Path(args.model).name
    report = Report(args.name, "bench_gpu: the target on a GPU, plain and speculating, at several batch sizes",
                    "scripts.bench_gpu", argv, args)
    rows, failed = [], []
    for system in args.systems:
        try:
            rows += run_system(args, system)
        except Exception as e:  # noqa: BLE001 - one system's failure (out of memory, ...) keeps the others' rows
            log(f"{system.label}: failed: {type(e).__name__}: {e}")
            failed.append(f"{system.label}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    plain = {n: rate for s, n, rate, _, _ in rows if s.key == "plain"}
    steady = f", {args.requests_per_slot} requests per slot (steady state)" if args.requests_per_slot > 1 else ""
    report.line(f"{label} (draft {args.draft_model or '-'}), {args.dtype}, {args.max_tokens} tokens per request"
                f"{steady}, "
                f"torch {torch.__version__}, "
                f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA'}, target on {args.device}"
                f"{', fixed speculation ' + str(args.fixed_speculation) if args.fixed_speculation is not None else ''}"
                f"{', all engines eager' if args.enforce_eager else ''}")
    report.line()
    report.table(("system", "batch", "tok/s", "vs plain", "accept len", "ms/step"),
                 [(system.label, n, f"{rate:.1f}", f"{rate / plain[n]:.2f}x" if n in plain else "-", fmt(acc, ".2f"),
                   f"{step_ms:.1f}") for system, n, rate, acc, step_ms in rows])
    if failed:
        report.line()
    for line in failed:
        report.line(f"- failed: {line}")
    report.data["rows"] = [{"system": system.key, "label": system.label, "batch": n, "tok_per_s": rate,
                            "acceptance_length": acc, "ms_per_step": step_ms}
                           for system, n, rate, acc, step_ms in rows]
    report.data["failed"] = failed
    report.write()


if __name__ == "__main__":
    main()
