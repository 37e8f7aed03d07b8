"""Medusa and EAGLE heads against plain decoding, the lookahead proposer and HF transformers, in one run.

Heads are trained here first when their directories are missing (scripts/train_medusa.py and
scripts/train_eagle.py, self-distillation sharing their corpora: for the default model the
answers shipped in speculators/data (greedy, sampled and varied), else written from the shipped
training prompts;
--train-minutes each). Then, on held-out chat prompts (speculators/data/heldout_prompts.jsonl,
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
length >= 2.5, Medusa >= 1.8, EAGLE-2 >= 1.8x our plain.

    .venv/bin/python scripts/bench_heads.py                               # trains (~40 min) then measures
    .venv/bin/python scripts/bench_heads.py --limit 4 --max-tokens 32 --repeats 1   # smoke test
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics
import sys
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from runtime import LLM  # noqa: E402
from speculators import registry  # noqa: E402
from speculators.eagle import DEFAULT_DEPTH as DEFAULT_EAGLE_DEPTH  # noqa: E402
DEFAULT_SPECULATIVE_TOKENS = {s.name: s.num_speculative_tokens for s in registry.speculators().values()}
from runtime.speculation import SpeculationController  # noqa: E402
from runtime.models.loader import DTYPES, load_tokenizer, resolve_model  # noqa: E402
from speculators.training import default_prompt_file, load_prompts  # noqa: E402

from bench_decode import load_hf  # noqa: E402  (scripts/ is on sys.path when run as a script)
from bench_spec import Measure, System, add_metrics, print_table, ratio, run_engine, run_hf, use_system  # noqa: E402


class TreeSize(NamedTuple):
    depth: int
    width: int
    nodes: int

    def __str__(self) -> str:
        return f"depth {self.depth}, top-{self.width}, {self.nodes} nodes"


# EAGLE-2's published tree for GPU targets (6 expansion steps, top-10, 60 verified nodes), against
# the engine's CPU-sized default (runtime/config.py)
PAPER_TREE = TreeSize(depth=6, width=10, nodes=60)


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
        import train_medusa
        print(f"training Medusa heads -> {args.medusa_heads}", file=sys.stderr)
        train_medusa.main(common + ["--out", args.medusa_heads])
    import train_eagle
    if (selected(args, "eagle-chain-") or selected(args, "eagle-tree-")) and not Path(args.eagle_head).exists():
        print(f"training the EAGLE head -> {args.eagle_head}", file=sys.stderr)
        train_eagle.main(common + ["--out", args.eagle_head])
    wants_eagle3 = any(selected(args, f"eagle3-{kind}-") for kind in ("chain", "tree", "lookahead"))
    if args.eagle3_head != "none" and wants_eagle3 and not Path(args.eagle3_head).exists():
        print(f"training the EAGLE-3 head -> {args.eagle3_head}", file=sys.stderr)
        train_eagle.main(common + ["--out", args.eagle3_head, "--eagle3", "--unroll", "3", "--steps", "2400"])


def make_systems(args, head_devices: list[str]) -> list[tuple[System, str | None]]:
    """(system, head device) pairs; the device is None for systems without heads. EAGLE-3
    systems' keys start with "eagle3"."""
    rows = [(System("hf", "HF plain"), None), (System("plain", "ours plain", "none"), None)]
    for device in head_devices:
        where = f" (heads on {device})"
        rows += [(System(f"medusa-{device}", "ours Medusa" + where, "medusa", None), device),
                 (System(f"eagle-chain-{device}", "ours EAGLE chain" + where, "eagle", 1), device),
                 (System(f"eagle-tree-{device}", f"ours EAGLE-2 tree (top-{args.eagle_width})" + where, "eagle",
                         args.eagle_width), device)]
        if args.eagle3_head != "none":
            rows += [(System(f"eagle3-chain-{device}", "ours EAGLE-3 chain" + where, "eagle", 1), device),
                     (System(f"eagle3-tree-{device}", f"ours EAGLE-3 tree (top-{args.eagle_width})" + where,
                             "eagle", args.eagle_width), device),
                     (System(f"eagle3-wide-{device}", f"ours EAGLE-3 tree, EAGLE-2's size ({PAPER_TREE})" + where,
                             "eagle", PAPER_TREE.width, num_tokens=PAPER_TREE.nodes, eagle_depth=PAPER_TREE.depth),
                      device),
                     (System(f"eagle3-lookahead-{device}", "ours EAGLE-3 tree + lookahead" + where,
                             "eagle+lookahead", None), device)]
    rows.append((System("lookahead", "ours lookahead (width 3)", "lookahead", 3), None))
    rows = [(system, device) for system, device in rows if selected(args, system.key)]
    if args.fixed_rows:
        rows += [(dataclasses.replace(system, key=system.key + "-fixed", label=system.label + ", fixed",
                                      proposers={}, controller=SpeculationController(adaptive=False)), device)
                 for system, device in rows if system.speculator not in (None, "none")]
    return rows


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ensure_heads(args)
    head_devices = ([d.strip() for d in args.head_devices.split(",")] if args.head_devices
                    else ["cpu"] + ([args.device] if args.device != "cpu" else []))
    prompts = load_prompts(default_prompt_file("heldout"), args.limit)
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, seed=0, medusa_heads=args.medusa_heads,
              eagle_head=args.eagle_head, draft_quantization=args.draft_quantization)
    hf = load_hf(args.model, DTYPES[args.dtype], args.device)
    hf_tok = load_tokenizer(resolve_model(args.model))
    eos_ids = list(llm.engine.model_config.eos_token_ids)
    hf_ids = [list(hf_tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True)) for p in prompts]
    systems = make_systems(args, head_devices)

    def select(system: System, device: str | None) -> None:
        llm.engine.config.draft_device = device or "auto"
        llm.engine.config.eagle_head = args.eagle3_head if system.key.startswith("eagle3") else args.eagle_head
        llm.engine.config.num_speculative_tokens = system.num_tokens
        llm.engine.config.eagle_depth = system.eagle_depth or DEFAULT_EAGLE_DEPTH  # read as the proposer is built
        use_system(llm, system, True)

    for system, device in systems:  # warm-up (and build each system's proposers on its device)
        if system.is_hf:
            run_hf(hf, hf_ids[0], 16, eos_ids, 0)
        else:
            select(system, device)
            run_engine(llm, prompts[:1], 16)
    measures = {s.key: Measure() for s, _ in systems}
    for r in range(args.repeats):
        for system, device in systems:
            m = measures[system.key]
            tokens = seconds = 0
            if system.is_hf:
                for ids in hf_ids:
                    n, sec, _ = run_hf(hf, ids, args.max_tokens, eos_ids, 0)
                    tokens, seconds = tokens + n, seconds + sec
            else:
                select(system, device)
                for prompt in prompts:
                    n, sec, results = run_engine(llm, [prompt], args.max_tokens)
                    tokens, seconds = tokens + n, seconds + sec
                    if system.speculator != "none":
                        add_metrics(m, results)
            m.rounds.append((tokens, seconds))
            print(f"round {r + 1}/{args.repeats} {system.label:44s} {tokens:5d} tokens {seconds:7.2f} s "
                  f"{tokens / seconds:7.1f} tok/s", file=sys.stderr)

    fixed = {}  # system key -> acceptance length with every step's whole tree (adaptive off)
    for system, device in systems:
        if system.key.endswith("-fixed"):  # timed that way already
            fixed[system.key] = measures[system.key].acceptance_length
        elif system.speculator not in (None, "none"):
            select(system, device)
            llm.engine.spec_controller = SpeculationController(adaptive=False)
            m = Measure()
            add_metrics(m, run_engine(llm, prompts, args.max_tokens)[2])
            fixed[system.key] = m.acceptance_length

    print(f"\n### Medusa and EAGLE heads, {datetime.date.today().isoformat()}\n")
    print(f"model {args.model}  dtype {args.dtype}  target on {llm.engine.device}  torch {torch.__version__}  "
          f"threads {torch.get_num_threads()}  heads {args.medusa_heads}, {args.eagle_head}, {args.eagle3_head}"
          f"{'  heads int8' if args.draft_quantization == 'int8' else ''}")
    print(f"greedy, at most {args.max_tokens} new tokens per request, {len(prompts)} held-out chat prompts one at a "
          f"time, median of {args.repeats} rounds after a warm-up; adaptive speculation on (accept len), then "
          f"off (fixed: {DEFAULT_SPECULATIVE_TOKENS['eagle']} nodes for EAGLE unless the row says, "
          f"{DEFAULT_SPECULATIVE_TOKENS['eagle'] + DEFAULT_SPECULATIVE_TOKENS['lookahead']} with lookahead, "
          f"{DEFAULT_SPECULATIVE_TOKENS['medusa']} for Medusa, every step)\n")
    plain, hf_rate = measures["plain"].rate, measures["hf"].rate
    rows = []
    for system, _ in systems:
        m = measures[system.key]
        length, fixed_length = m.acceptance_length, fixed.get(system.key)
        rows.append((system.label, f"{m.rate:.1f}", ratio(m.rate, plain), ratio(m.rate, hf_rate),
                     "-" if length is None else f"{length:.2f}", "-" if fixed_length is None else f"{fixed_length:.2f}"))
    print_table(("system", "tok/s", "vs ours plain", "vs HF plain", "accept len", "fixed"), rows)
    rates = {k: statistics.median(n / s for n, s in m.rounds) for k, m in measures.items()}
    where = head_devices[0]
    print()
    for key, name, targets in (("eagle-tree", "EAGLE-2 (EAGLE head, trees)", " (targets: >= 2.5, >= 1.8x)"),
                               ("medusa", "Medusa", " (target: >= 1.8)"),
                               ("eagle3-tree", "EAGLE-3 head, EAGLE-2 trees", ""),
                               ("eagle3-wide", f"EAGLE-3 head, EAGLE-2's trees ({PAPER_TREE})", ""),
                               ("eagle3-lookahead", "EAGLE-3 trees + lookahead", "")):
        m = measures.get(f"{key}-{where}")
        if m is not None:
            print(f"{name}: acceptance length {m.acceptance_length or 0:.2f}, "
                  f"fixed {fixed[f'{key}-{where}'] or 0:.2f}, {rates[f'{key}-{where}'] / plain:.2f}x our plain{targets}")


if __name__ == "__main__":
    main()
