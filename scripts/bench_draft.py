"""Draft-model speculation of this engine against HF transformers (plain and assisted), in one run.

Target and draft model (default: the Qwen2.5-Coder 1.5B / 0.5B GGUF pair in models/, fetched
there when missing), the same chat prompts on both sides (4 code prompts, the same prompt token
ids), --dtype for target and draft, greedy, each request stopping at EOS or --max-tokens, so
tok/s is generated tokens / wall time. Single-stream rows (one request at a time):

  - HF plain:                      transformers `generate`, greedy;
  - HF assisted:                   `generate(assistant_model=draft)`, HF's assisted generation;
  - ours plain:                    this engine, speculator "none";
  - ours draft chain / tree:       speculator "draft", tree width 1 / --tree-width, the default
                                   draft worker (backend auto: IPEX when it imports);
  - ours draft, torch / int8:      the tree with draft_backend "torch" / draft_quantization "int8";
  - ours draft, overlap off / on:  draft_overlap "off" / "on", the draft pinned to --draft-cpu-cores
                                   (only when EngineConfig has draft_overlap).

Columns: tok/s (the median of --repeats interleaved rounds, after a warm-up of every system),
ratios against ours plain, HF plain and HF assisted, mean acceptance length, draft ms per
verify step (the draft worker's busy time, engine.stats), the fraction of wall time in which
draft and verify overlapped and how many outputs equal ours plain. A second table gives the
output tok/s of ours plain and ours draft tree with --concurrency requests at once. Last, the
targets: the best draft row >= 1.3x HF assisted and >= 2.5x HF plain single stream, draft >=
0.95x plain at 16 concurrent requests. One engine (one target load) serves all our rows:
before a row runs, the engine switches to its speculator and draft settings (backend,
quantization, overlap and cores) with `update_speculation`, which builds a fresh draft worker
(loading the draft model again, outside the timed rounds). Tables go to stdout and to
benchmarks/results/<date>-bench_draft.md (and .json), progress to stderr.

    python -m scripts.bench_draft --threads 16
    python -m scripts.bench_draft --systems hf-assisted,plain,draft-tree --max-tokens 128
    python -m scripts.bench_draft --target smollm2-135m --draft smollm2-135m \\
        --max-tokens 16 --repeats 1 --limit 1 --concurrency 1,4 --enforce-eager      # smoke test
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from draft_cpu.placement import format_core_list, parse_core_list
from runtime import LLM
from runtime.config import EngineConfig
from runtime.models.loader import DTYPES
from scripts.fetch_qwen_gguf import MODELS, fetch
from scripts.harness import (HF_OVERSHOOT, Measure, Report, Speculation, System, add_results_args, draft_backend,
                             fmt, hf_one_at_a_time, hf_prompt_ids, interleaved, load_hf, log, one_at_a_time, ratio,
                             run_engine, select_systems)

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome, ignoring case, spaces and punctuation.",
    "Write a Python function that merges two sorted lists into one sorted list. Add type hints and a docstring.",
    "Write a Python class for a least-recently-used cache with `get` and `put` methods and a fixed capacity.",
    "Write a Python function that reads a CSV file and returns the average of every numeric column as a dict.",
]

ALL_CORES = sorted(os.sched_getaffinity(0))  # read before any draft worker pins itself
ENGINE_THREADS = torch.get_num_threads()  # the engine's torch threads on all cores (set again in main)
HAS_OVERLAP = "draft_overlap" in EngineConfig.__dataclass_fields__
CONCURRENCY_KEYS = ("plain", "draft-tree")  # the concurrency table's systems


@dataclass
class DraftMeasure(Measure):
    draft_seconds: float = 0.0  # draft worker busy time over the row's timed runs (engine.stats)
    overlap_seconds: float = 0.0  # draft and verify at once (engine.stats)
    steps: list = field(default_factory=list)  # the engine's StepTiming of each step of the timed runs

    @property
    def wall_seconds(self) -> float:
        return sum(s for _, s in self.rounds)


class Item(NamedTuple):
    """One timed unit of a round: a system single stream (n None), or N requests at once."""
    key: str | tuple
    system: System
    n: int | None = None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="target model: alias, .gguf file or HF directory (default: "
                                                  f"models/{MODELS['1.5b'][3]}, fetched when missing)")
    p.add_argument("--draft", default=None, help="draft model, the target's vocabulary (default: "
                                                 f"models/{MODELS['0.5b'][3]}, fetched when missing)")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES), help="target and draft (default: bfloat16)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N: the target and both HF models (default: cpu)")
    p.add_argument("--max-tokens", type=int, default=96,
                   help="most tokens generated per request; EOS stops earlier (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=2, help="timed rounds; the median is shown (default: 2)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--systems", default=None,
                   help="comma-separated subset of: " + ", ".join(s.key for s in make_systems(None)) + " (default: all)")
    p.add_argument("--tree-width", type=int, default=2, help="draft tree rows: most children per node (default: 2)")
    p.add_argument("--num-speculative-tokens", type=int, default=None, help="draft nodes per step (default: the "
                                                                            "engine's)")
    p.add_argument("--draft-cpu-cores", default=format_core_list(ALL_CORES[len(ALL_CORES) // 2:]),
                   help="the overlap rows' draft cores (default: the last half, %(default)s)")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated request counts for the concurrency "
                                                           "table; '' for none (default: %(default)s)")
    p.add_argument("--enforce-eager", action="store_true", help="the engine's --enforce-eager")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--kv-cache-memory", default="512MiB", help="engine KV cache size (default: %(default)s)")
    p.add_argument("--no-adaptive-speculation", dest="adaptive", action="store_false",
                   help="engine: always propose the full draft instead of sizing it from measured acceptance")
    add_results_args(p, "bench_draft")
    args = p.parse_args(argv)
    args.concurrency = sorted({int(c) for c in args.concurrency.split(",") if c.strip()})
    if args.max_tokens < 2 or args.repeats < 1 or args.tree_width < 1 or any(c < 1 for c in args.concurrency):
        p.error("--max-tokens must be >= 2, --repeats, --tree-width and every concurrency >= 1")
    if args.limit is not None and args.limit < 1:
        p.error("--limit must be >= 1")
    return args


def make_systems(args) -> list[System]:
    """Every system (args None: only their keys matter)."""
    width = args.tree_width if args else 2
    cores = args.draft_cpu_cores if args else ""
    systems = [
        System("hf", "HF plain"),
        System("hf-assisted", "HF assisted (draft model)", hf_assisted=True),
        System("plain", "ours plain", "none", {"speculative_tree_width": 1}),
        System("draft-chain", "ours draft chain", "draft", {"speculative_tree_width": 1}),
        System("draft-tree", f"ours draft tree (width {width})", "draft", {"speculative_tree_width": width}),
        System("draft-torch", "ours draft tree, torch backend", "draft",
               {"speculative_tree_width": width, "draft_backend": "torch"}),
        System("draft-int8", "ours draft tree, int8 draft", "draft",
               {"speculative_tree_width": width, "draft_quantization": "int8"}),
    ]
    if HAS_OVERLAP:
        systems += [System(f"overlap-{mode}", f"ours draft tree, overlap {mode} (draft cores {cores})", "draft",
                           {"speculative_tree_width": width, "draft_overlap": mode, "draft_cpu_cores": cores})
                    for mode in ("off", "on")]
    return systems


def default_models(args) -> None:
    """--target / --draft default to the Qwen2.5-Coder 1.5B / 0.5B GGUFs in models/ (fetched when missing)."""
    for attr, name in (("target", "1.5b"), ("draft", "0.5b")):
        if getattr(args, attr) is None:
            with contextlib.redirect_stdout(sys.stderr):  # stdout is for the tables
                setattr(args, attr, str(fetch(name, Path("models"))))


def unpin() -> None:
    """Every thread of the process back on all cores: a pinned draft worker moves the rest of
    the process off its cores when it starts (draft_cpu.placement); once it is gone, the next
    system's engine (and its new draft worker, which starts from this thread's cores) must
    not stay off them."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), ALL_CORES)
        except OSError:  # the thread has exited
            pass
    torch.set_num_threads(ENGINE_THREADS)


def engine_threads(system: System, pinned: dict[str, set[int]]) -> None:
    """torch threads for the cores the system's pinned draft worker leaves the engine.
    pinned: each --draft-cpu-cores value -> its cores."""
    draft_cores = system.setting("draft_cpu_cores")
    if draft_cores:
        torch.set_num_threads(len([c for c in ALL_CORES if c not in pinned[draft_cores]]) or len(ALL_CORES))


def cyclic(messages: list, n: int) -> list:
    return [messages[i % len(messages)] for i in range(n)]


def single_row(s: System, m: DraftMeasure, measures: dict) -> tuple:
    rate = lambda key: measures[key].rate if key in measures else None  # noqa: E731
    ms = m.draft_seconds / m.verify_steps * 1000 if m.verify_steps and s.speculator == "draft" else None
    overlap = m.overlap_seconds / m.wall_seconds if s.speculator == "draft" and m.wall_seconds else None
    return (s.label, f"{m.rate:.1f}", ratio(m.rate, rate("plain")), ratio(m.rate, rate("hf")),
            ratio(m.rate, rate("hf-assisted")), fmt(m.acceptance_length, ".2f"), fmt(ms, ".1f"),
            fmt(overlap, ".0%"), step_split(m.steps), m.same_outputs(measures.get("plain")))


def step_split(steps: list) -> str:
    """Median ms per step: draft worker busy / target busy / neither ("-" for HF rows)."""
    if not steps:
        return "-"
    med = lambda values: statistics.median(values) * 1000  # noqa: E731
    return (f"{med([t.draft for t in steps]):.0f} / {med([t.verify for t in steps]):.0f} / "
            f"{med([t.idle for t in steps]):.0f}")


def main(argv=None) -> None:
    global ENGINE_THREADS
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ENGINE_THREADS = torch.get_num_threads()
    default_models(args)
    all_systems = make_systems(args)
    systems = select_systems(all_systems, args.systems,
                             note="" if HAS_OVERLAP else " (no overlap rows: EngineConfig has no draft_overlap)")
    conc_systems = [s for s in all_systems if s.key in CONCURRENCY_KEYS] if args.concurrency else []
    messages = [[{"role": "user", "content": p}] for p in PROMPTS[:args.limit]]
    report = Report(args.name, "bench_draft: draft-model speculation against HF transformers", "scripts.bench_draft",
                    argv, args)

    t0 = time.perf_counter()
    llm = LLM(model=args.target, dtype=args.dtype, device=args.device, kv_cache_memory=args.kv_cache_memory,
              num_speculative_tokens=args.num_speculative_tokens, adaptive_speculation=args.adaptive, seed=0,
              max_num_seqs=max([64] + args.concurrency), speculator="none", draft_model=args.draft,
              draft_dtype=args.dtype, enforce_eager=args.enforce_eager)
    t1 = time.perf_counter()
    dtype = DTYPES[args.dtype]
    hf_keys = {s.key for s in systems if s.is_hf}
    hf = load_hf(args.target, dtype, args.device) if hf_keys else None
    assistant = load_hf(args.draft, dtype, args.device) if "hf-assisted" in hf_keys else None
    log(f"loaded: engine (target and draft) {t1 - t0:.1f} s, HF transformers {time.perf_counter() - t1:.1f} s")
    engine = llm.engine
    hf_ids, mismatched = hf_prompt_ids(args.target, messages, engine)
    eos_ids = list(engine.model_config.eos_token_ids)
    speculation = Speculation(engine, systems + conc_systems, adaptive_speculation=args.adaptive)
    pinned = {s.setting("draft_cpu_cores"): set(parse_core_list(s.setting("draft_cpu_cores")))
              for s in systems + conc_systems if s.setting("draft_cpu_cores")}  # parsed before any pinning
    backends = {}  # draft settings -> the draft worker's backend

    def use(s: System) -> None:
        if pinned and speculation.switches(s):
            unpin()
        speculation.use(s)
        engine_threads(s, pinned)
        if s.speculator == "draft":
            key = tuple((k, v) for k, v in s.settings if k != "speculative_tree_width")
            backends[key] = draft_backend(engine)

    def hf_run(s: System, ids: list, max_tokens: int):
        return hf_one_at_a_time(hf, ids, max_tokens, eos_ids=eos_ids,
                                assistant=assistant if s.hf_assisted else None)

    def run(item: Item, m: Measure) -> None:
        s = item.system
        if s.is_hf:
            m.add_round(*hf_run(s, hf_ids, args.max_tokens))
            return
        use(s)
        if item.n is not None:
            tokens, seconds, _ = run_engine(llm, cyclic(messages, item.n), args.max_tokens)
            m.add_round(tokens, seconds)
            return
        stats = engine.stats
        draft, overlap, steps = stats.draft_seconds, stats.overlap_seconds, stats.num_steps
        tokens, seconds, results = one_at_a_time(llm, messages, args.max_tokens)
        m.add_round(tokens, seconds, [r.token_ids for r in results])
        new_steps = stats.num_steps - steps
        if 0 < new_steps <= len(stats.timeline):
            m.steps.extend(list(stats.timeline)[-new_steps:])
        m.draft_seconds += stats.draft_seconds - draft
        m.overlap_seconds += stats.overlap_seconds - overlap
        if s.speculates:
            m.add_metrics(results)

    warm = min(16, args.max_tokens)
    warmed = set()

    def warm_up(item: Item) -> None:  # every system once, on a short request (and at each concurrency)
        s = item.system
        if s.is_hf:
            hf_run(s, hf_ids[:1], warm)
        elif (s.key, item.n) not in warmed:
            use(s)
            run_engine(llm, messages[:1] if item.n is None else cyclic(messages, item.n), warm)
        warmed.add((s.key, item.n))

    items = [Item(s.key, s) for s in systems] + [Item((s.key, n), s, n) for n in args.concurrency
                                                  for s in conc_systems]
    measures = {item.key: DraftMeasure() if item.n is None else Measure() for item in items}
    HF_OVERSHOOT.clear()
    try:
        interleaved(items, args.repeats, run, warm=warm_up, measures=measures,
                    label=lambda item: item.system.label + ("" if item.n is None else f", {item.n} concurrent"))
        print_header(report, args, llm, backends, hf_ids, mismatched)
        print_single(report, systems, measures)
        if args.concurrency:
            print_concurrency(report, measures, args.concurrency)
        print_targets(report, systems, measures, args.concurrency)
        report.data["single"] = {s.key: {"label": s.label, **measures[s.key].summary(),
                                         "draft_seconds": measures[s.key].draft_seconds,
                                         "overlap_seconds": measures[s.key].overlap_seconds} for s in systems}
        report.data["concurrent"] = [{"system": s.key, "requests": n, **measures[(s.key, n)].summary()}
                                     for n in args.concurrency for s in conc_systems]
        report.write()
    finally:
        engine.close()


def print_header(report: Report, args, llm: LLM, backends: dict, ids: list[list[int]], mismatched: list[int]) -> None:
    engine = llm.engine
    lengths = [len(i) for i in ids]
    report.line(f"### Draft-model speculation, {datetime.date.today().isoformat()}")
    report.line()
    report.line(f"target {args.target}  draft {args.draft}  dtype {args.dtype}  device {engine.device}  "
                f"torch {torch.__version__}  threads {ENGINE_THREADS}  cores {format_core_list(ALL_CORES)}"
                f"{'  enforce_eager' if args.enforce_eager else ''}")
    report.line(f"greedy, at most {args.max_tokens} new tokens per request (EOS stops earlier; tok/s = generated "
                f"tokens / wall time); median of {args.repeats} rounds after a warm-up; {len(ids)} chat prompts of "
                f"{min(lengths)}-{max(lengths)} tokens; draft tokens per step "
                f"{engine.config.speculative_tokens('draft')}; adaptive speculation {'on' if args.adaptive else 'off'}")
    if backends:
        report.line("draft worker backends: " + "; ".join(f"{' '.join(f'{k}={v}' for k, v in key) or 'default'}: "
                                                          f"{backend}" for key, backend in backends.items()))
    if mismatched:
        report.line(f"NOTE: HF and engine prompt token ids differ for prompts {[i + 1 for i in mismatched]}")
    if not HAS_OVERLAP:
        report.line("NOTE: no overlap rows: EngineConfig has no draft_overlap setting")


def print_single(report: Report, systems: list[System], measures: dict) -> None:
    report.line()
    report.line("#### Single stream (one request at a time)")
    report.line()
    header = ("system", "tok/s", "vs ours plain", "vs HF plain", "vs HF assisted", "mean accept len",
              "draft ms/verify step", "overlap", "step ms: draft / verify / idle", "same output as ours plain")
    report.table(header, [single_row(s, measures[s.key], measures) for s in systems])
    report.line()
    report.line("Mean accept len = 1 + accepted / verify steps; draft ms/verify step = draft worker busy time / verify "
                "steps (engine.stats); overlap = time draft and verify ran at once / wall time; step ms = medians "
                "over the row's engine steps of draft worker busy, target busy and neither (scheduling, sampling, "
                "commit, waiting) within the step. 'same output' counts prompts whose tokens equal ours plain "
                "(greedy is lossless up to kernel-shape differences in bf16).")
    if HF_OVERSHOOT:
        report.line(f"HF assisted generated past max_new_tokens in {len(HF_OVERSHOOT)} requests (up to "
                    f"{max(HF_OVERSHOOT)} tokens); those tokens were cut off and not counted.")


def print_concurrency(report: Report, measures: dict, levels: list[int]) -> None:
    report.line()
    report.line("#### Concurrent requests (the prompts repeated to fill N, all at once)")
    report.line()
    rows = []
    for n in levels:
        plain, draft = measures[("plain", n)].rate, measures[("draft-tree", n)].rate
        rows.append((str(n), f"{plain:.1f}", f"{draft:.1f}", ratio(draft, plain)))
    report.table(("requests", "ours plain tok/s", "ours draft tree tok/s", "draft / plain"), rows)


def print_targets(report: Report, systems: list[System], measures: dict, levels: list[int]) -> None:
    lines = []
    drafts = [s for s in systems if s.speculator == "draft"]
    if drafts:
        best = max(drafts, key=lambda s: measures[s.key].rate)
        for key, name, goal in (("hf-assisted", "HF assisted", 1.3), ("hf", "HF plain", 2.5)):
            if key in measures:
                got = measures[best.key].rate / measures[key].rate
                lines.append(f"single stream: best draft row ({best.label}) {got:.2f}x {name} (target >= {goal}x): "
                             f"{'met' if got >= goal else 'NOT met'}")
    if levels:
        n = 16 if 16 in levels else levels[-1]
        got = measures[("draft-tree", n)].rate / measures[("plain", n)].rate
        lines.append(f"{n} concurrent: ours draft tree {got:.2f}x ours plain (target >= 0.95x at 16): "
                     f"{'met' if got >= 0.95 else 'NOT met'}" + ("" if n == 16 else " (16 not measured)"))
    if lines:
        report.line()
        for line in lines:
            report.line(line)
    report.data["targets"] = lines


if __name__ == "__main__":
    main()
