"""Time to first token against prompt length: one process (CP=1) against context-parallel
prefill over N ranks with ring attention (CP=N), measured in one run.

Systems, each an LLMEngine built once with --max-num-batched-tokens at the longest prompt
(so each prompt is one chunk) and prefix caching off (nothing is reused between rounds):
  - CP=1: the defaults otherwise;
  - CP=N: --context-parallel-size N with the default --cp-min-tokens (2048), so a shorter
    prompt runs as in CP=1.
Prompts are the start of a public-domain text (scripts/data/perplexity_text.txt, Alice in
Wonderland, repeated when a length needs more), one request at a time, one token generated;
TTFT = first token - arrival. Rounds interleave the systems; medians are shown, with the
ratio CP=N / CP=1.

For each CP=N prompt, rank 0's split of its ring chunk: waiting for K/V in the ring (what
attention did not hide), the K/V gather to rank 0 (which also waits for the slowest rank),
and the rest (its own slice's compute). On one machine the ranks share its cores, so CP=N
cannot beat CP=1 here; with a device per rank (GPUs), the design's TTFT is about
TTFT(CP=1) / N + the exposed communication measured here, and the table prints that ratio.

    python -m scripts.bench_long
    python -m scripts.bench_long --lengths 512,2048 --repeats 1     # smoke test
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from runtime.engine import LLMEngine
from scripts.harness import Report, add_results_args, fmt, greedy, log, ratio

TEXT = Path(__file__).resolve().parent / "data" / "perplexity_text.txt"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="default: %(default)s (its context: 8192 tokens)")
    p.add_argument("--lengths", default="1024,2048,4096,8000", help="prompt lengths in tokens (default: %(default)s)")
    p.add_argument("--cp", type=int, default=2, help="context-parallel size (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per system and length (default: 3)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--enforce-eager", action="store_true", help="both engines: no compiled decode step")
    add_results_args(p, "bench_long")
    args = p.parse_args(argv)
    args.lengths = sorted(int(x) for x in args.lengths.split(",") if x.strip())
    if args.cp < 2 or args.repeats < 1 or not args.lengths or args.lengths[0] < 2:
        p.error("--cp must be >= 2, --repeats >= 1, and every length >= 2")
    return args


def prompt_ids(engine: LLMEngine, length: int) -> list[int]:
    ids = engine.tokenize(TEXT.read_text())
    return (ids * (length // len(ids) + 1))[:length]


def ttft(engine: LLMEngine, ids: list[int]) -> float:
    rid = engine.add_request(ids, greedy(1))
    while engine.has_unfinished:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out.metrics.ttft_s
    raise RuntimeError("the request did not finish")


def main(argv=None) -> None:
    args = parse_args(argv)
    report = Report(args.name, f"bench_long: time to first token, CP=1 against CP={args.cp}", "scripts.bench_long",
                    argv, args)
    common = dict(model=args.model, dtype=args.dtype, max_num_batched_tokens=args.lengths[-1],
                  max_model_len=args.lengths[-1] + 16, enable_prefix_caching=False, enforce_eager=args.enforce_eager,
                  seed=0)
    engines = {}
    try:
        for key, extra in (("cp1", {}), (f"cp{args.cp}", {"context_parallel_size": args.cp})):
            t0 = time.perf_counter()
            engines[key] = LLMEngine(**common, **extra)
            log(f"built {key} in {time.perf_counter() - t0:.1f} s")
        ring = engines[f"cp{args.cp}"]
        min_tokens = ring.config.cp_min_tokens
        rows, data = [], []
        for length in args.lengths:
            ids = prompt_ids(ring, length)
            times = {key: [] for key in engines}
            splits = []
            for key, engine in engines.items():  # warm-up
                ttft(engine, ids)
            for r in range(args.repeats):
                for key, engine in engines.items():
                    before = len(getattr(engine.runner, "ring_chunks", []))
                    times[key].append(ttft(engine, ids))
                    chunks = getattr(engine.runner, "ring_chunks", [])[before:]
                    if chunks:
                        splits.append(tuple(sum(getattr(c, f) for c in chunks)
                                            for f in ("seconds", "ring_wait_s", "exchange_s")))
                    log(f"length {length} round {r + 1}/{args.repeats} {key}: TTFT {times[key][-1] * 1000:.0f} ms")
            one, many = (statistics.median(times[k]) for k in engines)
            chunk_s, wait_s, exchange_s = (statistics.median(s[i] for s in splits) if splits else None
                                           for i in range(3))
            predicted = one / (one / args.cp + wait_s + exchange_s) if splits else None
            rows.append((length, fmt(one * 1000, ".0f"), fmt(many * 1000, ".0f"), ratio(one, many),
                         "yes" if splits else f"no (< {min_tokens})", fmt(None if chunk_s is None else chunk_s * 1000,
                                                                          ".0f"),
                         fmt(None if wait_s is None else wait_s * 1000, ".0f"),
                         fmt(None if exchange_s is None else exchange_s * 1000, ".0f"),
                         "-" if predicted is None else f"{predicted:.2f}x"))
            data.append({"length": length, "ttft_s": {k: times[k] for k in engines}, "ring": bool(splits),
                         "ring_chunk_s": chunk_s, "ring_wait_s": wait_s, "exchange_s": exchange_s,
                         "predicted_speedup_with_a_device_per_rank": predicted})
        report.line(f"model {args.model}, {ring.dtype} on {ring.device}; {torch.get_num_threads()} threads; one "
                    f"request at a time, 1 token; median of {args.repeats} interleaved rounds after a warm-up; "
                    f"CP={args.cp}: cp_min_tokens {min_tokens}")
        report.line()
        report.table(("prompt tokens", "CP=1 TTFT ms", f"CP={args.cp} TTFT ms", f"CP=1 / CP={args.cp}",
                      "ring chunk", "rank 0: chunk ms", "ring wait ms", "broadcast + gather ms",
                      f"design, {args.cp} devices: speed-up"), rows)
        report.line()
        report.line(f"design, {args.cp} devices: TTFT(CP=1) / (TTFT(CP=1) / {args.cp} + ring wait + broadcast and "
                    f"gather), the communication measured here.")
        report.data["rows"] = data

        def plot(plt):
            fig, ax = plt.subplots(figsize=(6, 4))
            for key in engines:
                ax.plot([d["length"] for d in data], [statistics.median(d["ttft_s"][key]) for d in data], "o-",
                        label=key.upper().replace("CP", "CP="))
            ax.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="TTFT (s)",
                   title=f"{args.model}: time to first token")
            ax.legend()
            return fig
        report.write(plot=plot)
    finally:
        for engine in engines.values():
            engine.close()


if __name__ == "__main__":
    main()
