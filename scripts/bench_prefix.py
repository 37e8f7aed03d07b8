"""Prefix caching: time to first token when requests share a long system prompt.

N chat requests share one system prompt of --system-tokens tokens (few-shot examples built
from the shipped prompt set) and each asks its own question (the held-out prompts). They
arrive one after another, as turns of different users do; the first one computes the
system prompt, the next ones find it cached. One run measures, interleaving request by
request so that machine noise hits all rows alike:

  - this engine with prefix caching on, and with it off (`--no-prefix-caching`);
  - HF transformers (a forward of the whole prompt and the first token: what any engine
    without prefix reuse pays).

For each: median TTFT and prompt tokens computed per request over requests 2..N (the
first is the same cold start for everyone), and the ratio to caching off.

The table goes to stdout and to benchmarks/results/<date>-bench_prefix.md (and .json).

    python -m scripts.bench_prefix                 # default model, bf16, 8 requests, ~1.2k-token system prompt
    python -m scripts.bench_prefix --requests 16 --system-tokens 3000
    python -m scripts.bench_prefix --requests 2 --system-tokens 200 --max-tokens 2 --enforce-eager   # smoke test
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from runtime import SamplingParams
from runtime.engine import LLMEngine
from runtime.models.loader import DEFAULT_MODEL
from scripts.harness import Report, add_results_args, load_hf, log, prompt_set


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--requests", type=int, default=8, help="requests sharing the system prompt (default: 8)")
    p.add_argument("--system-tokens", type=int, default=1200, help="least system prompt length (default: 1200)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request (default: 8)")
    p.add_argument("--no-hf", action="store_true", help="leave out the HF transformers row")
    p.add_argument("--enforce-eager", action="store_true", help="the engines' --enforce-eager")
    add_results_args(p, "bench_prefix")
    return p.parse_args(argv)


def system_prompt(engine: LLMEngine, min_tokens: int) -> str:
    """A long, realistic system prompt: instructions, then worked examples from the
    training prompts, until it has at least min_tokens tokens."""
    text = "You are a helpful assistant. Answer in the style of the examples below.\n\n"
    for i, prompt in enumerate(prompt_set("train")):
        question = prompt if isinstance(prompt, str) else prompt[-1]["content"]
        text += f"Example {i + 1}. Question: {question}\nAnswer: (a short, precise answer)\n\n"
        if len(engine.tokenize(text)) >= min_tokens:
            return text
    raise ValueError(f"the prompt set is too short for {min_tokens} tokens")


def questions(n: int) -> list[str]:
    prompts = prompt_set("heldout")
    return [(p if isinstance(p, str) else p[-1]["content"]) for p in (prompts * (1 + n // len(prompts)))[:n]]


def engine_ttft(engine: LLMEngine, messages: list[dict], max_tokens: int) -> tuple[float, int, int]:
    """(TTFT in s, prompt tokens computed, prompt tokens) of one request run alone."""
    computed = engine.stats.num_prompt_tokens_computed
    rid = engine.add_request(messages, SamplingParams(max_tokens=max_tokens, temperature=0))
    while engine.has_unfinished:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                metrics = out.metrics
    return metrics.ttft_s, engine.stats.num_prompt_tokens_computed - computed, metrics.num_prompt_tokens


def hf_ttft(model, ids: list[int]) -> float:
    """A forward of the whole prompt and the greedy first token."""
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(torch.tensor([ids]), max_new_tokens=1, do_sample=False)
    return time.perf_counter() - start


def main(argv=None) -> int:
    args = parse_args(argv)
    report = Report(args.name, "bench_prefix: TTFT with a shared system prompt, prefix caching on and off",
                    "scripts.bench_prefix", argv, args)
    cached = LLMEngine(model=args.model, dtype=args.dtype, device="cpu", seed=0, enforce_eager=args.enforce_eager)
    uncached = LLMEngine(model=args.model, dtype=args.dtype, device="cpu", seed=0, enable_prefix_caching=False,
                         enforce_eager=args.enforce_eager)
    hf = None if args.no_hf else load_hf(args.model, cached.dtype)
    system = system_prompt(cached, args.system_tokens)
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
             for q in questions(args.requests)]
    warm = [{"role": "user", "content": "Warm up: say hello."}]
    for engine in (cached, uncached):
        engine_ttft(engine, warm, 2)
    if hf is not None:
        hf_ttft(hf, cached.tokenize(warm))
    rows: dict[str, list[tuple[float, int]]] = {"caching on": [], "caching off": [], "HF transformers": []}
    num_prompt = []
    for i, chat in enumerate(chats):
        ttft_on, computed_on, n = engine_ttft(cached, chat, args.max_tokens)
        ttft_off, computed_off, _ = engine_ttft(uncached, chat, args.max_tokens)
        num_prompt.append(n)
        rows["caching on"].append((ttft_on, computed_on))
        rows["caching off"].append((ttft_off, computed_off))
        if hf is not None:
            rows["HF transformers"].append((hf_ttft(hf, cached.tokenize(chat)), n))
        log(f"request {i + 1}: {n} prompt tokens; TTFT on {ttft_on * 1000:.0f} ms ({computed_on} computed), "
            f"off {ttft_off * 1000:.0f} ms")

    later = slice(1, None) if args.requests > 1 else slice(None)  # the first request is the cold start in every row
    off = statistics.median(t for t, _ in rows["caching off"][later])
    first = 2 if args.requests > 1 else 1
    report.line(f"{args.model}, {cached.dtype}, CPU ({torch.get_num_threads()} threads); {args.requests} requests, "
                f"prompt {min(num_prompt)}-{max(num_prompt)} tokens (system prompt shared), {args.max_tokens} tokens "
                f"each; medians over requests {first}..{args.requests}")
    report.line()
    table = []
    for name, values in rows.items():
        if not values:
            continue
        ttft = statistics.median(t for t, _ in values[later])
        computed = statistics.median(c for _, c in values[later])
        table.append((name, f"{ttft * 1000:.1f}", f"{ttft / off:.2f}x", f"{computed:.0f}"))
        report.data.setdefault("rows", []).append({"system": name, "ttft_s": ttft, "prompt_tokens_computed": computed,
                                                   "per_request": [{"ttft_s": t, "computed": c} for t, c in values]})
    report.table(("system", "TTFT ms", "vs caching off", "prompt tokens computed"), table)
    hits = cached.stats.prefix_cache_hit_rate or 0.0
    report.data["prefix_cache_hit_rate"] = hits
    report.line()
    report.line(f"prefix cache hit rate (all requests, caching on): {hits:.2f}")
    report.write()
    for engine in (cached, uncached):
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
