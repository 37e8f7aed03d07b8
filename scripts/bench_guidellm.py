"""The server under load from the vLLM project's guidellm (a load generator nobody here wrote),
against /v1/chat/completions, streamed, with synthetic prompts of the served model's tokenizer.

For each --speculators setting a server starts with the default settings and that
`--speculator`; guidellm then runs its "concurrent" profile at each of --streams (requests
in flight), --requests requests each, and its JSON report is read back. Rows: successful
and failed requests, output tok/s, median TTFT and TPOT, and output tok/s against the
first setting at the same streams. guidellm needs transformers 5 and a newer
huggingface_hub than this project pins, so it runs from a venv of its own (--guidellm):

    python -m venv ~/.venvs/guidellm && ~/.venvs/guidellm/bin/pip install guidellm
    python -m scripts.bench_guidellm --guidellm ~/.venvs/guidellm/bin/guidellm
    python -m scripts.bench_guidellm --guidellm ~/.venvs/guidellm/bin/guidellm --speculators none --streams 1 \\
        --requests 2 --output-tokens 8   # smoke test
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

import httpx

from scripts.harness import ROOT, Report, add_results_args, log, ratio


def start_server(model: str, port: int, speculator: str) -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-m", "runtime.serve", "--model", model, "--port", str(port),
                               "--speculator", speculator], cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited: {server.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(1)
    server.kill()
    raise RuntimeError("the server did not become healthy within 600 s")


def run_guidellm(args, port: int, tokenizer_dir: str, report_path: Path) -> None:
    command = [args.guidellm, "run", "--backend", f"kind=openai_http,target=http://127.0.0.1:{port},model={args.model}",
               "--profile", "kind=concurrent", "--override", "profile.streams", args.streams,
               "--constraint", f"kind=max_requests,count={args.requests}",
               "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
               "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
               "--output", f"kind=json,path={report_path}", "--disable-progress"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0 or not report_path.exists():
        raise RuntimeError(f"guidellm failed ({done.returncode}): {(done.stderr or done.stdout)[-2000:]}")


def rows_of(report_path: Path) -> list[dict]:
    """One row per guidellm benchmark (streams level) of its JSON report."""
    rows = []
    for bench in json.loads(report_path.read_text())["benchmarks"]:
        metrics = bench["metrics"]
        totals = metrics["request_totals"]
        rows.append({"streams": bench["config"]["strategy"].get("streams", bench["config"]["strategy"].get(
                         "max_concurrency")),
                     "successful": totals["successful"], "failed": totals["errored"] + totals["incomplete"],
                     "output_tok_s": metrics["output_tokens_per_second"]["successful"]["mean"],
                     "ttft_ms": metrics["time_to_first_token_ms"]["successful"]["median"],
                     "tpot_ms": metrics["time_per_output_token_ms"]["successful"]["median"]})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--guidellm", default="guidellm", help="the guidellm executable (default: %(default)s)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--speculators", default="none,lookahead", help="default: %(default)s")
    p.add_argument("--streams", default="1,4", help="requests in flight, comma-separated (default: %(default)s)")
    p.add_argument("--requests", type=int, default=16, help="per streams level (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="default: %(default)s")
    p.add_argument("--output-tokens", type=int, default=64, help="default: %(default)s")
    p.add_argument("--port", type=int, default=8093)
    add_results_args(p, "bench_guidellm")
    args = p.parse_args(argv)
    report = Report(args.name, "The server under guidellm's load", "scripts.bench_guidellm", argv, args)
    from runtime.models.loader import load_tokenizer, resolve_model
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = str(Path(tmp) / "tokenizer")
        load_tokenizer(resolve_model(args.model)).save_pretrained(tokenizer_dir)
        for speculator in args.speculators.split(","):
            log(f"bench_guidellm: server with --speculator {speculator}")
            server = start_server(args.model, args.port, speculator)
            try:
                report_path = Path(tmp) / f"{speculator}.json"
                run_guidellm(args, args.port, tokenizer_dir, report_path)
                results[speculator] = rows_of(report_path)
            finally:
                server.terminate()
                server.wait(timeout=60)
    first = results[args.speculators.split(",")[0]]
    table = []
    for speculator, rows in results.items():
        for row, base in zip(rows, first):
            table.append([speculator, row["streams"], row["successful"], row["failed"], f"{row['output_tok_s']:.1f}",
                          f"{row['ttft_ms']:.0f}", f"{row['tpot_ms']:.1f}", ratio(row["output_tok_s"],
                                                                                  base["output_tok_s"])])
    report.line(f"{args.model}, default settings, guidellm concurrent profile, {args.requests} requests a level, "
                f"synthetic prompts of {args.prompt_tokens} tokens, {args.output_tokens} output tokens, streamed "
                f"/v1/chat/completions")
    report.line()
    report.table(["speculator", "streams", "ok", "failed", "output tok/s", "TTFT ms p50", "TPOT ms p50",
                  f"vs {args.speculators.split(',')[0]}"], table)
    report.data = results
    report.write()
    return 0 if all(row["failed"] == 0 for rows in results.values() for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
