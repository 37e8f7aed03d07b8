"""Speculative decoding speed of this engine against plain decoding and HF transformers, in one run.

Same model, same chat prompts (the same prompt token ids), same dtype, greedy, each request
stopping at EOS or --max-tokens, so output lengths differ: tok/s is generated tokens / wall time.
Rows (systems):

  - HF plain:        transformers `generate`, greedy;
  - HF prompt lookup: transformers `generate(prompt_lookup_num_tokens=N)`, greedy;
  - ours plain:      this engine, speculator "none";
  - ours ngram:      speculator "ngram" (prompt lookup);
  - ours lookahead chain / tree: speculator "lookahead", tree width 1 / --tree-width.

Two prompt groups, reported apart: input-grounded prompts (the answer copies from the input:
a code edit, quoting a paragraph, extracting fields, repeating text) and open chat prompts.
Single stream (one request at a time, as HF serves them) is the main measure; the target is
lookahead >= 2x our plain decode on input-grounded prompts and >= 0.95x on open chat.
With --concurrency the engine also gets all prompts of a group at once.

Every system is warmed up once, then the systems are timed in turn, --repeats rounds
interleaved so that drifting machine load hits them alike; each row shows the median round.
One engine (one model load) serves all of our rows: each row has its own speculator setting,
proposers and speculation controller, swapped in before it runs.

    .venv/bin/python scripts/bench_spec.py
    .venv/bin/python scripts/bench_spec.py --threads 16 --max-tokens 256 --concurrency
    .venv/bin/python scripts/bench_spec.py --max-tokens 16 --repeats 1 --limit 2   # smoke test
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from runtime import LLM, SamplingParams  # noqa: E402
from speculators import registry  # noqa: E402
from runtime.models.loader import DTYPES, load_tokenizer, resolve_model  # noqa: E402
from runtime.speculation import SpeculationController  # noqa: E402

from bench_decode import load_hf  # noqa: E402  (scripts/ is on sys.path when run as a script)

CODE = '''def summarize_orders(data, min_total=0.0):
    totals = {}
    counts = {}
    for row in data:
        customer = row["customer"].strip().lower()
        amount = float(row["amount"])
        if row.get("refunded"):
            amount = -amount
        totals[customer] = totals.get(customer, 0.0) + amount
        counts[customer] = counts.get(customer, 0) + 1
    result = []
    for customer, total in totals.items():
        if total < min_total:
            continue
        average = total / counts[customer]
        result.append({
            "customer": customer,
            "total": round(total, 2),
            "orders": counts[customer],
            "average": round(average, 2),
        })
    result.sort(key=lambda item: item["total"], reverse=True)
    best = result[0]["customer"] if result else None
    return {
        "customers": result,
        "best_customer": best,
        "num_orders": sum(counts.values()),
        "num_customers": len(result),
    }'''

PARAGRAPH = (
    "The lighthouse at Point Reyes was built in 1870 on a cliff three hundred feet above the Pacific Ocean. "
    "Its first-order Fresnel lens, made in France from more than a thousand pieces of glass, could be seen "
    "twenty-four miles out to sea. The keepers who lived there described it as the windiest and foggiest place "
    "on the coast, and some of them left after only a few months. In 1975 the Coast Guard replaced the old lens "
    "with an automated light, and the lighthouse became part of the national seashore, where visitors can still "
    "climb down the three hundred steps to see it.")

RECORD = (
    "From: Maria Gonzalez <maria.gonzalez@example.com>\n"
    "Date: 14 March 2024\n"
    "Subject: Order 58213 arrived damaged\n\n"
    "Hello, my order number 58213 (a blue ceramic teapot, item code TP-440, price $39.99) arrived on "
    "12 March with a cracked lid. I live at 27 Harbor Street, Portland, Oregon 97201, and my phone number is "
    "503-555-0187. I would like a replacement rather than a refund. Thank you, Maria")

REPEAT_TEXT = (
    "To install the package, first create a virtual environment with python -m venv .venv, then activate it "
    "with source .venv/bin/activate. Next, run pip install -r requirements.txt to install the dependencies. "
    "Finally, run python -m pytest to check that everything works. If a test fails, read the error message "
    "carefully, check that you are using Python 3.10 or newer, and try again.")

GROUPS = {
    "input-grounded": [
        "Here is a Python function:\n\n```python\n" + CODE + "\n```\n\nRename the variable `data` to `rows` "
        "and add a docstring to the function. Return the full updated code.",
        "Repeat the following text exactly, word for word:\n\n" + REPEAT_TEXT,
        "Extract the following fields from the email below and return them as JSON: name, email, date, "
        "order_number, item, item_code, price, address, phone, request.\n\n" + RECORD,
        "Read this paragraph:\n\n" + PARAGRAPH + "\n\nQuote the first two sentences exactly, then summarise "
        "the paragraph in two sentences.",
    ],
    "open chat": [
        "Write a short poem about the sea.",
        "Explain why the sky is blue.",
        "Give me three ideas for a birthday party.",
        "What are some good habits for staying healthy?",
    ],
}


@dataclass(slots=True)
class System:
    key: str
    label: str
    speculator: str | None = None  # engine rows; None for HF rows
    tree_width: int | None = 1  # None: each speculator's default (a combined one's parts their own)
    hf_lookup: int = 0  # HF prompt_lookup_num_tokens; 0 = plain
    num_tokens: int | None = None  # bench_heads: draft nodes per step; None: the speculator's default
    eagle_depth: int | None = None  # bench_heads: EAGLE-2 expansion steps; None: the engine's default
    # per-system engine state swapped in before it runs
    proposers: dict = field(default_factory=dict)
    controller: SpeculationController | None = None

    @property
    def is_hf(self) -> bool:
        return self.speculator is None


@dataclass(slots=True)
class Measure:
    rounds: list[tuple[int, float]] = field(default_factory=list)  # (tokens, seconds) per timed round
    outputs: list[list[int]] | None = None  # token ids of the first timed round, one per prompt
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    has_metrics: bool = False

    @property
    def rate(self) -> float:
        return statistics.median(n / s for n, s in self.rounds)

    @property
    def acceptance_length(self) -> float | None:
        return 1 + self.accepted / self.verify_steps if self.verify_steps else None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="alias, .gguf file or HF directory (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128,
                   help="most tokens generated per request; EOS stops earlier (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds; the median is shown (default: 3)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N; both engines run there (default: cpu)")
    p.add_argument("--kv-cache-memory", default=None, help="engine KV cache size (default: the engine's)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="engine draft tokens per step (default: the engine's: "
                        + ", ".join(f"{k} for {n}" for n, k in ((s.name, s.num_speculative_tokens) for s in registry.speculators().values())) + ")")
    p.add_argument("--tree-width", type=int, default=3, help="lookahead tree row: most children per draft node "
                                                             "(default: %(default)s)")
    p.add_argument("--no-adaptive-speculation", dest="adaptive", action="store_false",
                   help="engine: always propose the full draft instead of sizing it from measured acceptance")
    p.add_argument("--hf-lookup-tokens", type=int, default=10,
                   help="HF prompt_lookup_num_tokens (default: %(default)s)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts of each group")
    p.add_argument("--concurrency", action="store_true",
                   help="also give the engine all prompts of a group at once (extra rows)")
    p.add_argument("--systems", default=None,
                   help="comma-separated subset of: hf, hf-lookup, plain, ngram, lookahead-chain, lookahead-tree "
                        "(default: all)")
    args = p.parse_args(argv)
    if args.max_tokens < 2 or args.repeats < 1 or args.tree_width < 1 or args.hf_lookup_tokens < 1:
        p.error("--max-tokens must be >= 2, --repeats, --tree-width and --hf-lookup-tokens >= 1")
    if args.limit is not None and args.limit < 1:
        p.error("--limit must be >= 1")
    return args


def make_systems(args) -> list[System]:
    systems = [
        System("hf", "HF plain"),
        System("hf-lookup", f"HF prompt lookup ({args.hf_lookup_tokens})", hf_lookup=args.hf_lookup_tokens),
        System("plain", "ours plain", "none"),
        System("ngram", "ours ngram", "ngram"),
        System("lookahead-chain", "ours lookahead chain", "lookahead", 1),
        System("lookahead-tree", f"ours lookahead tree (width {args.tree_width})", "lookahead", args.tree_width),
    ]
    if args.systems:
        wanted = [s.strip() for s in args.systems.split(",") if s.strip()]
        unknown = set(wanted) - {s.key for s in systems}
        if unknown:
            raise SystemExit(f"unknown system(s): {', '.join(sorted(unknown))}")
        systems = [s for s in systems if s.key in wanted]
    return systems


HF_OVERSHOOT: list[int] = []  # tokens HF generated beyond max_new_tokens, per request that did


def run_hf(model, prompt_ids: list[int], max_tokens: int, eos_ids: list[int],
           lookup: int) -> tuple[int, float, list[int]]:
    """One greedy request -> (output tokens, seconds, output ids)."""
    ids = torch.tensor([prompt_ids], device=model.device)
    extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             do_sample=False, temperature=None, top_p=None, top_k=None,
                             eos_token_id=eos_ids or None, pad_token_id=eos_ids[0] if eos_ids else 0, **extra)
    tokens = out[0, ids.shape[1]:].tolist()  # .tolist() waits for the device
    elapsed = time.perf_counter() - start
    if len(tokens) > max_tokens:  # assisted generation can accept past max_new_tokens: count only those asked for
        HF_OVERSHOOT.append(len(tokens) - max_tokens)
        tokens = tokens[:max_tokens]
    return len(tokens), elapsed, tokens


def use_system(llm: LLM, system: System, adaptive: bool) -> None:
    """Point the engine at this system's speculator, tree width, proposers and controller."""
    engine = llm.engine
    if system.controller is None:
        system.controller = SpeculationController(adaptive=adaptive)
    engine.config.speculator = system.speculator
    engine.config.speculative_tree_width = system.tree_width
    engine.proposers = system.proposers
    engine.sync_feature_layers()
    engine.spec_controller = system.controller


def run_engine(llm: LLM, prompts: list, max_tokens: int):
    """All prompts at once -> (output tokens, seconds, results)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    results = llm.generate(prompts, params, use_tqdm=False)
    summary = llm.last_summary
    return summary.num_output_tokens, summary.elapsed_s, results


def add_metrics(measure: Measure, results) -> None:
    measure.has_metrics = True
    for r in results:
        measure.drafted += r.metrics.num_draft_tokens
        measure.accepted += r.metrics.num_accepted_tokens
        measure.verify_steps += r.metrics.num_verify_steps


def print_table(header: tuple, rows: list[tuple]) -> None:
    table = [header] + rows
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for n, row in enumerate(table):
        print("| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
              + " |")
        if n == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    systems = make_systems(args)
    hf_systems = [s for s in systems if s.is_hf]
    groups = {name: prompts[:args.limit] for name, prompts in GROUPS.items()}
    messages = {name: [[{"role": "user", "content": p}] for p in prompts] for name, prompts in groups.items()}

    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, kv_cache_memory=args.kv_cache_memory,
              num_speculative_tokens=args.num_speculative_tokens, adaptive_speculation=args.adaptive, seed=0,
              max_num_seqs=max(64, max(map(len, groups.values()))))
    t1 = time.perf_counter()
    hf = load_hf(args.model, dtype, args.device) if hf_systems else None
    hf_tok = load_tokenizer(resolve_model(args.model))
    t2 = time.perf_counter()
    print(f"loaded: engine {t1 - t0:.1f} s, HF transformers {t2 - t1:.1f} s", file=sys.stderr)
    eos_ids = list(llm.engine.model_config.eos_token_ids)

    # the same prompt token ids on both sides: HF's chat template against the engine's
    hf_ids, mismatched = {}, []
    for name, convs in messages.items():
        hf_ids[name] = []
        for i, conv in enumerate(convs):
            theirs = list(hf_tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True))
            ours = llm.engine.prompt_token_ids(conv)
            if theirs != ours:
                mismatched.append(f"{name} #{i + 1}")
            hf_ids[name].append(theirs)
    if mismatched:
        print(f"WARNING: HF and engine prompt token ids differ for {', '.join(mismatched)}", file=sys.stderr)

    # warm-up: every system once, on a short request
    warm = min(16, args.max_tokens)
    first = next(iter(groups))
    for s in systems:
        if s.is_hf:
            run_hf(hf, hf_ids[first][0], warm, eos_ids, s.hf_lookup)
        else:
            use_system(llm, s, args.adaptive)
            run_engine(llm, messages[first][:1], warm)
            if args.concurrency:
                run_engine(llm, messages[first], warm)

    modes = ["single"] + (["concurrent"] if args.concurrency else [])
    measures = {(g, s.key, m): Measure() for g in groups for s in systems for m in modes
                if m == "single" or not s.is_hf}
    for r in range(args.repeats):
        for g in groups:
            for s in systems:
                if s.is_hf:
                    m = measures[(g, s.key, "single")]
                    tokens = seconds = 0
                    outs = []
                    for ids in hf_ids[g]:
                        n, sec, out = run_hf(hf, ids, args.max_tokens, eos_ids, s.hf_lookup)
                        tokens, seconds = tokens + n, seconds + sec
                        outs.append(out)
                    m.rounds.append((tokens, seconds))
                    m.outputs = m.outputs or outs
                    lines = [("single", tokens, seconds)]
                else:
                    use_system(llm, s, args.adaptive)
                    lines = []
                    for mode in modes:
                        m = measures[(g, s.key, mode)]
                        if mode == "single":
                            tokens = seconds = 0
                            results = []
                            for conv in messages[g]:
                                n, sec, res = run_engine(llm, [conv], args.max_tokens)
                                tokens, seconds = tokens + n, seconds + sec
                                results += res
                        else:
                            tokens, seconds, results = run_engine(llm, messages[g], args.max_tokens)
                        m.rounds.append((tokens, seconds))
                        m.outputs = m.outputs or [res.token_ids for res in results]
                        if s.speculator != "none":
                            add_metrics(m, results)
                        lines.append((mode, tokens, seconds))
                for mode, tokens, seconds in lines:
                    print(f"round {r + 1}/{args.repeats} {g:14s} {s.label:32s} {mode:10s} "
                          f"{tokens:5d} tokens {seconds:7.2f} s {tokens / seconds:7.1f} tok/s", file=sys.stderr)

    lengths = [len(ids) for ids_list in hf_ids.values() for ids in ids_list]
    print(f"\n### Speculative decoding, {datetime.date.today().isoformat()}\n")
    print(f"model {args.model}  dtype {args.dtype}  device {llm.engine.device}  torch {torch.__version__}  "
          f"threads {torch.get_num_threads()}")
    spec_tokens = ", ".join(f"{n} {llm.engine.config.speculative_tokens(n)}" for n in ("ngram", "lookahead"))
    print(f"greedy, at most {args.max_tokens} new tokens per request (EOS stops earlier; tok/s = generated tokens / "
          f"wall time); median of {args.repeats} rounds after a warm-up; chat prompts of {min(lengths)}-"
          f"{max(lengths)} tokens; engine draft tokens per step: {spec_tokens}; adaptive speculation "
          f"{'on' if args.adaptive else 'off'}; HF prompt_lookup_num_tokens {args.hf_lookup_tokens}")
    if mismatched:
        print(f"NOTE: HF and engine prompt token ids differ for {', '.join(mismatched)}")

    targets = []
    for g in groups:
        n = len(groups[g])
        plain = measures.get((g, "plain", "single"))
        hf_plain = measures.get((g, "hf", "single"))
        plain_rate = plain.rate if plain else None
        hf_rate = hf_plain.rate if hf_plain else None
        print(f"\n#### {g} ({n} prompts)\n")
        header = ("system", "tok/s", "vs ours plain", "vs HF plain", "mean accept len", "same output as ours plain")
        rows = []
        for mode in modes:
            base = measures.get((g, "plain", mode))
            for s in systems:
                m = measures.get((g, s.key, mode))
                if m is None:
                    continue
                label = s.label if mode == "single" else f"{s.label}, {n} concurrent"
                acc = m.acceptance_length
                # against ours plain in the same mode; ours plain concurrent against ours plain single stream
                ref = plain if s.key == "plain" or base is None else base
                same = "-"
                if ref is not None and ref is not m:
                    same = f"{sum(a == b for a, b in zip(m.outputs, ref.outputs))}/{n}"
                rows.append((label, f"{m.rate:.1f}", ratio(m.rate, base.rate if base else None),
                             ratio(m.rate, hf_rate), f"{acc:.2f}" if acc is not None else "-", same))
        print_table(header, rows)
        hf_lookup = next((measures[(g, s.key, "single")] for s in systems if s.key == "hf-lookup"), None)
        if hf_plain is not None and hf_lookup is not None:
            print(f"\nHF prompt lookup outputs identical to HF plain: "
                  f"{sum(a == b for a, b in zip(hf_lookup.outputs, hf_plain.outputs))}/{n}")
        goal = 2.0 if g == "input-grounded" else 0.95
        for key in ("lookahead-chain", "lookahead-tree"):
            m = measures.get((g, key, "single"))
            if m is not None and plain_rate:
                got = m.rate / plain_rate
                label = next(s.label for s in systems if s.key == key)
                targets.append(f"{g}: {label} {got:.2f}x ours plain (target >= {goal}x): "
                               f"{'met' if got >= goal else 'NOT met'}")
    print("\nSingle stream: one request at a time. Concurrent rows (if any) give the engine all prompts of the group "
          "at once; their 'vs ours plain' is against ours plain concurrent, 'vs HF plain' against HF's single "
          "stream. 'same output' counts prompts whose tokens equal ours plain in the same mode (ours plain "
          "concurrent: against ours plain single stream); greedy is lossless up to "
          f"{args.dtype} kernel-shape differences. Mean accept len = 1 + accepted / verify steps.")
    if HF_OVERSHOOT:
        print(f"HF prompt lookup generated past max_new_tokens in {len(HF_OVERSHOOT)} requests (up to "
              f"{max(HF_OVERSHOOT)} tokens); those tokens were cut off and not counted.")
    if targets:
        print("\n" + "\n".join(targets))


if __name__ == "__main__":
    main()
