"""Decode speed of this engine against llama.cpp on the same GGUF files, measured in one run.

Both run on the CPU with the same thread count, greedy, every request generating exactly
--max-tokens tokens (llama.cpp: its benchmark tools never stop early, or --ignore-eos;
ours: ignore_eos). Rounds interleave the two (llama.cpp, ours, llama.cpp, ours ...) so that
drifting machine load hits both alike; the table shows medians over --rounds and the ratio
ours / llama.cpp; with several --quantization modes, a last column compares each mode with
the last one listed (e.g. the int4 default against bf16 --enforce-eager, the engine before
quantized weights). Rows, per --model and per --quantization mode of ours:

  - decode, batch 1: llama.cpp `llama-bench -m FILE -p 0 -n N -d P -t T -r 1 -o json`
    (tg rate: N single-token decode steps after a P-token context, P = our prompt's length);
    ours: one prompt, tok/s = (tokens - 1) / (finished - first token) = 1 / TPOT.
  - decode, batch B for each of --batch-sizes (default 8 and 32): llama.cpp
    `llama-batched-bench -m FILE -c C -b 2048 -ub 512 -npp P -ntg N -npl B -t T
    --output-format jsonl` (S_TG: B x N tokens over N batched decode steps, P = our prompts'
    mean length, C = --batched-ctx); ours: B prompts (PROMPTS, repeated past 8) in one
    generate, tok/s = sum(tokens - 1) / (last finish - first first-token).
  - with --speculative --target T.gguf --draft D.gguf: draft-model speculation, one prompt,
    llama.cpp `llama-speculative-simple -m T -md D -p PROMPT -n N -t T -td T --spec-type
    draft-simple --temp 0 --ignore-eos -c 4096` (its "decoded ... t/s"; without --spec-type
    this build refuses a plain draft model) against ours with speculator="draft"
    (1 / TPOT), each with its own default draft settings.
  - with --lookup, per --model: prompt lookup on a prompt that asks to rewrite code it
    quotes, llama.cpp `llama-lookup -m FILE -p PROMPT -n N -t T --temp 0 --ignore-eos
    -c 4096` (n-gram drafts from the context) against ours with speculator="lookahead"
    (1 / TPOT), each with its own default settings.

The prompts are text for ours (and for llama-speculative-simple); llama-bench and
llama-batched-bench decode random tokens after a context of the same length. Timings exclude
model loading and prefill. Ours is warmed up once per row; the llama.cpp tools warm up
themselves. The table goes to stdout and, with the machine (git commit, CPU, cores, torch), to
benchmarks/results/<date>-bench_peer.md (and .json; --name, --output).

    python -m scripts.bench_peer --rounds 3
    python -m scripts.bench_peer --quantization auto,none,none+eager --max-tokens 128
    python -m scripts.bench_peer --model /models/qwen2.5-1.5b-q8_0.gguf --threads 16 \\
        --speculative --target /models/qwen2.5-1.5b-q8_0.gguf --draft /models/qwen2.5-0.5b-q8_0.gguf
    python -m scripts.bench_peer --model models/qwen2.5-coder-1.5b-instruct.gguf --skip-batch --lookup
    python -m scripts.bench_peer --rounds 1 --max-tokens 8 --quantization auto+eager --skip-batch   # smoke test

scripts/build_llama_cpp.sh builds the llama.cpp tools; without them the llama.cpp column reads n/a.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runtime import LLM, SamplingParams
from runtime.models.loader import QUANTIZATIONS, resolve_model
from runtime.models.quant_linear import linear_kernels
from scripts.harness import Report, add_results_args, draft_backend, log, markdown_table

DEFAULT_BIN = Path(os.environ.get("LLAMA_CPP_DIR", Path.home() / ".cache/heterospec/llama.cpp")) / "build/bin"
PROMPTS = [  # 8 prompts of 7-12 tokens (SmolLM2's tokenizer)
    "Explain how a hash table works, step by step.",
    "Write a short story about a lighthouse keeper.",
    "The history of the printing press begins",
    "What is the difference between a virus and a bacterium?",
    "The three most important ideas in thermodynamics are",
    "List five tips for learning a new language:",
    "Once upon a time in a small village by the sea,",
    "Describe the water cycle in simple terms.",
]
LOOKUP_PROMPT = (  # output that mostly repeats the prompt: what prompt lookup is for
    "Add type hints to this Python function and return the whole function:\n\n"
    "def moving_average(values, window):\n"
    "    if window <= 0:\n"
    "        raise ValueError('window must be positive')\n"
    "    averages = []\n"
    "    total = 0.0\n"
    "    for i, value in enumerate(values):\n"
    "        total += value\n"
    "        if i >= window:\n"
    "            total -= values[i - window]\n"
    "        if i >= window - 1:\n"
    "            averages.append(total / window)\n"
    "    return averages\n")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", default=None,
                   help="alias or .gguf file; repeatable (default: smollm2-135m)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="threads for both: llama.cpp -t, torch.set_num_threads (default: all cores, %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians shown (default: %(default)s)")
    p.add_argument("--quantization", default="auto",
                   help="ours: comma list of " + "|".join(QUANTIZATIONS) + ", one row each, an '+eager' suffix "
                        "adding --enforce-eager (e.g. auto+eager); auto (the default) is always a row, and "
                        "the last mode listed is the reference of the last column (default: %(default)s)")
    p.add_argument("--dtype", default="auto", help="ours: dtype (default: auto, EngineConfig's choice)")
    p.add_argument("--llama-cpp-bin", type=Path, default=DEFAULT_BIN, help="llama.cpp binaries (default: %(default)s)")
    p.add_argument("--batched-ctx", type=int, default=4096,
                   help="llama-batched-bench -c (default: %(default)s, raised to what the row needs)")
    p.add_argument("--batched-extra", default="",
                   help="extra llama-batched-bench flags, e.g. '-kvu' (default: none)")
    p.add_argument("--batch-sizes", default="8,32",
                   help="comma list of the batched rows' request counts (default: %(default)s)")
    p.add_argument("--skip-batch", action="store_true", help="only the batch-1 rows")
    p.add_argument("--speculative", action="store_true", help="add the draft-model speculation row (--target, --draft)")
    p.add_argument("--lookup", action="store_true",
                   help="add a prompt-lookup row per --model: llama-lookup against our lookahead speculator")
    p.add_argument("--target", help="speculation: target .gguf (or alias)")
    p.add_argument("--draft", help="speculation: draft .gguf (or alias), the target's vocabulary")
    p.add_argument("--draft-backend", default="auto", choices=("auto", "ipex", "torch"),
                   help="speculation: ours' --draft-backend (default: %(default)s)")
    p.add_argument("--output", type=Path, default=None,
                   help="markdown report, the .json beside it (default: benchmarks/results/<date>-NAME.md)")
    add_results_args(p, "bench_peer")
    args = p.parse_args(argv)
    args.model = args.model or ["smollm2-135m"]
    quants = [q.strip() for q in args.quantization.split(",") if q.strip()]
    bad = [q for q in quants if q.removesuffix("+eager") not in QUANTIZATIONS]
    if bad:
        p.error(f"--quantization: {', '.join(bad)} not in {', '.join(QUANTIZATIONS)}")
    args.quantization = ["auto"] + [q for q in dict.fromkeys(quants) if q != "auto"]
    args.reference = quants[-1] if len(args.quantization) > 1 else None
    try:
        args.batch_sizes = [] if args.skip_batch else [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    except ValueError:
        p.error(f"--batch-sizes: not a comma list of integers: {args.batch_sizes!r}")
    if args.max_tokens < 2 or args.rounds < 1 or args.threads < 1 or any(b < 2 for b in args.batch_sizes):
        p.error("--max-tokens must be >= 2, --rounds >= 1, --threads >= 1 and every batch size >= 2")
    if args.speculative and not (args.target and args.draft):
        p.error("--speculative needs --target and --draft")
    return args


# ---------------------------------------------------------------- llama.cpp

def gguf_path(spec: str) -> Path:
    source = resolve_model(spec)
    if source.kind != "gguf":
        raise SystemExit(f"{spec}: llama.cpp needs a .gguf file, this resolves to an {source.kind} model")
    return source.path


def run_tool(cmd: list[str]) -> str:
    """stdout + stderr of a llama.cpp tool; raises with the tail of its output on failure."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
        raise RuntimeError(f"{shlex.join(cmd)} exited {proc.returncode}:\n{tail}")
    return proc.stdout + "\n" + proc.stderr


def llama_bench(bin_dir: Path, model: Path, n: int, depth: int, threads: int) -> tuple[float, list[str]]:
    cmd = [str(bin_dir / "llama-bench"), "-m", str(model), "-p", "0", "-n", str(n), "-d", str(depth),
           "-t", str(threads), "-r", "1", "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()[-400:]}")
    return float(json.loads(proc.stdout)[0]["avg_ts"]), cmd


def llama_batched_bench(bin_dir: Path, model: Path, batch: int, n: int, prompt_len: int, threads: int, ctx: int,
                        extra: list[str]) -> tuple[float, list[str]]:
    ctx = max(ctx, batch * (prompt_len + n))
    cmd = [str(bin_dir / "llama-batched-bench"), "-m", str(model), "-c", str(ctx), "-b", "2048", "-ub", "512",
           "-npp", str(prompt_len), "-ntg", str(n), "-npl", str(batch), "-t", str(threads),
           "--output-format", "jsonl", *extra]
    for line in run_tool(cmd).splitlines():
        if line.startswith("{") and '"speed_tg"' in line:
            return float(json.loads(line)["speed_tg"]), cmd
    raise RuntimeError(f"{shlex.join(cmd)}: no result line")


def llama_speculative(bin_dir: Path, target: Path, draft: Path, prompt: str, n: int,
                      threads: int) -> tuple[float, list[str], str]:
    cmd = [str(bin_dir / "llama-speculative-simple"), "-m", str(target), "-md", str(draft), "-p", prompt,
           "-n", str(n), "-t", str(threads), "-td", str(threads), "--spec-type", "draft-simple", "--temp", "0",
           "--ignore-eos", "-c", "4096"]
    return decoded_rate(cmd)


def llama_lookup(bin_dir: Path, model: Path, prompt: str, n: int, threads: int) -> tuple[float, list[str], str]:
    cmd = [str(bin_dir / "llama-lookup"), "-m", str(model), "-p", prompt, "-n", str(n), "-t", str(threads),
           "--temp", "0", "--ignore-eos", "-c", "4096"]
    return decoded_rate(cmd)


def decoded_rate(cmd: list[str]) -> tuple[float, list[str], str]:
    """(tok/s, cmd, acceptance) from a llama.cpp speculation example's closing lines."""
    out = run_tool(cmd)
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", out)
    if not m:
        raise RuntimeError(f"{shlex.join(cmd)}: no 'decoded ... t/s' line")
    acc = re.search(r"accept\s+=\s+([\d.]+)%", out)
    return float(m.group(3)), cmd, (f"accept {acc.group(1)}%" if acc else "")


# ---------------------------------------------------------------- ours

def weights_label(llm: LLM) -> str:
    """e.g. '120 int4 + 1 int8' or '121 bfloat16': the linear layers' weight forms."""
    parts = []
    for part in re.split(r", (?=\d+ )", linear_kernels(llm.engine.model)):
        count, kernel = part.split(" ", 2)[:2]
        parts.append(f"{count} {kernel}")
    return " + ".join(parts)


def ours_single(llm: LLM, prompt_ids: list[int], n: int) -> float:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    (result,) = llm.generate([prompt_ids], params, use_tqdm=False)
    m = result.metrics
    assert m.num_tokens == n, (m.num_tokens, n)
    return (m.num_tokens - 1) / (m.finished_time - m.first_token_time)


def ours_batch(llm: LLM, prompt_ids: list[list[int]], n: int) -> float:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    results = llm.generate(prompt_ids, params, use_tqdm=False)
    ms = [r.metrics for r in results]
    assert all(m.num_tokens == n for m in ms)
    return sum(m.num_tokens - 1 for m in ms) / (max(m.finished_time for m in ms) - min(m.first_token_time for m in ms))


# ---------------------------------------------------------------- table

@dataclass
class Row:
    label: str
    model: str
    quantization: str  # ours: the mode asked for -> what the linear layers hold
    mode: str = "auto"  # the --quantization mode (with +eager)
    llama: list[float] = field(default_factory=list)
    ours: list[float] = field(default_factory=list)
    note: str = ""
    error: str = ""


def med(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def ratio(a: float | None, b: float | None) -> str:
    return f"{b / a:.2f}x" if a and b else "n/a"


def table(rows: list[Row], reference: str | None) -> str:
    """One line per row; with a reference mode, each row's rate over the reference mode's on
    the same row and model."""
    ref = {(r.label, r.model): med(r.ours) for r in rows if r.mode == reference}
    lines = []
    for r in rows:
        a, b = med(r.llama), med(r.ours)
        line = (r.label, r.model, fmt(a), fmt(b), ratio(a, b), r.quantization)
        lines.append(line + ((ratio(ref.get((r.label, r.model)), b),) if reference else ()))
    header = ("row", "model", "llama.cpp tok/s", "ours tok/s", "ours/llama.cpp", "ours: quantization")
    if reference:
        return markdown_table(header + (f"ours / ours[{reference}]",), lines, "llrrrlr")
    return markdown_table(header, lines, "llrrrl")


# ---------------------------------------------------------------- main

def run_rounds(jobs, rounds: int, bin_dir: Path) -> None:
    """Interleaved rounds: per round and job (label, llama.cpp tool, its run, our run, our
    (row, engine) pairs), llama.cpp's run, then each of ours."""
    for rnd in range(rounds):
        for label, tool, run_llama, run_ours, group in jobs:
            try:
                if not (bin_dir / tool).is_file():
                    raise FileNotFoundError(f"no {tool} in {bin_dir} (scripts/build_llama_cpp.sh builds it)")
                rate = run_llama()
                for row, _ in group:
                    row.llama.append(rate)
            except (RuntimeError, OSError, FileNotFoundError) as e:
                for row, _ in group:
                    row.error = str(e).splitlines()[0][:300]
                rate = None
            msg = f"round {rnd + 1}/{rounds} {label}: llama.cpp {fmt(rate)}"
            for row, llm in group:
                row.ours.append(run_ours(llm))
                msg += f", ours[{row.quantization.split(':')[0]}] {row.ours[-1]:.1f}"
            log(msg + " tok/s")


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    bin_dir = args.llama_cpp_bin
    if not (bin_dir / "llama-bench").is_file():
        log(f"no llama.cpp tools in {bin_dir}: the llama.cpp column reads n/a (scripts/build_llama_cpp.sh builds them)")
    report = Report(args.name, "bench_peer: this engine against llama.cpp", "scripts.bench_peer", argv, args)
    load_start = os.getloadavg()
    started = time.time()
    n = args.max_tokens
    sp = SamplingParams(max_tokens=min(8, n), temperature=0, ignore_eos=True)

    # ours: one engine per model x quantization mode, all loaded before the first round
    rows: list[Row] = []
    jobs = []  # (row, llama callable, ours callable)
    for spec in args.model:
        path = gguf_path(spec)
        engines = {}
        for q in args.quantization:
            t0 = time.perf_counter()
            engines[q] = LLM(model=str(path), dtype=args.dtype, quantization=q.removesuffix("+eager"),
                             enforce_eager=q.endswith("+eager"), max_num_seqs=max(args.batch_sizes, default=1),
                             seed=0)
            log(f"loaded {path.name} quantization={q} in {time.perf_counter() - t0:.1f} s: "
                f"{weights_label(engines[q])}, {engines[q].engine.dtype}")
        tok = engines["auto"].tokenizer
        ids = [tok(p).input_ids for p in PROMPTS]
        single_ids, single_len = ids[0], len(ids[0])
        extra = shlex.split(args.batched_extra)
        shapes = [("decode, batch 1", "llama-bench",
                   lambda p=path, d=single_len: llama_bench(bin_dir, p, n, d, args.threads)[0],
                   lambda llm, i=single_ids: ours_single(llm, i, n),
                   lambda llm, i=single_ids: llm.generate([i], sp, use_tqdm=False))]
        for b in args.batch_sizes:
            batch_ids = [ids[i % len(ids)] for i in range(b)]
            batch_len = round(sum(map(len, batch_ids)) / b)
            shapes.append((f"decode, batch {b}", "llama-batched-bench",
                           lambda p=path, b=b, d=batch_len: llama_batched_bench(bin_dir, p, b, n, d, args.threads,
                                                                                args.batched_ctx, extra)[0],
                           lambda llm, i=batch_ids: ours_batch(llm, i, n),
                           lambda llm, i=batch_ids: llm.generate(i, sp, use_tqdm=False)))
        for label, tool, run_llama, run_ours, warm in shapes:
            group = []
            for q, llm in engines.items():
                row = Row(label, path.name, f"{q}: {weights_label(llm)}, {llm.engine.dtype}", q)
                warm(llm)
                group.append((row, llm))
                rows.append(row)
            jobs.append((label, tool, run_llama, run_ours, group))

    run_rounds(jobs, args.rounds, bin_dir)
    for *_, group in jobs:  # the plain engines go before the speculative ones load: one engine
        for _, llm in group:     # at a time holds the cores
            llm.close()
    notes: list[str] = []

    def speculation_row(label: str, tool: str, run_llama, prompt: str, engines: list) -> None:
        """Rounds of one speculation row per (Row, engine) in `engines`: llama.cpp's example
        against ours (1 / TPOT) on `prompt`; the engines close after."""
        for row, llm in engines:
            llm.generate([prompt], sp, use_tqdm=False)
            rows.append(row)

        def run_llama_noting():
            rate, _, acc = run_llama()
            notes.append(f"{label}: llama.cpp {acc}")
            return rate

        def run_ours(llm):
            (r,) = llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                                use_tqdm=False)
            m = r.metrics
            if m.mean_acceptance_length:
                notes.append(f"{label}: ours mean acceptance length {m.mean_acceptance_length:.2f}")
            return (m.num_tokens - 1) / (m.finished_time - m.first_token_time)
        run_rounds([(label, tool, run_llama_noting, run_ours, engines)], args.rounds, bin_dir)
        for _, llm in engines:
            llm.close()

    if args.lookup:
        for spec in args.model:
            path = gguf_path(spec)
            engines = []
            for q in args.quantization:
                llm = LLM(model=str(path), dtype=args.dtype, quantization=q.removesuffix("+eager"),
                          speculator="lookahead", max_num_seqs=1, seed=0, enforce_eager=q.endswith("+eager"))
                engines.append((Row("prompt lookup, batch 1", path.name,
                                    f"{q}: {weights_label(llm)}, {llm.engine.dtype}; speculator lookahead", q), llm))
            speculation_row("prompt lookup, batch 1", "llama-lookup",
                            lambda p=path: llama_lookup(bin_dir, p, LOOKUP_PROMPT, n, args.threads),
                            LOOKUP_PROMPT, engines)
    if args.speculative:
        target, draft = gguf_path(args.target), gguf_path(args.draft)
        engines = []
        for q in args.quantization:
            mode = q.removesuffix("+eager")
            llm = LLM(model=str(target), dtype=args.dtype, quantization=mode, speculator="draft",
                      draft_model=str(draft), draft_quantization=mode, draft_backend=args.draft_backend,
                      max_num_seqs=1, seed=0, enforce_eager=q.endswith("+eager"))
            engines.append((Row("draft speculation, batch 1", f"{target.name} + {draft.name}",
                                f"{q}: {weights_label(llm)}, {llm.engine.dtype}; draft quantization {mode}, "
                                f"backend {draft_backend(llm.engine)}", q), llm))
        speculation_row("draft speculation, batch 1", "llama-speculative-simple",
                        lambda: llama_speculative(bin_dir, target, draft, PROMPTS[0], n, args.threads),
                        PROMPTS[0], engines)

    load_end = os.getloadavg()
    text = table(rows, args.reference)
    bb = shlex.join([str(bin_dir / "llama-batched-bench"), "-c", str(args.batched_ctx), "-b", "2048", "-ub", "512",
                     "-npl", "B", *shlex.split(args.batched_extra)])
    details = [
        f"{n} tokens per request, greedy, EOS ignored; {args.threads} threads each; median of {args.rounds} "
        f"interleaved rounds (llama.cpp, ours, ...); prompts of {len(ids[0])} tokens (batch 1) and "
        f"{min(map(len, ids))}-{max(map(len, ids))} tokens (batched rows, the 8 repeated; llama.cpp: random "
        f"tokens of their mean length)",
        f"llama.cpp: {bin_dir} (llama-bench -p 0 -n {n} -d P -r 1; {bb} -npp P -ntg {n})",
        "per round, tok/s: " + "; ".join(
            f"{r.label} [{r.quantization.split(':')[0]}] llama.cpp {[round(x, 1) for x in r.llama]} "
            f"ours {[round(x, 1) for x in r.ours]}" for r in rows),
        f"load average (1 min) at start {load_start[0]:.2f}, at end {load_end[0]:.2f}; "
        f"wall {time.time() - started:.0f} s",
    ]
    if notes:
        details.append("speculation: " + "; ".join(dict.fromkeys(notes)))
    details += [f"error ({r.label}, {r.model}): {r.error}" for r in rows if r.error]
    report.line(text)
    report.line()
    for d in details:
        report.line(f"- {d}")
    report.data["rows"] = [{"row": r.label, "model": r.model, "quantization": r.quantization, "mode": r.mode,
                            "llama_cpp_tok_per_s": med(r.llama), "ours_tok_per_s": med(r.ours),
                            "llama_cpp_rounds": r.llama, "ours_rounds": r.ours, "error": r.error or None}
                           for r in rows]
    report.write(args.output)


if __name__ == "__main__":
    main()
