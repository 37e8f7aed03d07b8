"""Perplexity of a model over a fixed English text with this runtime, computed the way
llama.cpp's `llama-perplexity` computes it, and llama.cpp's own number on the same GGUF file.

    python -m scripts.perplexity
    python -m scripts.perplexity --max-chunks 8 --threads 1
    python -m scripts.perplexity --model /models/qwen2.5-0.5b-instruct-q8_0.gguf --quantizations auto,none
    python -m scripts.perplexity --max-chunks 2 --ctx 128 --quantizations auto   # smoke test

What is measured (llama.cpp's tools/perplexity/perplexity.cpp, `perplexity()`, default
path without --ppl-stride):
  - the whole text (less one trailing newline, which llama.cpp's -f drops) is tokenized
    once, with BOS in front where the model's vocabulary adds one (a GGUF file: its
    `tokenizer.ggml.add_bos_token`, which llama.cpp reads; an HF directory: whether its
    tokenizer puts BOS first by default);
  - the tokens are cut into non-overlapping chunks of --ctx tokens (the tail is dropped;
    at least 2 chunks' worth of tokens are needed, as llama.cpp demands), each chunk run
    alone from position 0 with a causal mask; where BOS is added, each chunk's FIRST TOKEN
    IS REPLACED by BOS (not shifted: chunk i is tokens[i*ctx:(i+1)*ctx] with [0] = BOS);
  - in each chunk only the logits at positions ctx/2 .. ctx-2 are scored, against the
    tokens at ctx/2+1 .. ctx-1: ctx - 1 - ctx/2 tokens a chunk (255 of 512);
  - PPL = exp(mean NLL over all scored tokens), +/- exp-scaled standard error of the mean
    NLL, as llama.cpp prints it ("Final estimate: PPL = X +/- E").
Our rows run DecoderModel from runtime.models.loader.load_model (each --quantizations
entry: auto|none|int8|int4, in --dtype) with a plain SDPA causal attention; llama.cpp's
row runs `llama-perplexity -m FILE -f TEXT -c CTX -b CTX -t THREADS [--chunks N]` (only
for .gguf models; an alias resolves to its GGUF file). The table goes to stdout and to
benchmarks/results/<date>-perplexity.md (and .json; --name, --output).

The text (scripts/data/perplexity_text.txt): chapters I-III of "Alice's Adventures in
Wonderland" by Lewis Carroll (1865), Project Gutenberg's "Millennium Fulcrum Edition 2.9"
(etext #11, public domain), as alice29.txt of the Canterbury corpus shipped in PyPI's
Brotli 1.1.0 sdist (Brotli-1.1.0/tests/testdata/alice29.txt): its lines 14-732 verbatim,
CRLF turned into LF, trailing blank lines dropped (33 KB, about 8,600 SmolLM2 tokens).
"""
from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from runtime.models.loader import DEFAULT_MODEL, DTYPES, QUANTIZATIONS, adds_bos, load_model, resolve_model
from runtime.models.quant_linear import linear_kernels
from scripts.harness import ROOT, Report, add_results_args

TEXT = ROOT / "scripts" / "data" / "perplexity_text.txt"
DEFAULT_LLAMA_BIN = Path.home() / ".cache" / "heterospec" / "llama.cpp" / "build" / "bin"


# ---- tokens and chunks --------------------------------------------------------------------

def tokenize(text: str, tokenizer, add_bos: bool) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return ([tokenizer.bos_token_id] if add_bos else []) + ids


def make_attention(sliding_window: int | None):
    """attention_fn(layer, q [T,Hq,D], k [T,Hkv,D], v [T,Hkv,D]) -> [T,Hq,D]: causal SDPA over
    the chunk, k/v heads repeated for GQA (and the model's sliding window, if shorter)."""
    masks: dict[int, torch.Tensor] = {}

    def attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t, hq, _ = q.shape
        groups = hq // k.shape[1]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        q, k, v = (x.transpose(0, 1) for x in (q, k, v))  # [H, T, D]
        if sliding_window is not None and sliding_window < t:
            if t not in masks:
                i = torch.arange(t, device=q.device)
                masks[t] = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < sliding_window)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=masks[t])
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(0, 1)

    return attention


@torch.inference_mode()
def perplexity(model, tokens: list[int], ctx: int, bos: int | None, max_chunks: int | None, device
               ) -> tuple[float, float, int, int]:
    """(PPL, its +/- error, chunks, tokens scored), llama.cpp's way (module docstring)."""
    n_chunks = len(tokens) // ctx
    if max_chunks is not None:
        n_chunks = min(n_chunks, max_chunks)
    first = ctx // 2
    attention = make_attention(model.config.sliding_window)
    positions = torch.arange(ctx, device=device)
    nll = nll2 = 0.0
    count = 0
    for c in range(n_chunks):
        chunk = torch.tensor(tokens[c * ctx:(c + 1) * ctx], device=device)
        if bos is not None:
            chunk[0] = bos
        hidden = model(chunk, positions, attention)
        logits = model.compute_logits(hidden[first:ctx - 1])  # float32 [ctx-1-first, V]
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, chunk[first + 1:, None]).squeeze(1).double()
        nll -= logprobs.sum().item()
        nll2 += (logprobs * logprobs).sum().item()
        count += ctx - 1 - first
        print(f"  [{c + 1}/{n_chunks}] PPL so far {math.exp(nll / count):.4f}", file=sys.stderr, flush=True)
    mean = nll / count
    var = nll2 / count - mean * mean
    err = math.sqrt(var / (count - 1)) * math.exp(mean) if var > 0 and count > 1 else float("nan")
    return math.exp(mean), err, n_chunks, count


# ---- llama.cpp ------------------------------------------------------------------------------

def llama_perplexity(binary: Path, gguf: Path, ctx: int, threads: int, max_chunks: int | None
                     ) -> dict | None:
    cmd = [str(binary), "-m", str(gguf), "-f", str(TEXT), "-c", str(ctx), "-b", str(ctx), "-t", str(threads)]
    if max_chunks is not None:
        cmd += ["--chunks", str(max_chunks)]
    print(f"llama.cpp: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    log = run.stdout + run.stderr
    found = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log)
    if run.returncode != 0 or not found:
        print(f"llama-perplexity failed (exit {run.returncode}):\n{log[-2000:]}", file=sys.stderr)
        return None
    chunks = re.search(r"calculating perplexity over (\d+) chunks", log)
    return {"ppl": float(found.group(1)), "err": float(found.group(2)), "seconds": seconds,
            "chunks": int(chunks.group(1)) if chunks else None}


def find_llama_bin(path: str | None) -> Path | None:
    p = Path(path).expanduser() if path else DEFAULT_LLAMA_BIN
    if p.is_dir():
        p = p / "llama-perplexity"
    return p if p.is_file() and os.access(p, os.X_OK) else None


# ---- report -----------------------------------------------------------------------------------

def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", help=f"alias, .gguf file or HF directory (repeatable; default {DEFAULT_MODEL})")
    p.add_argument("--quantizations", default="none,int8,int4,auto", help="comma-separated, of auto|none|int8|int4")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--ctx", type=int, default=512, help="chunk length in tokens (llama.cpp's -c)")
    p.add_argument("--max-chunks", type=int, default=None, help="at most this many chunks (default: all; llama.cpp's --chunks)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads and llama.cpp's -t")
    p.add_argument("--device", default="cpu")
    p.add_argument("--llama-cpp-bin", default=None, help=f"llama-perplexity or its folder (default {DEFAULT_LLAMA_BIN})")
    p.add_argument("--output", default=None,
                   help="results file, the .json beside it (default: benchmarks/results/<date>-NAME.md)")
    add_results_args(p, "perplexity")
    args = p.parse_args(argv)
    models = args.model or [DEFAULT_MODEL]
    quantizations = [q.strip() for q in args.quantizations.split(",") if q.strip()]
    for q in quantizations:
        if q not in QUANTIZATIONS:
            p.error(f"--quantizations: {q!r} is not one of {', '.join(QUANTIZATIONS)}")
    if args.ctx < 4 or args.ctx % 2:
        p.error("--ctx must be an even number >= 4")
    torch.set_num_threads(args.threads)
    report = Report(args.name, "Perplexity: this runtime against llama.cpp's llama-perplexity", "scripts.perplexity",
                    argv, args)
    llama_bin = find_llama_bin(args.llama_cpp_bin)
    if llama_bin is None:
        print(f"llama-perplexity not found ({args.llama_cpp_bin or DEFAULT_LLAMA_BIN}): no llama.cpp row "
              "(scripts/build_llama_cpp.sh builds it)", file=sys.stderr)
    text = TEXT.read_text()
    if text.endswith("\n"):
        text = text[:-1]  # llama.cpp's -f drops one trailing newline (common/arg.cpp)

    header = ("| model | quantization | dtype | chunks x scored | PPL | llama.cpp PPL (same file) | ours / llama.cpp | s |\n"
              "|---|---|---|---|---|---|---|---|")
    rows, notes, records = [], [], []
    for spec in models:
        source = resolve_model(spec)
        name = source.path.name
        llama = None
        if llama_bin is not None and source.kind == "gguf":
            llama = llama_perplexity(llama_bin, source.path, args.ctx, args.threads, args.max_chunks)
            if llama:
                rows.append(f"| {name} | llama.cpp (file as is) | - | {llama['chunks']} x {args.ctx - 1 - args.ctx // 2} "
                            f"| {llama['ppl']:.4f} +/- {llama['err']:.4f} | {llama['ppl']:.4f} | - | {llama['seconds']:.0f} |")
                print(rows[-1], flush=True)
                records.append({"model": name, "quantization": "llama.cpp", **llama})
        for quantization in quantizations:
            start = time.perf_counter()
            model, tokenizer, config = load_model(spec, args.dtype, args.device, quantization)
            add_bos = adds_bos(tokenizer)  # as llama.cpp: the GGUF's own flag (runtime.models.loader)
            tokens = tokenize(text, tokenizer, add_bos)
            if len(tokens) < 2 * args.ctx:
                sys.exit(f"{TEXT} is {len(tokens)} tokens for {name}: --ctx {args.ctx} needs at least {2 * args.ctx}")
            print(f"{name} {quantization} {args.dtype}: {len(tokens)} tokens, BOS {'added' if add_bos else 'not added'}; "
                  f"{linear_kernels(model)}", file=sys.stderr, flush=True)
            ppl, err, chunks, scored = perplexity(model, tokens, args.ctx, tokenizer.bos_token_id if add_bos else None,
                                                  args.max_chunks, args.device)
            seconds = time.perf_counter() - start
            theirs = f"{llama['ppl']:.4f}" if llama else "-"
            ratio = f"{ppl / llama['ppl']:.4f} ({ppl / llama['ppl'] - 1:+.2%})" if llama else "-"
            rows.append(f"| {name} | {quantization} | {args.dtype} | {chunks} x {scored // chunks} "
                        f"| {ppl:.4f} +/- {err:.4f} | {theirs} | {ratio} | {seconds:.0f} |")
            print(rows[-1], flush=True)
            records.append({"model": name, "quantization": quantization, "dtype": args.dtype, "chunks": chunks,
                            "scored_tokens": scored, "ppl": ppl, "err": err, "seconds": seconds,
                            "llama_cpp_ppl": llama["ppl"] if llama else None})
            notes.append(f"- {name} {quantization}: {len(tokens)} tokens (BOS {'added' if add_bos else 'not added'}); "
                         f"{linear_kernels(model)}")
            if llama and llama["chunks"] is not None and llama["chunks"] != chunks:
                notes.append(f"- WARNING {name}: llama.cpp ran {llama['chunks']} chunks, we ran {chunks}: "
                             "the tokenizations differ in length")
            del model

    print()
    for line in (f"- {args.threads} threads; text: {TEXT.relative_to(ROOT)} (Alice's Adventures in Wonderland, "
                 "ch. I-III)",
                 f"- ctx {args.ctx}, scored positions ctx/2..ctx-1 of each chunk (llama.cpp's way)", "",
                 header, *rows, "", *notes):
        report.line(line)
    report.data["rows"] = records
    report.write(args.output)


if __name__ == "__main__":
    main()
