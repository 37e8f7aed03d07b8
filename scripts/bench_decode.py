"""Decode speed of this engine against HF transformers `generate`, measured in one run.

Same model, same prompts (the same token ids), same dtype, greedy, every request
generating exactly --max-tokens tokens (HF: min_new_tokens; engine: ignore_eos):

  - single stream: one request at a time, output tok/s (median of --repeats runs after a
    warm-up), HF against the engine;
  - N concurrent requests: the engine's output tok/s for all N together, against HF
    serving the same requests one after another (its single-stream rate);
  - the engine's median TTFT and TPOT over all requests of each row.

The table goes to stdout and to benchmarks/results/<date>-bench_decode.md (and .json).

    python -m scripts.bench_decode
    python -m scripts.bench_decode --model /models/qwen2.5-coder-1.5b-instruct-q8_0.gguf --threads 16
    python -m scripts.bench_decode --max-tokens 8 --repeats 1 --concurrency 1,2 --enforce-eager   # smoke test
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from runtime import LLM
from runtime.models.loader import DTYPES
from scripts.harness import (Report, add_results_args, common_prefix, fmt, hf_generate, load_hf, log, median,
                             ratio, run_engine)

PROMPTS = [
    "The history of the printing press begins",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash table works.",
    "def fibonacci(n):",
    "The three most important ideas in thermodynamics are",
    "List five tips for learning a new language:",
    "Once upon a time in a small village by the sea,",
    "What is the difference between a virus and a bacterium?",
    "Translate into French: The weather is nice today and we are going to the park.",
    "A recipe for a simple tomato soup:",
    "The main causes of the French Revolution were",
    "import numpy as np\n\ndef softmax(x):",
    "Describe the water cycle in simple terms.",
    "The best way to prepare for a job interview is",
    "Summarize the plot of Romeo and Juliet.",
    "In computer networks, TCP and UDP differ in that",
    "Here is a poem about autumn leaves:",
    "Why is the sky blue?",
    "The following is a list of prime numbers:",
    "SELECT name, COUNT(*) FROM orders",
    "Photosynthesis is the process by which",
    "Give me three ideas for a birthday party.",
    "The planet Mars has two moons,",
    "How do vaccines train the immune system?",
    "class Stack:\n    def __init__(self):",
    "The economic effects of inflation include",
    "Dear hiring manager, I am writing to apply for",
    "A brief introduction to the theory of relativity:",
    "The rules of chess state that a knight moves",
    "What are the benefits of regular exercise?",
    "In 1969, the Apollo 11 mission",
    "To bake bread at home, you first need",
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="alias, .gguf file or HF directory (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens generated per request (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per row; the median is shown (default: 3)")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated request counts (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N; both engines run there (default: cpu)")
    p.add_argument("--kv-cache-memory", default=None, help="engine KV cache size (default: the engine's)")
    p.add_argument("--no-cpu-weight-prepack", dest="cpu_weight_prepack", action="store_false",
                   help="a bf16 target on the CPU: leave the engine's linear weights row-major (as HF's are)")
    p.add_argument("--quantization", default="auto", help="the engine's --quantization (default: %(default)s); "
                   "HF transformers always runs the GGUF dequantized")
    p.add_argument("--enforce-eager", action="store_true", help="the engine's --enforce-eager")
    add_results_args(p, "bench_decode")
    args = p.parse_args(argv)
    args.concurrency = sorted({int(c) for c in args.concurrency.split(",")})
    if args.max_tokens < 2 or args.repeats < 1 or args.concurrency[0] < 1:
        p.error("--max-tokens must be >= 2, --repeats >= 1 and every concurrency >= 1")
    return args


def median_ms(values) -> str:
    value = median(values)
    return fmt(None if value is None else value * 1000)


def engine_rate(llm: LLM, prompts: list[list[int]], max_tokens: int):
    """All prompts at once, exactly max_tokens each -> (output tok/s over all of them, results)."""
    tokens, seconds, results = run_engine(llm, prompts, max_tokens, ignore_eos=True)
    return tokens / seconds, results


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    max_conc = args.concurrency[-1]
    report = Report(args.name, "bench_decode: this engine against HF transformers generate", "scripts.bench_decode",
                    argv, args)

    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, max_num_seqs=max(max_conc, 1),
              kv_cache_memory=args.kv_cache_memory, seed=0, cpu_weight_prepack=args.cpu_weight_prepack,
              quantization=args.quantization, enforce_eager=args.enforce_eager)
    t1 = time.perf_counter()
    hf = load_hf(args.model, dtype, args.device)
    t2 = time.perf_counter()
    log(f"loaded: engine {t1 - t0:.1f} s, HF transformers {t2 - t1:.1f} s")
    prompt_ids = [llm.tokenizer(PROMPTS[i % len(PROMPTS)]).input_ids for i in range(max_conc)]
    warm = min(8, args.max_tokens)

    # single stream, HF and engine interleaved so that drifting machine load hits both alike
    hf_generate(hf, prompt_ids[0], warm, exact=True)
    engine_rate(llm, prompt_ids[:1], warm)
    hf_rates, engine_rates, engine_results = [], [], []
    for r in range(args.repeats):
        n, seconds, hf_tokens = hf_generate(hf, prompt_ids[0], args.max_tokens, exact=True)
        hf_rates.append(n / seconds)
        rate, results = engine_rate(llm, prompt_ids[:1], args.max_tokens)
        engine_rates.append(rate)
        engine_results += results
        log(f"single stream run {r + 1}/{args.repeats}: HF {hf_rates[-1]:.1f} tok/s, "
            f"engine {engine_rates[-1]:.1f} tok/s")
    hf_single = statistics.median(hf_rates)
    rows = [(1, hf_single, statistics.median(engine_rates), engine_results, engine_rates)]
    same = common_prefix(hf_tokens, engine_results[-1].token_ids)

    for conc in args.concurrency:
        if conc == 1:
            continue
        engine_rate(llm, prompt_ids[:conc], warm)
        rates, all_results = [], []
        for r in range(args.repeats):
            rate, results = engine_rate(llm, prompt_ids[:conc], args.max_tokens)
            rates.append(rate)
            all_results += results
            log(f"{conc} concurrent run {r + 1}/{args.repeats}: engine {rate:.1f} tok/s")
        rows.append((conc, hf_single, statistics.median(rates), all_results, rates))

    report.line(f"model {args.model}  dtype {args.dtype}  device {llm.engine.device}  torch {torch.__version__}  "
                f"threads {torch.get_num_threads()}  engine weights prepacked: {args.cpu_weight_prepack}  "
                f"quantization {args.quantization}{'  enforce_eager' if args.enforce_eager else ''}")
    report.line(f"{args.max_tokens} new tokens per request, greedy, EOS ignored; median of {args.repeats} runs "
                f"after a warm-up; {min(len(PROMPTS), max_conc)} distinct prompts of "
                f"{min(map(len, prompt_ids))}-{max(map(len, prompt_ids))} tokens")
    report.line()
    table = []
    for conc, hf_rate, rate, results, rates in rows:
        label = "1 (single stream)" if conc == 1 else f"{conc} concurrent"
        ttft, tpot = median(r.metrics.ttft_s for r in results), median(r.metrics.tpot_s for r in results)
        table.append((label, f"{hf_rate:.1f}", f"{rate:.1f}", ratio(rate, hf_rate),
                      median_ms(r.metrics.ttft_s for r in results), median_ms(r.metrics.tpot_s for r in results)))
        report.data.setdefault("rows", []).append(
            {"requests": conc, "hf_tok_per_s": hf_rate, "engine_tok_per_s": rate, "engine_rounds_tok_per_s": rates,
             "engine_ttft_s": ttft, "engine_tpot_s": tpot})
    report.table(("requests", "HF tok/s", "engine tok/s", "engine/HF", "engine TTFT ms", "engine TPOT ms"), table)
    report.data.update(hf_rounds_tok_per_s=hf_rates, same_prefix_tokens=same)
    report.line()
    report.line("HF serves concurrent requests one after another, at its single-stream rate.")
    report.line(f"greedy agreement, single stream: the first {same} of {args.max_tokens} tokens are identical "
                f"(HF vs engine, {args.dtype})")
    report.write()


if __name__ == "__main__":
    main()
