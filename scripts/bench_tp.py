"""Tensor parallelism's cost: decode tok/s at TP=1 against TP=N in one run, and rank 0's
communication time per decode step.

Systems, each an LLMEngine built once: TP=1 eager with float weights (quantization none,
enforce_eager: the same eager code the ranks run), TP=1 with the defaults (quantization auto,
the compiled decode step on a CPU: what users run), TP=N with float weights, and TP=N with
the defaults (quantized weights where the file has them: on a CPU each rank keeps its shard
of the int4/int8 layers; eager is implied under TP). Every request has a prompt of 32 token ids (distinct per request), is greedy, ignores
EOS and generates --max-tokens tokens; decode tok/s = tokens generated after every request's
first token / wall time of those steps (the prefill step is not timed). Rounds interleave the
systems (scripts.harness.interleaved); the median round per system and batch size is shown,
with the ratios TP=N float / TP=1 eager and TP=N default / TP=1 default from the same run. The TP=N engine pins this process to rank 0's
share of the cores; the TP=1 rounds get the process's cores and threads back.

Communication, on rank 0, per decode step: dist.all_reduce / all_gather (the activations) and
dist.broadcast_object_list (the step message: pickling and sending it) are wrapped in the TP=N
rounds, their wall time (which includes waiting for the other ranks) summed against the step's
(the median round's); then one more TP=N round per batch size runs its first 8 decode steps
under torch.profiler (CPU activities; the wrappers are record_function ranges), which also gives
the self CPU time of the gloo / c10d events (their names are printed). On CUDA the activations go over NCCL,
asynchronously: the CPU-side times are launches.

On two cores TP=2 is not expected to be faster; the point is that the overhead is measured.

    python -m scripts.bench_tp
    python -m scripts.bench_tp --dtype bfloat16    # the quantized kernels (float32 dequantizes them)
    python -m scripts.bench_tp --max-tokens 8 --repeats 1 --batch-sizes 1   # smoke test
    python -m scripts.bench_tp --device cuda --tp 2 --dtype bfloat16      # a multi-GPU box
"""
from __future__ import annotations

import argparse
import pickle
import time
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from draft_cpu.placement import available_cores, move_other_threads
from runtime.engine import LLMEngine
from scripts.harness import ROOT, Report, System, add_results_args, fmt, greedy, interleaved, log, ratio

QWEN = "models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"  # 14 heads, 2 KV heads: TP=2 divides it
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based ink and a wooden screw press. Within fifty years presses were working in "
        "more than two hundred cities across Europe, and the number of books grew from thousands to millions.")
PROFILED_STEPS = 8
COLLECTIVES = ("all_reduce", "all_gather", "broadcast_object_list")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    qwen = (ROOT / QWEN).exists()
    p.add_argument("--model", default=QWEN if qwen else "smollm2-135m", help="default: %(default)s")
    p.add_argument("--tp", type=int, default=2 if qwen else 3, help="tensor parallel size (default: %(default)s; "
                   "smollm2-135m's 9 heads do not split in 2)")
    p.add_argument("--batch-sizes", default="1,16", help="concurrent requests per round (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per system (default: %(default)s)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu", help="passed to every engine (default: %(default)s)")
    p.add_argument("--kv-cache-memory", default="256MiB", help="per engine and rank (default: %(default)s)")
    add_results_args(p, "bench_tp")
    args = p.parse_args(argv)
    args.batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",")})
    if args.tp < 2 or args.max_tokens < 2 or args.repeats < 1 or args.batch_sizes[0] < 1:
        p.error("--tp must be >= 2, --max-tokens >= 2, --repeats >= 1 and every batch size >= 1")
    return args


def decode_round(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, profiled: int = 0,
                 on_decode=lambda: None):
    """All prompts at once -> (decode tokens, decode seconds, decode steps, profiled): the steps
    after every request has its first token; profiled: (profiler, steps, seconds) of the first
    `profiled` of them, or None. on_decode() is called as the decode phase starts."""
    params = greedy(max_tokens, ignore_eos=True)
    ids = {engine.add_request(p, params) for p in prompts}
    counts: dict[str, int] = {}
    while len(counts) < len(ids):  # prefill
        counts.update((o.request_id, len(o.token_ids)) for o in engine.step())
    first, steps, prof, done = sum(counts.values()), 0, None, None
    on_decode()
    start = time.perf_counter()
    while engine.has_unfinished:
        if steps == 0 and profiled:
            prof = profile(activities=[ProfilerActivity.CPU])
            prof.start()
        counts.update((o.request_id, len(o.token_ids)) for o in engine.step())
        steps += 1
        if prof is not None and done is None and (steps == profiled or not engine.has_unfinished):
            prof.stop()
            done = (prof, steps, time.perf_counter() - start)
    return sum(counts.values()) - first, time.perf_counter() - start, steps, done


@contextmanager
def ranged_collectives(seconds: dict[str, float], message_bytes: list[int] | None = None):
    """dist's collectives wrapped in record_function ranges named bench_tp.<name>; their wall
    time summed in seconds[name]; the step messages' pickled sizes in message_bytes."""
    saved = {name: getattr(dist, name) for name in COLLECTIVES}

    def wrap(name, fn):
        def ranged(*args, **kwargs):
            if name == "broadcast_object_list" and message_bytes is not None:
                message_bytes.append(len(pickle.dumps(args[0])))
            start = time.perf_counter()
            try:
                with record_function(f"bench_tp.{name}"):
                    return fn(*args, **kwargs)
            finally:
                seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start
        return ranged
    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def comm_split(prof, steps: int) -> tuple[dict, set[str]]:
    """ms per step: the activations' collectives, the step message, gloo/c10d self CPU; event names."""
    out = {"activations": 0.0, "message": 0.0, "gloo_self": 0.0}
    names = set()
    for e in prof.key_averages():
        if e.key.startswith("bench_tp."):
            out["message" if e.key.endswith("broadcast_object_list") else "activations"] += e.cpu_time_total
        elif "gloo" in e.key or "c10d" in e.key or "nccl" in e.key.lower():
            out["gloo_self"] += e.self_cpu_time_total
            names.add(e.key)
    return {k: v / 1000 / steps for k, v in out.items()}, names


def main(argv=None) -> None:
    args = parse_args(argv)
    n = args.tp
    report = Report(args.name, f"bench_tp: decode at TP=1 against TP={n}", "scripts.bench_tp", argv, args)
    common = dict(model=args.model, dtype=args.dtype, device=args.device, seed=0, max_num_seqs=args.batch_sizes[-1],
                  kv_cache_memory=args.kv_cache_memory)
    tp_key = f"tp{n}"
    systems = [System("tp1_default", "TP=1 default (quant auto, compiled)", engine={}),
               System("tp1_eager", "TP=1 eager, float", engine={"quantization": "none", "enforce_eager": True}),
               System(tp_key, f"TP={n} float", engine={"quantization": "none", "tensor_parallel_size": n}),
               System(f"{tp_key}_default", f"TP={n} default (quant auto)", engine={"tensor_parallel_size": n})]
    engines, cores = {}, {}
    try:
        for s in systems:  # TP=1 first: the TP engine pins this process to rank 0's cores
            t0 = time.perf_counter()
            engines[s.key] = LLMEngine(**common, **dict(s.engine))
            cores[s.key] = (available_cores(), torch.get_num_threads())
            log(f"built {s.label} in {time.perf_counter() - t0:.1f} s; cores {cores[s.key][0]}, "
                f"{cores[s.key][1]} threads")
        tp = engines[tp_key]

        def use(s: System):
            move_other_threads(cores[s.key][0], keep=set())
            torch.set_num_threads(cores[s.key][1])

        ids = tp.tokenize(TEXT * 4)
        prompts = [ids[i:i + 32] for i in range(args.batch_sizes[-1])]
        rows, comm, steps_of, names = [], [], {}, set()
        for b in args.batch_sizes:
            def run(s, m, b=b):
                use(s)
                wall: dict[str, float] = {}
                with ranged_collectives(wall) if s.key == tp_key else nullcontext():
                    tokens, seconds, steps, _ = decode_round(engines[s.key], prompts[:b], args.max_tokens,
                                                             on_decode=wall.clear)
                acts, msg = (sum(wall.get(c, 0.0) for c in group) * 1000 / steps
                             for group in (("all_reduce", "all_gather"), ("broadcast_object_list",)))
                steps_of.setdefault(s.key, []).append((seconds / steps * 1000, acts, msg))
                m.add_round(tokens, seconds)

            def warm(s, b=b):
                use(s)
                decode_round(engines[s.key], prompts[:b], min(8, args.max_tokens))
            steps_of.clear()
            measures = interleaved(systems, args.repeats, run, warm)
            rates = {k: m.rate for k, m in measures.items()}
            median_round = {k: sorted(v)[len(v) // 2] for k, v in steps_of.items()}  # by step ms
            step_ms = {k: v[0] for k, v in median_round.items()}
            rows.append((b, *(fmt(rates[s.key]) for s in systems), ratio(rates[tp_key], rates["tp1_eager"]),
                         ratio(rates[f"{tp_key}_default"], rates["tp1_default"]), fmt(step_ms["tp1_eager"]),
                         fmt(step_ms[tp_key])))
            report.data.setdefault("decode", []).append(
                {"batch": b, "tok_per_s": rates, "rounds_tok_per_s": {k: m.rates for k, m in measures.items()},
                 "step_ms": step_ms})

            use(systems[2])  # the profiled round: TP=N float
            sizes: list[int] = []
            with ranged_collectives({}, sizes):
                prof, k, prof_s = decode_round(tp, prompts[:b], args.max_tokens, PROFILED_STEPS)[3]
            step, acts, msg = median_round[tp_key]
            split, found = comm_split(prof, k)
            names |= found
            prof_step = prof_s * 1000 / k
            comm.append((b, fmt(step, ".1f"), fmt(acts, ".1f"), fmt(msg, ".2f"), f"{100 * (acts + msg) / step:.0f}%",
                         fmt(prof_step, ".1f"), fmt(split["activations"] + split["message"], ".1f"),
                         fmt(split["gloo_self"], ".2f"), max(sizes, default=0)))
            report.data.setdefault("communication", []).append(
                {"batch": b, "step_ms": step, "collectives_ms": acts, "message_ms": msg,
                 "rounds_step_collectives_message_ms": steps_of[tp_key],
                 "profiled_steps": k, "profiled_step_ms": prof_step, "profiled": split,
                 "message_bytes": max(sizes, default=0)})

        report.line(f"model {args.model}, {args.dtype} on {args.device}; TP=1: cores {cores['tp1_eager'][0]}, "
                    f"{cores['tp1_eager'][1]} threads; TP={n}: rank 0 on cores {cores[tp_key][0]}, "
                    f"{cores[tp_key][1]} threads; prompts of 32 tokens, {args.max_tokens} greedy tokens each (EOS "
                    f"ignored); decode phase only; median of {args.repeats} interleaved rounds")
        report.line()
        report.table(("batch", *(f"{s.label} tok/s" for s in systems), f"TP={n} float / TP=1 eager",
                      f"TP={n} default / TP=1 default",
                      "TP=1 eager step ms", f"TP={n} step ms"), rows)
        report.line()
        report.line(f"TP={n}, rank 0, per decode step: the median timed round (wall time of the dist calls, which "
                    f"includes waiting for the other ranks), then one more round with its first {PROFILED_STEPS} "
                    "decode steps profiled (profiler overhead included):")
        report.line()
        report.table(("batch", "step ms", "all-reduce + all-gather ms", "step message ms", "comm / step",
                      "profiled step ms", "profiled comm ms", "gloo/c10d self CPU ms", "message bytes"), comm)
        report.line()
        report.line(f"gloo/c10d profiler events: {', '.join(sorted(names)) or 'none'}")
        report.line(f"on a multi-GPU box: python -m scripts.bench_tp --device cuda --tp {n} --dtype bfloat16 "
                    f"--model {args.model} --batch-sizes {','.join(map(str, args.batch_sizes))} "
                    f"--max-tokens {args.max_tokens} --repeats {args.repeats}")
        report.write()
    finally:
        for engine in engines.values():
            engine.close()


if __name__ == "__main__":
    main()
