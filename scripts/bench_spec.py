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
One engine (one model load) serves all of our rows: before a row runs, the engine switches
to its speculator and tree width with `update_speculation`, which builds fresh proposers and
a fresh speculation controller (so no row starts from another row's, or an earlier round's,
lookahead cache). The tables go to stdout and to benchmarks/results/<date>-bench_spec.md
(and .json).

    python -m scripts.bench_spec
    python -m scripts.bench_spec --threads 16 --max-tokens 256 --concurrency
    python -m scripts.bench_spec --max-tokens 16 --repeats 1 --limit 1 --enforce-eager   # smoke test
"""
from __future__ import annotations

import argparse
import datetime
import time
from typing import NamedTuple

import torch

from runtime import LLM
from runtime.models.loader import DTYPES
from speculators import registry
from scripts.harness import (HF_OVERSHOOT, Measure, Report, Speculation, System, add_results_args,
                             hf_one_at_a_time, hf_prompt_ids, interleaved, load_hf, log, one_at_a_time, ratio,
                             run_engine, select_systems)

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
    p.add_argument("--enforce-eager", action="store_true", help="the engine's --enforce-eager")
    add_results_args(p, "bench_spec")
    args = p.parse_args(argv)
    if args.max_tokens < 2 or args.repeats < 1 or args.tree_width < 1 or args.hf_lookup_tokens < 1:
        p.error("--max-tokens must be >= 2, --repeats, --tree-width and --hf-lookup-tokens >= 1")
    if args.limit is not None and args.limit < 1:
        p.error("--limit must be >= 1")
    return args


class Row(NamedTuple):
    key: tuple  # (group, system key, "single")
    group: str
    system: System


def make_systems(args) -> list[System]:
    systems = [
        System("hf", "HF plain"),
        System("hf-lookup", f"HF prompt lookup ({args.hf_lookup_tokens})", hf_lookup=args.hf_lookup_tokens),
        System("plain", "ours plain", "none", {"speculative_tree_width": 1}),
        System("ngram", "ours ngram", "ngram", {"speculative_tree_width": 1}),
        System("lookahead-chain", "ours lookahead chain", "lookahead", {"speculative_tree_width": 1}),
        System("lookahead-tree", f"ours lookahead tree (width {args.tree_width})", "lookahead",
               {"speculative_tree_width": args.tree_width}),
    ]
    return select_systems(systems, args.systems)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    systems = make_systems(args)
    report = Report(args.name, "bench_spec: speculative decoding against plain decoding and HF transformers",
                    "scripts.bench_spec", argv, args)
    groups = {name: prompts[:args.limit] for name, prompts in GROUPS.items()}
    messages = {name: [[{"role": "user", "content": p}] for p in prompts] for name, prompts in groups.items()}

    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, kv_cache_memory=args.kv_cache_memory,
              num_speculative_tokens=args.num_speculative_tokens, adaptive_speculation=args.adaptive, seed=0,
              max_num_seqs=max(64, max(map(len, groups.values()))), enforce_eager=args.enforce_eager)
    t1 = time.perf_counter()
    hf = load_hf(args.model, dtype, args.device) if any(s.is_hf for s in systems) else None
    log(f"loaded: engine {t1 - t0:.1f} s, HF transformers {time.perf_counter() - t1:.1f} s")
    eos_ids = list(llm.engine.model_config.eos_token_ids)
    speculation = Speculation(llm.engine, systems, adaptive_speculation=args.adaptive)

    # the same prompt token ids on both sides: HF's chat template against the engine's
    hf_ids, mismatched = {}, []
    for name, convs in messages.items():
        hf_ids[name], bad = hf_prompt_ids(args.model, convs, llm.engine)
        mismatched += [f"{name} #{i + 1}" for i in bad]
    if mismatched:
        log(f"WARNING: HF and engine prompt token ids differ for {', '.join(mismatched)}")

    modes = ["single"] + (["concurrent"] if args.concurrency else [])
    warm = min(16, args.max_tokens)
    first = next(iter(groups))

    def hf_all(s: System, ids: list, max_tokens: int):
        return hf_one_at_a_time(hf, ids, max_tokens, eos_ids=eos_ids, lookup=s.hf_lookup)

    # a round times each (group, system) in turn: HF rows single stream, ours in every mode
    items = [Row((g, s.key, "single"), g, s) for g in groups for s in systems]
    measures = {(g, s.key, mode): Measure() for g in groups for s in systems
                for mode in (["single"] if s.is_hf else modes)}

    def run(item: Row, m: Measure) -> None:  # m: the item's single-stream measure
        g, s = item.group, item.system
        if s.is_hf:
            tokens, seconds, outputs = hf_all(s, hf_ids[g], args.max_tokens)
            m.add_round(tokens, seconds, outputs)
            return
        speculation.use(s)
        for mode in modes:
            if mode == "single":
                tokens, seconds, results = one_at_a_time(llm, messages[g], args.max_tokens)
            else:
                tokens, seconds, results = run_engine(llm, messages[g], args.max_tokens)
                log(f"  {g} {s.label}, {len(messages[g])} concurrent: {tokens} tokens {seconds:.2f} s "
                    f"{tokens / seconds:.1f} tok/s")
            mm = measures[(g, s.key, mode)]
            mm.add_round(tokens, seconds, [r.token_ids for r in results])
            if s.speculates:
                mm.add_metrics(results)

    warmed = set()

    def warm_once(item: Row) -> None:  # every system once, on a short request
        s = item.system
        if s.key in warmed:
            return
        warmed.add(s.key)
        if s.is_hf:
            hf_all(s, hf_ids[first][:1], warm)
        else:
            speculation.use(s)
            run_engine(llm, messages[first][:1], warm)
            if args.concurrency:
                run_engine(llm, messages[first], warm)

    HF_OVERSHOOT.clear()
    interleaved(items, args.repeats, run, warm=warm_once,
                label=lambda item: f"{item.group:14s} {item.system.label}", measures=measures)

    lengths = [len(ids) for ids_list in hf_ids.values() for ids in ids_list]
    report.line(f"### Speculative decoding, {datetime.date.today().isoformat()}")
    report.line()
    report.line(f"model {args.model}  dtype {args.dtype}  device {llm.engine.device}  torch {torch.__version__}  "
                f"threads {torch.get_num_threads()}{'  enforce_eager' if args.enforce_eager else ''}")
    config = llm.engine.config
    spec_tokens = ", ".join(f"{n} {config.speculative_tokens(n)}" for n in ("ngram", "lookahead"))
    report.line(f"greedy, at most {args.max_tokens} new tokens per request (EOS stops earlier; tok/s = generated "
                f"tokens / wall time); median of {args.repeats} rounds after a warm-up; chat prompts of {min(lengths)}-"
                f"{max(lengths)} tokens; engine draft tokens per step: {spec_tokens}; adaptive speculation "
                f"{'on' if args.adaptive else 'off'}; HF prompt_lookup_num_tokens {args.hf_lookup_tokens}")
    if mismatched:
        report.line(f"NOTE: HF and engine prompt token ids differ for {', '.join(mismatched)}")

    targets = []
    for g in groups:
        n = len(groups[g])
        plain = measures.get((g, "plain", "single"))
        hf_plain = measures.get((g, "hf", "single"))
        plain_rate = plain.rate if plain else None
        hf_rate = hf_plain.rate if hf_plain else None
        report.line()
        report.line(f"#### {g} ({n} prompts)")
        report.line()
        table = []
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
                table.append((label, f"{m.rate:.1f}", ratio(m.rate, base.rate if base else None),
                              ratio(m.rate, hf_rate), f"{acc:.2f}" if acc is not None else "-", m.same_outputs(ref)))
                report.data.setdefault("rows", []).append({"group": g, "system": s.key, "label": s.label,
                                                           "mode": mode, **m.summary()})
        report.table(("system", "tok/s", "vs ours plain", "vs HF plain", "mean accept len",
                      "same output as ours plain"), table)
        hf_lookup = measures.get((g, "hf-lookup", "single"))
        if hf_plain is not None and hf_lookup is not None:
            report.line()
            report.line(f"HF prompt lookup outputs identical to HF plain: {hf_lookup.same_outputs(hf_plain)}")
        goal = 2.0 if g == "input-grounded" else 0.95
        for key in ("lookahead-chain", "lookahead-tree"):
            m = measures.get((g, key, "single"))
            if m is not None and plain_rate:
                got = m.rate / plain_rate
                label = next(s.label for s in systems if s.key == key)
                targets.append(f"{g}: {label} {got:.2f}x ours plain (target >= {goal}x): "
                               f"{'met' if got >= goal else 'NOT met'}")
    report.line()
    report.line("Single stream: one request at a time. Concurrent rows (if any) give the engine all prompts of the "
                "group at once; their 'vs ours plain' is against ours plain concurrent, 'vs HF plain' against HF's "
                "single stream. 'same output' counts prompts whose tokens equal ours plain in the same mode (ours "
                "plain concurrent: against ours plain single stream); greedy is lossless up to "
                f"{args.dtype} kernel-shape differences. Mean accept len = 1 + accepted / verify steps.")
    if HF_OVERSHOOT:
        report.line(f"HF prompt lookup generated past max_new_tokens in {len(HF_OVERSHOOT)} requests (up to "
                    f"{max(HF_OVERSHOOT)} tokens); those tokens were cut off and not counted.")
    if targets:
        report.line()
        for t in targets:
            report.line(t)
    report.data["targets"] = targets
    report.write()
    llm.engine.close()


if __name__ == "__main__":
    main()
