"""Medusa and EAGLE heads against plain decoding, the lookahead proposer and HF transformers, in one run.

Heads are trained here first when their directories are missing (scripts/train_medusa.py and
scripts/train_eagle.py, self-distillation sharing their corpora: for the default model the
answers shipped in training/data (greedy, sampled and varied), else written from the shipped
training prompts;
--train-minutes each). Then, on held-out chat prompts (training/data/heldout_prompts.jsonl,
none of them seen in training), greedy, single stream, every system in turn for --repeats
interleaved rounds after a warm-up, the median round shown:

  - HF plain:            transformers `generate`, greedy (the peer);
  - ours plain:          speculator "none";
  - ours Medusa:         the Medusa heads and their static tree;
  - ours EAGLE (chain):  the EAGLE head, tree width 1;
  - ours EAGLE-2 (tree): the EAGLE head, dynamic trees of --eagle-width;
  - ours EAGLE-3 chain / tree: the EAGLE-3 head (--eagle3-head), the same two ways;
  - ours EAGLE-3 tree, EAGLE-2's size: the tree EAGLE-2 publishes for GPU targets (depth 6,
                         top-10, 60 nodes) instead of the engine's CPU-sized default (depth 5,
                         top-4, 16 nodes);
  - ours EAGLE-3 tree + lookahead: `eagle+lookahead`, the head's tree (top-4) and the
                         Lookahead Cache's (width 3) merged, 16 + 8 nodes;
  - ours lookahead:      the lookahead proposer (tree width 3);
  (--systems picks rows; --fixed-rows adds each speculating row again, timed with
  adaptive speculation off)
with the heads on each of --head-devices (cpu, and cuda on a GPU box). Mean acceptance
length is tokens per verify step (accepted drafts + the target's own token), in the timed
rounds (adaptive speculation on: the controller drafts less where drafting does not pay)
and, in one more pass with it off ("fixed"), with the whole configured tree every step:
what the drafts themselves are worth. Targets after CPU training: EAGLE-2 acceptance
length >= 2.5, Medusa >= 1.8, EAGLE-2 >= 1.8x our plain. One engine serves all our rows:
before a row runs, the engine switches to its speculator, head, head device and tree with
`update_speculation`. The table goes to stdout and to
benchmarks/results/<date>-bench_heads.md (and .json).

    python -m scripts.bench_heads                               # trains (~40 min) then measures
    python -m scripts.bench_heads --limit 4 --max-tokens 32 --repeats 1   # smoke test (trains missing heads)
    python -m scripts.bench_heads --systems lookahead --limit 1 --max-tokens 16 --repeats 1 --enforce-eager
"""
from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import torch

from runtime import LLM
from runtime.models.loader import DTYPES
from scripts.harness import (PAPER_TREE, Measure, Report, Speculation, System, add_results_args,
                             hf_one_at_a_time, hf_prompt_ids, interleaved, load_hf, log, one_at_a_time, prompt_set,
                             ratio, run_engine)
from speculators import registry

DEFAULT_SPECULATIVE_TOKENS = {s.name: s.num_speculative_tokens for s in registry.speculators().values()}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="alias, .gguf file or HF directory (default: %(default)s)")
    p.add_argument("--medusa-heads", default="models/medusa-smollm2", help="Medusa checkpoint; trained when missing")
    p.add_argument("--eagle-head", default="models/eagle-smollm2", help="EAGLE checkpoint; trained when missing")
    p.add_argument("--eagle3-head", default="models/eagle3-smollm2",
                   help="EAGLE-3 checkpoint; trained when missing (--eagle3 --unroll 3); 'none' to leave out")
    p.add_argument("--corpus", default=None,
                   help="the target's answers the trainings share, written when missing (default: the answers "
                        "shipped for the default model, else the training scripts' own)")
    p.add_argument("--train-minutes", type=float, default=20.0, help="training budget per head (default: 20)")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens per request (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=2, help="timed rounds; the median is shown (default: 2)")
    p.add_argument("--limit", type=int, default=12, help="held-out prompts used (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--device", default="cpu", help="the target's device (default: cpu)")
    p.add_argument("--head-devices", default=None, help="comma-separated devices for the heads (default: cpu, plus "
                                                        "the target's device when it is not the CPU)")
    p.add_argument("--eagle-width", type=int, default=4, help="EAGLE-2 top-k per expansion (default: 4)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--draft-quantization", choices=("none", "int8"), default="none",
                   help="weight-only quantization of the heads' own layers on the CPU (default: none)")
    p.add_argument("--systems", default=None,
                   help="comma-separated rows to run besides HF and ours plain: medusa, eagle (chain and tree), "
                        "eagle-chain, eagle-tree, eagle3 (its three rows), eagle3-chain, eagle3-tree, "
                        "eagle3-lookahead, lookahead (default: all); only their heads are trained")
    p.add_argument("--fixed-rows", action="store_true",
                   help="also time every speculating row with adaptive speculation off (the whole tree every step)")
    p.add_argument("--enforce-eager", action="store_true", help="the engine's --enforce-eager")
    add_results_args(p, "bench_heads")
    return p.parse_args(argv)


def selected(args, key: str) -> bool:
    """Whether the row with this key (a head row's ends with its device) was asked for."""
    if key in ("hf", "plain") or not args.systems:
        return True
    return any(key == name or key.startswith(name + "-") for name in args.systems.split(","))


def ensure_heads(args) -> None:
    common = (["--model", args.model, "--minutes", str(args.train_minutes), "--device", args.device]
              + (["--corpus", args.corpus] if args.corpus else []))
    if selected(args, "medusa-") and not Path(args.medusa_heads).exists():
        from scripts import train_medusa
        log(f"training Medusa heads -> {args.medusa_heads}")
        train_medusa.main(common + ["--out", args.medusa_heads])
    if (selected(args, "eagle-chain-") or selected(args, "eagle-tree-")) and not Path(args.eagle_head).exists():
        from scripts import train_eagle
        log(f"training the EAGLE head -> {args.eagle_head}")
        train_eagle.main(common + ["--out", args.eagle_head])
    wants_eagle3 = any(selected(args, f"eagle3-{kind}-") for kind in ("chain", "tree", "lookahead"))
    if args.eagle3_head != "none" and wants_eagle3 and not Path(args.eagle3_head).exists():
        from scripts import train_eagle
        log(f"training the EAGLE-3 head -> {args.eagle3_head}")
        train_eagle.main(common + ["--out", args.eagle3_head, "--eagle3", "--unroll", "3", "--steps", "2400"])


def make_systems(args, head_devices: list[str]) -> list[System]:
    """Every row asked for; a head row's settings name its head and the device it runs on."""
    rows = [System("hf", "HF plain"), System("plain", "ours plain", "none")]
    for device in head_devices:
        where = f" (heads on {device})"
        eagle = {"draft_device": device, "eagle_head": args.eagle_head}
        eagle3 = {"draft_device": device, "eagle_head": args.eagle3_head}
        rows += [System(f"medusa-{device}", "ours Medusa" + where, "medusa", {"draft_device": device}),
                 System(f"eagle-chain-{device}", "ours EAGLE chain" + where, "eagle",
                        {**eagle, "speculative_tree_width": 1}),
                 System(f"eagle-tree-{device}", f"ours EAGLE-2 tree (top-{args.eagle_width})" + where, "eagle",
                        {**eagle, "speculative_tree_width": args.eagle_width})]
        if args.eagle3_head != "none":
            rows += [System(f"eagle3-chain-{device}", "ours EAGLE-3 chain" + where, "eagle",
                            {**eagle3, "speculative_tree_width": 1}),
                     System(f"eagle3-tree-{device}", f"ours EAGLE-3 tree (top-{args.eagle_width})" + where, "eagle",
                            {**eagle3, "speculative_tree_width": args.eagle_width}),
                     System(f"eagle3-wide-{device}", f"ours EAGLE-3 tree, EAGLE-2's size ({PAPER_TREE})" + where,
                            "eagle", {**eagle3, **PAPER_TREE.settings()}),
                     System(f"eagle3-lookahead-{device}", "ours EAGLE-3 tree + lookahead" + where,
                            "eagle+lookahead", eagle3)]
    rows.append(System("lookahead", "ours lookahead (width 3)", "lookahead", {"speculative_tree_width": 3}))
    rows = [system for system in rows if selected(args, system.key)]
    if args.fixed_rows:
        rows += [fixed(system, key=system.key + "-fixed", label=system.label + ", fixed")
                 for system in rows if system.speculates]
    return rows


def fixed(system: System, **changes) -> System:
    """The system with adaptive speculation off: every step drafts the whole tree."""
    return system.replace(settings={**dict(system.settings), "adaptive_speculation": False}, **changes)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ensure_heads(args)
    head_devices = ([d.strip() for d in args.head_devices.split(",")] if args.head_devices
                    else ["cpu"] + ([args.device] if args.device != "cpu" else []))
    report = Report(args.name, "bench_heads: Medusa and EAGLE heads against plain decoding, lookahead and HF",
                    "scripts.bench_heads", argv, args)
    prompts = prompt_set("heldout", args.limit)
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, seed=0, medusa_heads=args.medusa_heads,
              eagle_head=args.eagle_head, draft_quantization=args.draft_quantization, adaptive_speculation=True,
              enforce_eager=args.enforce_eager)
    hf = load_hf(args.model, DTYPES[args.dtype], args.device)
    eos_ids = list(llm.engine.model_config.eos_token_ids)
    hf_ids, _ = hf_prompt_ids(args.model, prompts)
    systems = make_systems(args, head_devices)
    speculation = Speculation(llm.engine, systems + [fixed(s) for s in systems if s.speculates])

    def warm(system: System) -> None:  # (and build each system's proposers on its device)
        if system.is_hf:
            hf_one_at_a_time(hf, hf_ids[:1], 16, eos_ids=eos_ids)
        else:
            speculation.use(system)
            run_engine(llm, prompts[:1], 16)

    def run(system: System, m: Measure) -> None:
        if system.is_hf:
            m.add_round(*hf_one_at_a_time(hf, hf_ids, args.max_tokens, eos_ids=eos_ids))
            return
        speculation.use(system)
        tokens, seconds, results = one_at_a_time(llm, prompts, args.max_tokens)
        m.add_round(tokens, seconds)
        if system.speculates:
            m.add_metrics(results)

    measures = interleaved(systems, args.repeats, run, warm=warm)

    fixed_lengths = {}  # system key -> acceptance length with every step's whole tree (adaptive off)
    for system in systems:
        if system.key.endswith("-fixed"):  # timed that way already
            fixed_lengths[system.key] = measures[system.key].acceptance_length
        elif system.speculates:
            speculation.use(fixed(system))
            m = Measure()
            m.add_metrics(run_engine(llm, prompts, args.max_tokens)[2])
            fixed_lengths[system.key] = m.acceptance_length

    report.line(f"### Medusa and EAGLE heads, {datetime.date.today().isoformat()}")
    report.line()
    report.line(f"model {args.model}  dtype {args.dtype}  target on {llm.engine.device}  torch {torch.__version__}  "
                f"threads {torch.get_num_threads()}  heads {args.medusa_heads}, {args.eagle_head}, {args.eagle3_head}"
                f"{'  heads int8' if args.draft_quantization == 'int8' else ''}"
                f"{'  enforce_eager' if args.enforce_eager else ''}")
    report.line(f"greedy, at most {args.max_tokens} new tokens per request, {len(prompts)} held-out chat prompts one "
                f"at a time, median of {args.repeats} rounds after a warm-up; adaptive speculation on (accept len), "
                f"then off (fixed: {DEFAULT_SPECULATIVE_TOKENS['eagle']} nodes for EAGLE unless the row says, "
                f"{DEFAULT_SPECULATIVE_TOKENS['eagle'] + DEFAULT_SPECULATIVE_TOKENS['lookahead']} with lookahead, "
                f"{DEFAULT_SPECULATIVE_TOKENS['medusa']} for Medusa, every step)")
    report.line()
    plain, hf_rate = measures["plain"].rate, measures["hf"].rate
    rows = []
    for system in systems:
        m = measures[system.key]
        rows.append((system.label, f"{m.rate:.1f}", ratio(m.rate, plain), ratio(m.rate, hf_rate),
                     "-" if m.acceptance_length is None else f"{m.acceptance_length:.2f}",
                     "-" if fixed_lengths.get(system.key) is None else f"{fixed_lengths[system.key]:.2f}"))
        report.data.setdefault("rows", []).append({"system": system.key, "label": system.label, **m.summary(),
                                                   "fixed_acceptance_length": fixed_lengths.get(system.key)})
    report.table(("system", "tok/s", "vs ours plain", "vs HF plain", "accept len", "fixed"), rows)
    where = head_devices[0]
    report.line()
    for key, name, targets in (("eagle-tree", "EAGLE-2 (EAGLE head, trees)", " (targets: >= 2.5, >= 1.8x)"),
                               ("medusa", "Medusa", " (target: >= 1.8)"),
                               ("eagle3-tree", "EAGLE-3 head, EAGLE-2 trees", ""),
                               ("eagle3-wide", f"EAGLE-3 head, EAGLE-2's trees ({PAPER_TREE})", ""),
                               ("eagle3-lookahead", "EAGLE-3 trees + lookahead", "")):
        m = measures.get(f"{key}-{where}")
        if m is not None:
            report.line(f"{name}: acceptance length {m.acceptance_length or 0:.2f}, "
                        f"fixed {fixed_lengths[f'{key}-{where}'] or 0:.2f}, {m.rate / plain:.2f}x our plain{targets}")
    report.write()
    llm.engine.close()


if __name__ == "__main__":
    main()
