"""Start-up: seconds from a fresh process to its first generated token, ours against
llama.cpp and HF transformers on the same GGUF file, and where our seconds go.

Each round runs, in fresh processes, one after another (so a drifting machine load hits
all alike):
  - llama.cpp: the wall time of `llama-bench -p 0 -n 1 -r 1` (load, a warm-up token, a token);
  - ours: `LLM(model=M)` with the defaults (the compiled decode step; Inductor's cache warm
    after the first round, which the table leaves out), then one greedy token;
  - ours, eager: the same with enforce_eager=True (no compile);
  - with --first-compile, once before the rounds: ours with an empty Inductor cache (a
    fresh TORCHINDUCTOR_CACHE_DIR), what a machine's first start costs;
  - HF transformers: `from_pretrained(dir, gguf_file=...)` (which dequantizes the file to
    float32), then one greedy token.
Our rows also split the time: importing, loading the model (runtime.models.loader), and
building the engine (KV cache, the compile).

    python -m scripts.bench_start                                   # the default model
    python -m scripts.bench_start --model models/qwen2.5-coder-1.5b-instruct.gguf --rounds 2
    python -m scripts.bench_start --first-compile --skip-hf
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.bench_peer import DEFAULT_BIN, gguf_path
from scripts.harness import ROOT, Report, add_results_args, fmt, log, median, ratio

# run in a fresh interpreter; prints one JSON line of its own timings
OURS = """
import json, sys, time
t0 = time.perf_counter()
from runtime import LLM, SamplingParams
from runtime.models import loader
t1 = time.perf_counter()
load_s = []
original = loader.load_model
def timed(*args, **kwargs):
    start = time.perf_counter()
    try:
        return original(*args, **kwargs)
    finally:
        load_s.append(time.perf_counter() - start)
loader.load_model = timed
import runtime.engine
runtime.engine.load_model = timed
llm = LLM(model=sys.argv[1], enforce_eager=sys.argv[2] == "eager")
t2 = time.perf_counter()
llm.generate(["Hello"], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": sum(load_s), "engine_s": t2 - t1 - sum(load_s),
                  "token_s": t3 - t2}))
llm.close()
"""
HF = """
import sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM
path = Path(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float32)
with torch.no_grad():
    model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=1, do_sample=False)
"""


def wall(cmd: list[str], env: dict | None = None) -> tuple[float, str]:
    """Seconds a command took, and its stdout; raises with its output's tail on failure."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
        raise RuntimeError(f"{cmd[:3]} exited {proc.returncode}:\n{tail}")
    return seconds, proc.stdout


def threads_env(threads: int, **extra: str) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), **extra}


def run_ours(model: str, mode: str, threads: int, **env: str) -> dict:
    seconds, out = wall([sys.executable, "-c", OURS, model, mode], threads_env(threads, **env))
    return {"wall_s": seconds, **json.loads(out.strip().splitlines()[-1])}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", help="alias or .gguf file; repeat for several "
                        "(default: smollm2-135m)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds, after one untimed warm-up round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-hf", action="store_true", help="leave HF transformers out")
    parser.add_argument("--first-compile", action="store_true",
                        help="also time one start with an empty Inductor cache (minutes on a small machine)")
    parser.add_argument("--llama-cpp-bin", type=Path, default=DEFAULT_BIN)
    add_results_args(parser, "bench_start")
    args = parser.parse_args(argv)
    report = Report(args.name, "bench_start: seconds from a fresh process to the first token", "scripts.bench_start",
                    argv, args)
    rows = []
    for model in args.model or ["smollm2-135m"]:
        path = gguf_path(model)
        times: dict[str, list] = {"llama.cpp": [], "ours": [], "ours, eager": [], "HF transformers": []}
        first = []
        if args.first_compile:
            with tempfile.TemporaryDirectory(prefix="inductor-") as empty:
                first.append(run_ours(model, "compiled", args.threads, TORCHINDUCTOR_CACHE_DIR=empty))
            log(f"{path.name}: ours with an empty Inductor cache {fmt(first[0]['wall_s'])} s")
        for rnd in range(args.rounds + 1):  # round 0 warms the page cache and Inductor's cache
            if (args.llama_cpp_bin / "llama-bench").is_file():
                times["llama.cpp"].append(wall([str(args.llama_cpp_bin / "llama-bench"), "-m", str(path), "-p", "0",
                                                "-n", "1", "-r", "1", "-t", str(args.threads)])[0])
            times["ours"].append(run_ours(model, "compiled", args.threads))
            times["ours, eager"].append(run_ours(model, "eager", args.threads))
            if not args.skip_hf:
                times["HF transformers"].append(wall([sys.executable, "-c", HF, str(path)], threads_env(args.threads))[0])
            log(f"{path.name} round {rnd}/{args.rounds}: " + ", ".join(
                f"{name} {fmt(t[-1]['wall_s'] if isinstance(t[-1], dict) else t[-1])} s"
                for name, t in times.items() if t))
        timed = {name: t[1:] for name, t in times.items()} | ({"ours, empty Inductor cache": first} if first else {})
        report.data[path.name] = timed
        llama = median(timed["llama.cpp"])
        for name, runs in timed.items():
            if not runs:
                continue
            ours = isinstance(runs[0], dict)
            seconds = median([r["wall_s"] for r in runs] if ours else runs)
            parts = [median([r[k] for r in runs]) for k in ("import_s", "load_s", "engine_s", "token_s")] if ours \
                else [None] * 4
            rows.append((path.name, name, fmt(seconds, ".2f"), ratio(seconds, llama), *map(fmt, parts)))
    report.table(("model", "system", "seconds to first token", "/ llama.cpp", "ours: import", "load model",
                  "build engine", "first token"), rows, "llrrrrrr")
    report.line()
    report.line(f"- {args.threads} threads; median of {args.rounds} rounds after one warm-up round (page cache and "
                f"Inductor's cache warm); each run a fresh process")
    report.line(f"- llama.cpp: {args.llama_cpp_bin}/llama-bench -p 0 -n 1 -r 1 (its load, a warm-up token and a "
                f"token); HF transformers: from_pretrained(gguf_file=...) in float32, then one token")
    report.line("- ours: LLM(model) then one greedy token; the columns split our seconds (the rest is the "
                "interpreter's start and shutdown)")
    if args.first_compile:
        report.line("- ours, empty Inductor cache: one run before the rounds, with a fresh TORCHINDUCTOR_CACHE_DIR "
                    "(the quantized-linear kernel's own build cache stays warm)")
    report.write()


if __name__ == "__main__":
    main()
