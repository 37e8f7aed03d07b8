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

    .venv/bin/python scripts/bench_prefix.py                 # default model, bf16, 8 requests, ~1.2k-token system prompt
    .venv/bin/python scripts/bench_prefix.py --requests 16 --system-tokens 3000
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

from runtime import SamplingParams  # noqa: E402
from runtime.engine import LLMEngine  # noqa: E402
from runtime.models.loader import DEFAULT_MODEL  # noqa: E402
from speculators.training import default_prompt_file, load_prompts  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--requests", type=int, default=8, help="requests sharing the system prompt (default: 8)")
    p.add_argument("--system-tokens", type=int, default=1200, help="least system prompt length (default: 1200)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request (default: 8)")
    p.add_argument("--no-hf", action="store_true", help="leave out the HF transformers row")
    return p.parse_args(argv)


def system_prompt(engine: LLMEngine, min_tokens: int) -> str:
    """A long, realistic system prompt: instructions, then worked examples from the
    training prompts, until it has at least min_tokens tokens."""
    text = "You are a helpful assistant. Answer in the style of the examples below.\n\n"
    for i, prompt in enumerate(load_prompts(default_prompt_file("train"))):
        question = prompt if isinstance(prompt, str) else prompt[-1]["content"]
        text += f"Example {i + 1}. Question: {question}\nAnswer: (a short, precise answer)\n\n"
        if len(engine.tokenize(text)) >= min_tokens:
            return text
    raise ValueError(f"the prompt set is too short for {min_tokens} tokens")


def questions(n: int) -> list[str]:
    prompts = load_prompts(default_prompt_file("heldout"))
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


def load_hf(engine: LLMEngine):
    from transformers import AutoModelForCausalLM
    from runtime.models.loader import resolve_model
    os.environ.setdefault("USE_HUB_KERNELS", "NO")  # transformers 5.25+: no hub kernels (a download)
    path = resolve_model(engine.config.model).path
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    directory = path.parent if path.suffix == ".gguf" else path
    return AutoModelForCausalLM.from_pretrained(str(directory), torch_dtype=engine.dtype, **kwargs).eval()


def main(argv=None) -> int:
    args = parse_args(argv)
    cached = LLMEngine(model=args.model, dtype=args.dtype, device="cpu", seed=0)
    uncached = LLMEngine(model=args.model, dtype=args.dtype, device="cpu", seed=0, enable_prefix_caching=False)
    hf = None if args.no_hf else load_hf(cached)
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
        print(f"request {i + 1}: {n} prompt tokens; TTFT on {ttft_on * 1000:.0f} ms ({computed_on} computed), "
              f"off {ttft_off * 1000:.0f} ms", file=sys.stderr)

    later = slice(1, None)  # the first request is the cold start in every row
    off = statistics.median(t for t, _ in rows["caching off"][later])
    print(f"\n{args.model}, {cached.dtype}, CPU ({torch.get_num_threads()} threads); {args.requests} requests, "
          f"prompt {min(num_prompt)}-{max(num_prompt)} tokens (system prompt shared), {args.max_tokens} tokens each; "
          f"medians over requests 2..{args.requests}\n")
    print(f"| {'system':<16} | {'TTFT ms':>8} | {'vs caching off':>14} | {'prompt tokens computed':>22} |")
    print(f"|{'-' * 18}|{'-' * 10}|{'-' * 16}|{'-' * 24}|")
    for name, values in rows.items():
        if not values:
            continue
        ttft = statistics.median(t for t, _ in values[later])
        computed = statistics.median(c for _, c in values[later])
        print(f"| {name:<16} | {ttft * 1000:>8.1f} | {ttft / off:>13.2f}x | {computed:>22.0f} |")
    hits = cached.stats.prefix_cache_hit_rate or 0.0
    print(f"\nprefix cache hit rate (all requests, caching on): {hits:.2f}")
    for engine in (cached, uncached):
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
