"""Decode speed of this engine against HF transformers `generate`, measured in one run.

Same model, same prompts (the same token ids), same dtype, greedy, every request
generating exactly --max-tokens tokens (HF: min_new_tokens; engine: ignore_eos):

  - single stream: one request at a time, output tok/s (median of --repeats runs after a
    warm-up), HF against the engine;
  - N concurrent requests: the engine's output tok/s for all N together, against HF
    serving the same requests one after another (its single-stream rate);
  - the engine's median TTFT and TPOT over all requests of each row.

    .venv/bin/python scripts/bench_decode.py
    .venv/bin/python scripts/bench_decode.py --model /models/qwen2.5-coder-1.5b-instruct-q8_0.gguf --threads 16
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from runtime import LLM, SamplingParams  # noqa: E402
from runtime.models.loader import DTYPES, resolve_model  # noqa: E402

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
    args = p.parse_args(argv)
    args.concurrency = sorted({int(c) for c in args.concurrency.split(",")})
    if args.max_tokens < 2 or args.repeats < 1 or args.concurrency[0] < 1:
        p.error("--max-tokens must be >= 2, --repeats >= 1 and every concurrency >= 1")
    return args


def load_hf(spec: str, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    os.environ.setdefault("USE_HUB_KERNELS", "NO")  # transformers 5.25+: no hub kernels (a download)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    source = resolve_model(spec)
    if source.kind == "gguf":
        model = AutoModelForCausalLM.from_pretrained(str(source.path.parent), gguf_file=source.path.name,
                                                     torch_dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(source.path), torch_dtype=dtype)
    return model.to(device).eval()


def run_hf(model, prompt_ids: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """One greedy request of exactly max_tokens tokens -> (output tok/s, output ids)."""
    ids = torch.tensor([prompt_ids], device=model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
                             pad_token_id=_pad_id(model))
    tokens = out[0, ids.shape[1]:].tolist()  # .tolist() waits for the device
    elapsed = time.perf_counter() - start
    return len(tokens) / elapsed, tokens


def _pad_id(model) -> int:
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, (list, tuple)) else eos
    return 0 if eos is None else eos


def run_engine(llm: LLM, prompts: list[list[int]], max_tokens: int):
    """All prompts at once -> (output tok/s over all of them, results)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    results = llm.generate(prompts, params, use_tqdm=False)
    return llm.last_summary.output_tokens_per_s, results


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def median_ms(values) -> str:
    values = [v for v in values if v is not None]
    return f"{statistics.median(values) * 1000:.1f}" if values else "n/a"


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    max_conc = args.concurrency[-1]

    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, max_num_seqs=max(max_conc, 1),
              kv_cache_memory=args.kv_cache_memory, seed=0, cpu_weight_prepack=args.cpu_weight_prepack,
              quantization=args.quantization, enforce_eager=args.enforce_eager)
    t1 = time.perf_counter()
    hf = load_hf(args.model, dtype, args.device)
    t2 = time.perf_counter()
    print(f"loaded: engine {t1 - t0:.1f} s, HF transformers {t2 - t1:.1f} s", file=sys.stderr)
    prompt_ids = [llm.tokenizer(PROMPTS[i % len(PROMPTS)]).input_ids for i in range(max_conc)]
    warm = min(8, args.max_tokens)

    # single stream, HF and engine interleaved so that drifting machine load hits both alike
    run_hf(hf, prompt_ids[0], warm)
    run_engine(llm, prompt_ids[:1], warm)
    hf_rates, engine_rates, engine_results = [], [], []
    for r in range(args.repeats):
        rate, hf_tokens = run_hf(hf, prompt_ids[0], args.max_tokens)
        hf_rates.append(rate)
        rate, results = run_engine(llm, prompt_ids[:1], args.max_tokens)
        engine_rates.append(rate)
        engine_results += results
        print(f"single stream run {r + 1}/{args.repeats}: HF {hf_rates[-1]:.1f} tok/s, "
              f"engine {engine_rates[-1]:.1f} tok/s", file=sys.stderr)
    hf_single = statistics.median(hf_rates)
    rows = [(1, hf_single, statistics.median(engine_rates), engine_results)]
    same = common_prefix(hf_tokens, engine_results[-1].token_ids)

    for conc in args.concurrency:
        if conc == 1:
            continue
        run_engine(llm, prompt_ids[:conc], warm)
        rates, all_results = [], []
        for r in range(args.repeats):
            rate, results = run_engine(llm, prompt_ids[:conc], args.max_tokens)
            rates.append(rate)
            all_results += results
            print(f"{conc} concurrent run {r + 1}/{args.repeats}: engine {rate:.1f} tok/s", file=sys.stderr)
        rows.append((conc, hf_single, statistics.median(rates), all_results))

    print(f"\nmodel {args.model}  dtype {args.dtype}  device {llm.engine.device}  torch {torch.__version__}  "
          f"threads {torch.get_num_threads()}  engine weights prepacked: {args.cpu_weight_prepack}")
    print(f"{args.max_tokens} new tokens per request, greedy, EOS ignored; median of {args.repeats} runs "
          f"after a warm-up; {min(len(PROMPTS), max_conc)} distinct prompts of "
          f"{min(map(len, prompt_ids))}-{max(map(len, prompt_ids))} tokens\n")
    header = ("requests", "HF tok/s", "engine tok/s", "engine/HF", "engine TTFT ms", "engine TPOT ms")
    table = [header]
    for conc, hf_rate, engine_rate, results in rows:
        label = "1 (single stream)" if conc == 1 else f"{conc} concurrent"
        table.append((label, f"{hf_rate:.1f}", f"{engine_rate:.1f}", f"{engine_rate / hf_rate:.2f}x",
                      median_ms(r.metrics.ttft_s for r in results), median_ms(r.metrics.tpot_s for r in results)))
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for n, row in enumerate(table):
        print("| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
              + " |")
        if n == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    print("\nHF serves concurrent requests one after another, at its single-stream rate.")
    print(f"greedy agreement, single stream: the first {same} of {args.max_tokens} tokens are identical "
          f"(HF vs engine, {args.dtype})")


if __name__ == "__main__":
    main()
