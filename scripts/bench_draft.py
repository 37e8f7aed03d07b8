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
forward, the fraction of wall time in which draft and verify overlapped (when the engine
measures it) and how many outputs equal ours plain. A second table gives the output tok/s of
ours plain and ours draft tree with --concurrency requests at once. Last, the targets: the best
draft row >= 1.3x HF assisted and >= 2.5x HF plain single stream, draft >= 0.95x plain at 16
concurrent requests. One engine (one target load) serves all our rows; each draft setting
(backend, quantization, overlap and cores) has its own draft worker, made on first use.
Tables go to stdout, progress to stderr.

    .venv/bin/python scripts/bench_draft.py --threads 16
    .venv/bin/python scripts/bench_draft.py --systems hf-assisted,plain,draft-tree --max-tokens 128
    .venv/bin/python scripts/bench_draft.py --target smollm2-135m --draft smollm2-135m \\
        --max-tokens 16 --repeats 1 --limit 1 --concurrency 1,4        # smoke test
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import os
import statistics
import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from draft_cpu.placement import format_core_list  # noqa: E402
from runtime import LLM  # noqa: E402
from runtime.config import EngineConfig  # noqa: E402
from runtime.models.loader import DTYPES, load_tokenizer, resolve_model  # noqa: E402
from runtime.speculation import SpeculationController  # noqa: E402
from speculators import build_proposer  # noqa: E402

# scripts/ is on sys.path when run as a script
from bench_decode import load_hf  # noqa: E402
from bench_spec import HF_OVERSHOOT, Measure, add_metrics, print_table, ratio, run_engine, run_hf  # noqa: E402
from fetch_qwen_gguf import MODELS, fetch  # noqa: E402

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


@dataclass(slots=True)
class System:
    key: str
    label: str
    speculator: str | None = None  # engine rows; None for HF rows
    tree_width: int = 1
    draft: tuple = ()  # (EngineConfig field, value) pairs of this row's own draft worker; (): the engine's
    assisted: bool = False  # HF row: the draft model as assistant_model
    # per-system engine state, made on first use and swapped in before the system runs
    config: EngineConfig | None = None
    proposers: dict = field(default_factory=dict)
    controller: SpeculationController | None = None

    @property
    def is_hf(self) -> bool:
        return self.speculator is None

    @property
    def worker(self):
        """This system's draft worker, None for rows without a draft model."""
        proposer = self.proposers.get("draft") if self.speculator == "draft" else None
        return proposer.worker if proposer is not None else None


@dataclass(slots=True)
class DraftMeasure(Measure):
    draft_seconds: float = 0.0  # draft worker busy time over the row's timed runs
    draft_forwards: int = 0
    overlap_seconds: float | None = None  # draft and verify at once (engine stats), when measured
    steps: list = field(default_factory=list)  # the engine's StepTiming of each step of the timed runs

    @property
    def wall_seconds(self) -> float:
        return sum(s for _, s in self.rounds)


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
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--kv-cache-memory", default="512MiB", help="engine KV cache size (default: %(default)s)")
    p.add_argument("--no-adaptive-speculation", dest="adaptive", action="store_false",
                   help="engine: always propose the full draft instead of sizing it from measured acceptance")
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
        System("hf-assisted", "HF assisted (draft model)", assisted=True),
        System("plain", "ours plain", "none"),
        System("draft-chain", "ours draft chain", "draft", 1),
        System("draft-tree", f"ours draft tree (width {width})", "draft", width),
        System("draft-torch", "ours draft tree, torch backend", "draft", width, (("draft_backend", "torch"),)),
        System("draft-int8", "ours draft tree, int8 draft", "draft", width, (("draft_quantization", "int8"),)),
    ]
    if HAS_OVERLAP:
        systems += [System(f"overlap-{mode}", f"ours draft tree, overlap {mode} (draft cores {cores})", "draft",
                           width, (("draft_overlap", mode), ("draft_cpu_cores", cores))) for mode in ("off", "on")]
    return systems


def select_systems(systems: list[System], spec: str | None) -> list[System]:
    if not spec:
        return systems
    wanted = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = set(wanted) - {s.key for s in systems}
    if unknown:
        raise SystemExit(f"unknown system(s): {', '.join(sorted(unknown))}"
                         + ("" if HAS_OVERLAP else " (no overlap rows: EngineConfig has no draft_overlap)"))
    return [s for s in systems if s.key in wanted]


def default_models(args) -> None:
    """--target / --draft default to the Qwen2.5-Coder 1.5B / 0.5B GGUFs in models/ (fetched when missing)."""
    for attr, name in (("target", "1.5b"), ("draft", "0.5b")):
        if getattr(args, attr) is None:
            with contextlib.redirect_stdout(sys.stderr):  # stdout is for the tables
                setattr(args, attr, str(fetch(name, Path("models"))))


def prompt_ids(llm: LLM, target: str, messages: list) -> tuple[list[list[int]], list[int]]:
    """HF's prompt token ids (its chat template) and the prompts where the engine's differ."""
    hf_tok = load_tokenizer(resolve_model(target))
    ids, mismatched = [], []
    for i, conv in enumerate(messages):
        ids.append(list(hf_tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)))
        if ids[-1] != llm.engine.prompt_token_ids(conv):
            mismatched.append(i + 1)
    return ids, mismatched


def prepare(llm: LLM, system: System, base: EngineConfig, variants: dict, adaptive: bool) -> None:
    """On first use: the system's config, proposers and controller. Systems with the same draft
    settings share one draft worker (variants: draft settings -> proposer)."""
    if system.config is not None or system.is_hf:
        return
    system.config = dataclasses.replace(base, speculator=system.speculator, speculative_tree_width=system.tree_width,
                                        **dict(system.draft))
    system.controller = SpeculationController(adaptive=adaptive)
    if system.speculator == "draft":
        if system.draft not in variants:
            print(f"draft worker for {system.label}: loading", file=sys.stderr)
            place_engine(None, variants)  # a new worker may take any core: it starts from this thread's
            variants[system.draft] = build_proposer("draft", system.config, llm.engine.target_info)
        system.proposers = {"draft": variants[system.draft]}


def use_system(llm: LLM, system: System, base: EngineConfig, variants: dict, adaptive: bool) -> None:
    """Point the engine at this system's config, proposers and controller, on its cores."""
    prepare(llm, system, base, variants, adaptive)
    if not system.is_hf:
        engine = llm.engine
        engine.config, engine.proposers, engine.spec_controller = system.config, system.proposers, system.controller
    place_engine(system.worker, variants)


def place_engine(worker, variants: dict) -> None:
    """Put the engine (this thread, its OpenMP team, every thread not pinned to a draft worker's
    cores) on the cores the system's draft worker leaves it, or on all cores: a pinned draft
    worker moves the rest of the process off its cores when it starts (draft_cpu.placement)."""
    pinned = [set(p.worker.config.cpu_cores) for p in variants.values()
              if p.worker.target_cores is not None and set(p.worker.config.cpu_cores) != set(ALL_CORES)]
    if not pinned:
        return
    cores = worker.target_cores if worker is not None and worker.target_cores is not None else ALL_CORES
    for tid in os.listdir("/proc/self/task"):
        try:
            if os.sched_getaffinity(int(tid)) not in pinned:
                os.sched_setaffinity(int(tid), cores)
        except OSError:  # the thread has exited
            pass
    torch.set_num_threads(len(cores) if cores is not ALL_CORES else ENGINE_THREADS)


def overlap_seconds(stats) -> float | None:
    if all(hasattr(stats, a) for a in ("draft_seconds", "verify_seconds", "overlap_seconds")):
        return stats.overlap_seconds
    return None


def time_hf(model, ids_list: list[list[int]], max_tokens: int, eos_ids: list[int], m: Measure) -> tuple[int, float]:
    """One round of an HF row: the prompts one at a time."""
    tokens, seconds, outputs = 0, 0.0, []
    for ids in ids_list:
        n, sec, out = run_hf(model, ids, max_tokens, eos_ids, 0)
        tokens, seconds = tokens + n, seconds + sec
        outputs.append(out)
    m.rounds.append((tokens, seconds))
    m.outputs = m.outputs or outputs
    return tokens, seconds


def time_engine(llm: LLM, system: System, messages: list, max_tokens: int, m: DraftMeasure) -> tuple[int, float]:
    """One round of an engine row: the prompts one at a time, with the draft worker's and the
    engine's counters over them."""
    worker, stats = system.worker, llm.engine.stats
    busy, forwards = (worker.busy_seconds, worker.num_forwards) if worker else (0.0, 0)
    overlap = overlap_seconds(stats)
    num_steps = stats.num_steps
    tokens, seconds, results = 0, 0.0, []
    for conv in messages:
        n, sec, res = run_engine(llm, [conv], max_tokens)
        tokens, seconds, results = tokens + n, seconds + sec, results + res
    m.rounds.append((tokens, seconds))
    new_steps = stats.num_steps - num_steps
    if hasattr(stats, "timeline") and 0 < new_steps <= len(stats.timeline):
        m.steps.extend(list(stats.timeline)[-new_steps:])
    m.outputs = m.outputs or [r.token_ids for r in results]
    if worker:
        m.draft_seconds += worker.busy_seconds - busy
        m.draft_forwards += worker.num_forwards - forwards
    if system.speculator != "none":
        add_metrics(m, results)
    if overlap is not None and system.speculator == "draft":
        m.overlap_seconds = (m.overlap_seconds or 0.0) + overlap_seconds(stats) - overlap
    return tokens, seconds


def cyclic(messages: list, n: int) -> list:
    return [messages[i % len(messages)] for i in range(n)]


def progress(r: int, repeats: int, label: str, mode: str, tokens: int, seconds: float) -> None:
    print(f"round {r + 1}/{repeats} {label:52s} {mode:14s} {tokens:5d} tokens {seconds:7.2f} s "
          f"{tokens / seconds:7.1f} tok/s", file=sys.stderr)


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def single_row(s: System, m: DraftMeasure, measures: dict) -> tuple:
    rate = lambda key: measures[key].rate if key in measures else None  # noqa: E731
    plain = measures.get("plain")
    same = "-" if plain is None or plain is m else \
        f"{sum(a == b for a, b in zip(m.outputs, plain.outputs))}/{len(m.outputs)}"
    ms = m.draft_seconds / m.draft_forwards * 1000 if m.draft_forwards else None
    overlap = m.overlap_seconds / m.wall_seconds if m.overlap_seconds is not None and m.wall_seconds else None
    return (s.label, f"{m.rate:.1f}", ratio(m.rate, rate("plain")), ratio(m.rate, rate("hf")),
            ratio(m.rate, rate("hf-assisted")), fmt(m.acceptance_length, ".2f"), fmt(ms, ".1f"),
            fmt(overlap, ".0%"), step_split(m.steps), same)


def step_split(steps: list) -> str:
    """Median ms per step: draft worker busy / target busy / neither ("-" for HF rows)."""
    if not steps:
        return "-"
    med = lambda values: statistics.median(values) * 1000  # noqa: E731
    return (f"{med([t.draft for t in steps]):.0f} / {med([t.verify for t in steps]):.0f} / "
            f"{med([t.idle for t in steps]):.0f}")


def print_header(args, llm: LLM, variants: dict, ids: list[list[int]], mismatched: list[int]) -> None:
    engine = llm.engine
    lengths = [len(i) for i in ids]
    backends = "; ".join(f"{' '.join(f'{k}={v}' for k, v in key) or 'default'}: {p.worker.backend}"
                         for key, p in variants.items())
    print(f"\n### Draft-model speculation, {datetime.date.today().isoformat()}\n")
    print(f"target {args.target}  draft {args.draft}  dtype {args.dtype}  device {engine.device}  "
          f"torch {torch.__version__}  threads {ENGINE_THREADS}  cores {format_core_list(ALL_CORES)}")
    print(f"greedy, at most {args.max_tokens} new tokens per request (EOS stops earlier; tok/s = generated tokens / "
          f"wall time); median of {args.repeats} rounds after a warm-up; {len(ids)} chat prompts of {min(lengths)}-"
          f"{max(lengths)} tokens; draft tokens per step {engine.config.speculative_tokens('draft')}; adaptive "
          f"speculation {'on' if args.adaptive else 'off'}")
    print(f"draft worker backends: {backends}")
    if mismatched:
        print(f"NOTE: HF and engine prompt token ids differ for prompts {mismatched}")
    if not HAS_OVERLAP:
        print("NOTE: no overlap rows: EngineConfig has no draft_overlap setting")


def print_single(systems: list[System], measures: dict) -> None:
    print("\n#### Single stream (one request at a time)\n")
    header = ("system", "tok/s", "vs ours plain", "vs HF plain", "vs HF assisted", "mean accept len",
              "draft ms/forward", "overlap", "step ms: draft / verify / idle", "same output as ours plain")
    print_table(header, [single_row(s, measures[s.key], measures) for s in systems])
    print("\nMean accept len = 1 + accepted / verify steps; draft ms/forward = draft worker busy time / draft "
          "forwards; overlap = time draft and verify ran at once / wall time (when the engine measures it); "
          "step ms = medians over the row's engine steps of draft worker busy, target busy and neither "
          "(scheduling, sampling, commit, waiting) within the step. "
          "'same output' counts prompts whose tokens equal ours plain (greedy is lossless up to kernel-shape "
          "differences in bf16).")
    if HF_OVERSHOOT:
        print(f"HF assisted generated past max_new_tokens in {len(HF_OVERSHOOT)} requests (up to "
              f"{max(HF_OVERSHOOT)} tokens); those tokens were cut off and not counted.")


def print_concurrency(conc: dict, levels: list[int]) -> None:
    print("\n#### Concurrent requests (the prompts repeated to fill N, all at once)\n")
    rows = []
    for n in levels:
        plain, draft = conc[("plain", n)].rate, conc[("draft-tree", n)].rate
        rows.append((str(n), f"{plain:.1f}", f"{draft:.1f}", ratio(draft, plain)))
    print_table(("requests", "ours plain tok/s", "ours draft tree tok/s", "draft / plain"), rows)


def print_targets(systems: list[System], measures: dict, conc: dict, levels: list[int]) -> None:
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
        got = conc[("draft-tree", n)].rate / conc[("plain", n)].rate
        lines.append(f"{n} concurrent: ours draft tree {got:.2f}x ours plain (target >= 0.95x at 16): "
                     f"{'met' if got >= 0.95 else 'NOT met'}" + ("" if n == 16 else " (16 not measured)"))
    if lines:
        print("\n" + "\n".join(lines))


def load(args, systems: list[System]):
    """-> (engine, {HF row key: model with generate()}); HF models only for the HF rows asked for."""
    t0 = time.perf_counter()
    llm = LLM(model=args.target, dtype=args.dtype, device=args.device, kv_cache_memory=args.kv_cache_memory,
              num_speculative_tokens=args.num_speculative_tokens, adaptive_speculation=args.adaptive, seed=0,
              max_num_seqs=max([64] + args.concurrency), speculator="none", draft_model=args.draft,
              draft_dtype=args.dtype)
    t1 = time.perf_counter()
    keys = {s.key for s in systems if s.is_hf}
    dtype = DTYPES[args.dtype]
    hf = load_hf(args.target, dtype, args.device) if keys else None
    hf_models = {"hf": hf} if "hf" in keys else {}
    if "hf-assisted" in keys:
        assistant = load_hf(args.draft, dtype, args.device)
        hf_models["hf-assisted"] = types.SimpleNamespace(  # bench_spec.run_hf calls .generate and reads .device
            device=hf.device, generate=functools.partial(hf.generate, assistant_model=assistant))
    print(f"loaded: engine (target and draft) {t1 - t0:.1f} s, HF transformers {time.perf_counter() - t1:.1f} s",
          file=sys.stderr)
    return llm, hf_models


def measure_all(args, llm, hf_models, systems, conc_systems, messages, hf_ids, eos_ids, setup):
    """Warm-up, then --repeats interleaved rounds -> ({key: DraftMeasure}, {(key, N): Measure})."""
    warm = min(16, args.max_tokens)
    for s in {s.key: s for s in systems + conc_systems}.values():  # every system once, on a short request
        setup(s)
        if s.is_hf:
            run_hf(hf_models[s.key], hf_ids[0], warm, eos_ids, 0)
        else:
            run_engine(llm, messages[:1], warm)
            for n in args.concurrency if s.key in CONCURRENCY_KEYS else []:
                run_engine(llm, cyclic(messages, n), warm)
    HF_OVERSHOOT.clear()
    measures = {s.key: DraftMeasure() for s in systems}
    conc = {(s.key, n): Measure() for s in conc_systems for n in args.concurrency}
    for r in range(args.repeats):
        for s in systems:
            setup(s)
            if s.is_hf:
                tokens, seconds = time_hf(hf_models[s.key], hf_ids, args.max_tokens, eos_ids, measures[s.key])
            else:
                tokens, seconds = time_engine(llm, s, messages, args.max_tokens, measures[s.key])
            progress(r, args.repeats, s.label, "single", tokens, seconds)
        for n in args.concurrency:
            for s in conc_systems:
                setup(s)
                tokens, seconds, _ = run_engine(llm, cyclic(messages, n), args.max_tokens)
                conc[(s.key, n)].rounds.append((tokens, seconds))
                progress(r, args.repeats, s.label, f"{n} concurrent", tokens, seconds)
    return measures, conc


def main(argv=None) -> None:
    global ENGINE_THREADS
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ENGINE_THREADS = torch.get_num_threads()
    default_models(args)
    all_systems = make_systems(args)
    systems = select_systems(all_systems, args.systems)
    conc_systems = [s for s in all_systems if s.key in CONCURRENCY_KEYS] if args.concurrency else []
    messages = [[{"role": "user", "content": p}] for p in PROMPTS[:args.limit]]

    llm, hf_models = load(args, systems)
    base = llm.engine.config
    variants = {(): llm.engine.proposers["draft"]}  # draft settings -> proposer; (): the engine's own
    hf_ids, mismatched = prompt_ids(llm, args.target, messages)
    eos_ids = list(llm.engine.model_config.eos_token_ids)
    setup = functools.partial(use_system, llm, base=base, variants=variants, adaptive=args.adaptive)
    try:
        measures, conc = measure_all(args, llm, hf_models, systems, conc_systems, messages, hf_ids, eos_ids, setup)
        print_header(args, llm, variants, hf_ids, mismatched)
        print_single(systems, measures)
        if args.concurrency:
            print_concurrency(conc, args.concurrency)
        print_targets(systems, measures, conc, args.concurrency)
    finally:
        for proposer in variants.values():
            proposer.close()


if __name__ == "__main__":
    main()
