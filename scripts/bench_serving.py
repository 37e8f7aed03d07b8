"""Serving benchmark against a running `python -m runtime.serve`, in the manner of vLLM's benchmark_serving.

For each --speculation setting and each request rate, --num-requests streaming requests
arrive as a Poisson process (exponential gaps, seeded by --seed, the same for every
setting; `inf` sends them all at once). Measured per request, on the client: TTFT (send to
the first non-empty text chunk), TPOT ((e2e - TTFT) / (completion tokens - 1), the tokens
from the usage chunk) and e2e latency. One markdown table goes to stdout (progress to
stderr) and to benchmarks/results/<date>-bench_serving.md (and .json), and a plot of TTFT
and TPOT against the request rate to the .png beside them (or --plot).

Prompts: a JSONL file, one {"prompt": str} (sent to /v1/completions) or {"messages": [...]}
(sent to /v1/chat/completions) a line; default: the package's held-out prompts. Every run
sends the same prompts, so a server with prefix caching, or the lookahead speculator, has
seen them before in every run after the first.

--speculation none,lookahead adds "speculation": {"method": ...} to each request body;
`default` sends no such field. A server that answers 400 to the field is benchmarked
without it, and the row says so.

    python -m runtime.serve --port 8000 &
    python -m scripts.bench_serving
    python -m scripts.bench_serving --request-rates 1,4,inf --num-requests 64 --speculation none,lookahead \\
        --save-json bench_serving.json
    python -m scripts.bench_serving --request-rates inf --num-requests 2 --max-tokens 4 --warmup 0   # smoke test
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np

from scripts.harness import Report, add_results_args, load_prompt_file, prompt_file, save_plot

PERCENTILES = (50, 90, 99)
METRICS = (("ttft", "ms", 1000.0), ("tpot", "ms", 1000.0), ("e2e", "s", 1.0))  # name, unit, seconds -> unit


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    p.add_argument("--model", default="smollm2-135m", help="the served model name (default: %(default)s)")
    p.add_argument("--prompts", default=str(prompt_file("heldout")),
                   help="JSONL prompt file (default: the package's held-out prompts)")
    p.add_argument("--request-rates", default="1,2,4,inf",
                   help="comma-separated requests/s, inf = all at once (default: %(default)s)")
    p.add_argument("--num-requests", type=int, default=16, help="requests per rate (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="max tokens per request (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="default: %(default)s")
    p.add_argument("--seed", type=int, default=0, help="seeds the arrival times (default: %(default)s)")
    p.add_argument("--speculation", default="default",
                   help="comma-separated speculation methods sent per request, e.g. none,lookahead; "
                        "default = no field (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="uncounted requests per speculation setting (default: 2)")
    p.add_argument("--plot", default=None, help="PNG file; empty for none (default: the .png beside the results "
                                                "files)")
    p.add_argument("--save-json", default=None, help="also write the per-request records and the summary here")
    add_results_args(p, "bench_serving")
    args = p.parse_args(argv)
    try:
        args.request_rates = [float(rate) for rate in args.request_rates.split(",")]
    except ValueError:
        p.error(f"--request-rates: numbers or inf, got {args.request_rates!r}")
    args.speculation = args.speculation.split(",")
    args.base_url = args.base_url.rstrip("/")
    if min(args.request_rates) <= 0 or args.num_requests < 1 or args.max_tokens < 1 or args.warmup < 0:
        p.error("every request rate must be > 0, --num-requests and --max-tokens >= 1, --warmup >= 0")
    return args


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def rate_label(rate: float) -> str:
    return f"{rate:g}"  # 'inf' for math.inf


# ---- one request ------------------------------------------------------------------------------

@dataclass
class Result:
    ok: bool = False
    status: int | None = None  # HTTP status; None when no response came
    error: str | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    completion_tokens: int | None = None


def request(args: argparse.Namespace, prompt, method: str | None) -> tuple[str, dict]:
    """(endpoint, streaming body) for one prompt: chat for a list of messages, else a completion."""
    is_chat = not isinstance(prompt, str) and isinstance(prompt[0], dict)
    endpoint, key = ("/v1/chat/completions", "messages") if is_chat else ("/v1/completions", "prompt")
    body = {"model": args.model, key: prompt, "max_tokens": args.max_tokens, "temperature": args.temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if method is not None:
        body["speculation"] = {"method": method}
    return endpoint, body


def error_message(content: bytes) -> str:
    """The message of an OpenAI error body, else the start of the body."""
    try:
        return str(json.loads(content)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return content.decode(errors="replace")[:200]


def chunk_text(event: dict) -> str:
    choice = (event.get("choices") or [{}])[0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def send_request(client: httpx.AsyncClient, endpoint: str, body: dict) -> Result:
    result = Result()
    start = time.perf_counter()
    try:
        async with client.stream("POST", endpoint, json=body) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.error = error_message(await response.aread())
            else:
                await read_stream(response, result, start)
    except Exception as e:  # a failed request, not a failed benchmark
        result.error = f"{type(e).__name__}: {e}"
    return result


async def read_stream(response: httpx.Response, result: Result, start: float) -> None:
    """Fill result from the SSE chunks, up to `data: [DONE]`."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            finish(result, time.perf_counter() - start)
            return
        event = json.loads(data)
        if event.get("error"):
            result.error = f"error event: {error_message(data.encode())}"
            return
        if result.ttft_s is None and chunk_text(event):
            result.ttft_s = time.perf_counter() - start
        if event.get("usage"):
            result.completion_tokens = event["usage"]["completion_tokens"]
    result.error = "the stream ended before data: [DONE]"


def finish(result: Result, e2e_s: float) -> None:
    result.ok, result.e2e_s = True, e2e_s
    tokens = result.completion_tokens
    if result.ttft_s is not None and tokens and tokens > 1:
        result.tpot_s = (e2e_s - result.ttft_s) / (tokens - 1)


# ---- the server -------------------------------------------------------------------------------

async def check_health(client: httpx.AsyncClient, base_url: str) -> None:
    try:
        response = await client.get("/health", timeout=10.0)
    except httpx.HTTPError as e:
        fail(f"no server at {base_url} ({type(e).__name__}: {e}); start one with `python -m runtime.serve`")
    if response.status_code != 200:
        fail(f"{base_url}/health answered {response.status_code}: {error_message(response.content)}")


async def probe(client: httpx.AsyncClient, args: argparse.Namespace, prompt, method: str | None) -> tuple[int, str]:
    """(HTTP status, error message) of one non-streaming one-token request; status 0: no answer."""
    endpoint, body = request(args, prompt, method)
    body.update(stream=False, max_tokens=1)
    del body["stream_options"]
    try:
        response = await client.post(endpoint, json=body)
    except httpx.HTTPError as e:
        return 0, f"{type(e).__name__}: {e}"
    return response.status_code, error_message(response.content)


async def speculation_method(client: httpx.AsyncClient, args: argparse.Namespace, prompt,
                             value: str) -> tuple[str, str | None]:
    """(row label, method to send) for one --speculation value; the method is None for
    `default`, and when the server refuses the field (400) but takes the request without it."""
    method = None if value == "default" else value
    status, message = await probe(client, args, prompt, method)
    if status == 200:
        return value, method
    if method is not None and status == 400 and (await probe(client, args, prompt, None))[0] == 200:
        print(f"note: the server refuses \"speculation\": {{\"method\": \"{value}\"}} ({message}); "
              f"running {value!r} without the field", file=sys.stderr)
        return f"{value} (refused: no field)", None
    fail(f"the server answered {status} to a one-token request (speculation {value}): {message}")


# ---- one run: a speculation setting at one rate -----------------------------------------------

async def run(client: httpx.AsyncClient, args: argparse.Namespace, prompts: list, method: str | None,
              rate: float) -> tuple[list[Result], float]:
    """--num-requests requests arriving at `rate` per second -> (results, duration s)."""
    arrivals = np.cumsum(np.random.default_rng(args.seed).exponential(1 / rate, args.num_requests))
    arrivals -= arrivals[0]  # the first request goes at once; 1 / inf = 0: all go at once

    async def send_at(delay: float, prompt) -> Result:
        await asyncio.sleep(delay)
        return await send_request(client, *request(args, prompt, method))

    start = time.perf_counter()
    results = await asyncio.gather(*(send_at(t, prompts[i % len(prompts)]) for i, t in enumerate(arrivals)))
    return results, time.perf_counter() - start


def summarize(label: str, rate: float, results: list[Result], duration: float) -> dict:
    done = [r for r in results if r.ok]
    tokens = sum(r.completion_tokens or 0 for r in done)
    row = {"speculation": label, "rate": rate, "completed": len(done), "failed": len(results) - len(done),
           "duration_s": duration, "output_tok_per_s": tokens / duration, "req_per_s": len(done) / duration}
    for name, unit, scale in METRICS:
        values = [getattr(r, f"{name}_s") * scale for r in done if getattr(r, f"{name}_s") is not None]
        for p in PERCENTILES:
            row[f"{name}_{unit}_p{p}"] = float(np.percentile(values, p)) if values else None
    return row


def report_run(row: dict, results: list[Result]) -> None:
    failures = Counter(r.status for r in results if not r.ok)
    errors = ", ".join(f"HTTP {status or 'none'} x{n}" for status, n in failures.items())
    first_error = next((r.error for r in results if not r.ok), None)
    print(f"  rate {rate_label(row['rate'])}: {row['completed']} completed, {row['failed']} failed"
          + (f" ({errors}; first: {first_error})" if failures else "")
          + f", {row['duration_s']:.1f} s, {row['output_tok_per_s']:.1f} output tok/s", file=sys.stderr)


async def benchmark(args: argparse.Namespace, prompts: list) -> tuple[list[dict], list[dict]]:
    """-> (summary rows, per-request records)."""
    client = httpx.AsyncClient(base_url=args.base_url, trust_env=False, timeout=httpx.Timeout(600.0, connect=10.0),
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
    rows, records = [], []
    async with client:
        await check_health(client, args.base_url)
        for value in args.speculation:
            label, method = await speculation_method(client, args, prompts[0], value)
            print(f"speculation {label}: {args.warmup} warm-up requests", file=sys.stderr)
            await asyncio.gather(*(send_request(client, *request(args, prompts[i % len(prompts)], method))
                                   for i in range(args.warmup)))
            for rate in args.request_rates:
                results, duration = await run(client, args, prompts, method, rate)
                rows.append(summarize(label, rate, results, duration))
                report_run(rows[-1], results)
                records += [{"speculation": label, "rate": rate_label(rate), **asdict(r)} for r in results]
    return rows, records


# ---- output -----------------------------------------------------------------------------------

def table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    header = ["speculation", "rate", "completed", "failed", "duration s", "output tok/s", "req/s"]
    header += [f"{name.upper() if name != 'e2e' else name} p{p} {unit}" for name, unit, _ in METRICS
               for p in PERCENTILES]
    table = []
    for row in rows:
        cells = [row["speculation"], rate_label(row["rate"]), str(row["completed"]), str(row["failed"]),
                 f"{row['duration_s']:.1f}", f"{row['output_tok_per_s']:.1f}", f"{row['req_per_s']:.2f}"]
        for name, unit, _ in METRICS:
            for p in PERCENTILES:
                value = row[f"{name}_{unit}_p{p}"]
                cells.append("n/a" if value is None else f"{value:.1f}" if unit == "ms" else f"{value:.2f}")
        table.append(cells)
    return header, table


def draw(rows: list[dict]):
    """TTFT and TPOT p50 (solid) and p90 (dashed) against the rate, a colour per speculation
    setting: draw(rows)(plt) -> the figure."""
    def figure(plt):
        rates = sorted({row["rate"] for row in rows})
        finite = [rate for rate in rates if math.isfinite(rate)]
        inf_x = max(finite) * 1.5 if finite else 1.0  # `inf` drawn after the largest finite rate

        def x(rate: float) -> float:
            return rate if math.isfinite(rate) else inf_x

        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for ax, name in zip(axes, ("ttft", "tpot")):
            for colour, label in enumerate(dict.fromkeys(row["speculation"] for row in rows)):
                mine = sorted((row for row in rows if row["speculation"] == label), key=lambda row: row["rate"])
                for p, style in ((50, "-"), (90, "--")):
                    values = [row[f"{name}_ms_p{p}"] for row in mine]
                    ax.plot([x(row["rate"]) for row in mine], [math.nan if v is None else v for v in values],
                            style, marker="o", color=f"C{colour}", label=f"{label} p{p}")
            ax.set_xticks([x(rate) for rate in rates], [rate_label(rate) for rate in rates])
            ax.set(title=f"{name.upper()} vs request rate", xlabel="request rate (req/s)",
                   ylabel=f"{name.upper()} ms")
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        return fig
    return figure


def save_json(path: str, args: argparse.Namespace, rows: list[dict], records: list[dict]) -> None:
    config = {**vars(args), "request_rates": [rate_label(rate) for rate in args.request_rates]}
    summary = [{**row, "rate": rate_label(row["rate"])} for row in rows]  # strict JSON has no Infinity
    Path(path).write_text(json.dumps({"config": config, "summary": summary, "requests": records}, indent=1))
    print(f"records: {path}", file=sys.stderr)


def main(argv=None) -> None:
    args = parse_args(argv)
    prompts = load_prompt_file(args.prompts)
    if not prompts:
        fail(f"no prompts in {args.prompts}")
    report = Report(args.name, "bench_serving: a running server under Poisson load", "scripts.bench_serving",
                    argv, args)
    rows, records = asyncio.run(benchmark(args, prompts))
    report.line(f"{args.base_url}  model {args.model}  {args.num_requests} requests per rate, max_tokens "
                f"{args.max_tokens}, temperature {args.temperature:g}, {len(prompts)} prompts from {args.prompts}")
    report.line()
    report.table(*table(rows), align="ll" + "r" * (len(table(rows)[0]) - 2))
    report.data["summary"] = [{**row, "rate": rate_label(row["rate"])} for row in rows]
    plot = draw(rows)
    if args.plot:
        if save_plot(Path(args.plot), plot):
            print(f"plot: {args.plot}", file=sys.stderr)
    report.write(plot=plot if args.plot is None else None)
    if args.save_json:
        save_json(args.save_json, args, rows, records)


if __name__ == "__main__":
    main()
