"""Where one decode step's time goes: the engine, the runner's input preparation, the model's
forward (split by operator kind with torch.profiler) and the LM head, for single-stream
greedy decoding (or --batch requests at once), plain or speculative (--speculator: then a
step verifies a draft, and the proposers' drafting is split out of the engine's share).

The engine's own work (scheduling, proposing, sampling, committing, detokenizing) is the
step's wall time minus `ModelRunner.execute`; the runner's preparation (token, position,
slot and mask tensors) is `execute` minus the model's forward and the LM head. Medians over
the timed steps; the operator table comes from a second, profiled run. The engine runs
eagerly (enforce_eager), so that the model's operators can be told apart: the compiled decode
step, the default on the CPU, fuses them.

The tables go to stdout and to benchmarks/results/<date>-profile_step.md (and .json).

    python -m scripts.profile_step
    python -m scripts.profile_step --batch 32 --max-tokens 64
    python -m scripts.profile_step --speculator eagle --eagle-head models/eagle3-smollm2 --fixed
    python -m scripts.profile_step --max-tokens 8 --speculator lookahead   # smoke test
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from runtime import LLM, SamplingParams
from scripts.harness import Report, add_results_args, proposers

PROMPT = "Explain how a hash table works."
# operator name -> kind, for the forward's split
KINDS = {"aten::mm": "matmul", "aten::addmm": "matmul", "aten::linear": "matmul", "aten::bmm": "matmul",
         "mkldnn::_linear_pointwise": "matmul",  # bf16 weights prepacked for oneDNN (runtime/models/packed_linear.py)
         "aten::_weight_int8pack_mm": "matmul", "aten::_weight_int4pack_mm_for_cpu": "matmul",
         "heterospec_cpu::quant_linear": "matmul",  # int4/int8 weights (runtime/models/quant_linear.py)
         "aten::_scaled_dot_product_flash_attention_for_cpu": "attention (SDPA)",
         "aten::scaled_dot_product_attention": "attention (SDPA)",
         "aten::index": "KV gather / index", "aten::index_copy_": "KV write", "aten::index_select": "KV gather / index"}


class Timer:
    """Wraps obj.name so that every call's wall time is appended to self.times."""

    def __init__(self, obj, name: str):
        self.times: list[float] = []
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.times.append(time.perf_counter() - start)
        setattr(obj, name, timed)


def op_split(llm: LLM, prompts: list[str], params: SamplingParams) -> dict[str, float]:
    """Self CPU time (ms) per operator kind over one profiled run."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    kinds: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        kinds[KINDS.get(event.key, "other operators")] += event.self_cpu_time_total / 1000
    return kinds


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default="auto", help="auto | none | int8 | int4 (default: auto)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=1, help="requests at once (default: 1, single stream)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--speculator", default="none", help="e.g. eagle, lookahead, eagle+lookahead (default: none)")
    p.add_argument("--eagle-head", default=None, help="speculator eagle: the head's directory")
    p.add_argument("--num-speculative-tokens", type=int, default=None, help="draft nodes (default: the speculator's)")
    p.add_argument("--speculative-tree-width", type=int, default=None, help="most children per node (default: the "
                                                                            "speculator's)")
    p.add_argument("--fixed", action="store_true", help="adaptive speculation off: every step drafts the whole tree")
    add_results_args(p, "profile_step")
    args = p.parse_args(argv)
    report = Report(args.name, "profile_step: where one decode step's time goes", "scripts.profile_step", argv, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, quantization=args.quantization,
              max_num_seqs=max(args.batch, 1), seed=0, enforce_eager=True,
              speculator=args.speculator, eagle_head=args.eagle_head, adaptive_speculation=not args.fixed,
              num_speculative_tokens=args.num_speculative_tokens, speculative_tree_width=args.speculative_tree_width)
    engine, runner = llm.engine, llm.engine.runner
    prompts = [PROMPT] * args.batch
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)  # warm-up

    step, execute = Timer(engine, "step"), Timer(runner, "execute")
    forward, logits = Timer(runner.model, "forward"), Timer(runner.model, "compute_logits")
    drafting = [Timer(proposer, "propose") for proposer in proposers(engine).values()]
    results = llm.generate(prompts, params, use_tqdm=False)
    timed = {name: t.times[1:] for name, t in (("step", step), ("execute", execute), ("forward", forward),
                                               ("logits", logits))}  # [0] is the prefill
    med = {name: 1000 * statistics.median(times) for name, times in timed.items()}
    num_steps = len(timed["forward"])
    # proposers draft once per step (the prefill's step included): their summed time per step
    med["drafting"] = 1000 * sum(sum(t.times) for t in drafting) / max(num_steps + 1, 1)
    output_tokens = sum(len(r.token_ids) for r in results) - args.batch  # past the prefill's first tokens
    tokens_per_step = output_tokens / max(num_steps, 1) / args.batch
    before = len(forward.times)
    kinds = op_split(llm, prompts, params)
    profiled_steps = len(forward.times) - before
    forward_ops = {k: v / profiled_steps for k, v in kinds.items()}  # ms per step, profiled (slower) run
    total_ops = sum(forward_ops.values())

    speculation = "" if args.speculator == "none" else (
        f", speculator {args.speculator} ({'fixed' if args.fixed else 'adaptive'}), "
        f"{tokens_per_step:.2f} tokens per step per request")
    report.line(f"{args.model} {args.dtype} on {engine.device}, batch {args.batch}, {args.max_tokens} tokens, "
                f"torch {torch.__version__}, {torch.get_num_threads()} threads; medians over {num_steps} decode steps"
                + speculation)
    report.line()
    parts = [("engine (schedule, sample, commit, detokenize)", med["step"] - med["execute"] - med["drafting"]),
             ("drafting (the proposers' propose, mean)", med["drafting"]),
             ("runner input preparation (ids, slots, masks)", med["execute"] - med["forward"] - med["logits"]),
             ("model forward", med["forward"]),
             ("LM head (logits)", med["logits"])]
    if args.speculator == "none":
        del parts[1]
    rate = 1000 / med["step"] * args.batch * (tokens_per_step if args.speculator != "none" else 1)
    report.table(("part of a decode step", "ms", "share"),
                 [(name, f"{ms:.2f}", f"{ms / med['step']:.0%}") for name, ms in parts]
                 + [(f"whole step ({rate:.1f} tok/s)", f"{med['step']:.2f}", "100%")])
    report.line()
    report.line("profiled run, operators' self CPU time per step (profiler overhead included):")
    report.line()
    report.table(("operator kind", "ms", "share"),
                 [(kind, f"{ms:.2f}", f"{ms / total_ops:.0%}")
                  for kind, ms in sorted(forward_ops.items(), key=lambda kv: -kv[1])])
    report.data.update(step_ms=dict(parts, whole_step=med["step"]), tok_per_s=rate, num_steps=num_steps,
                       tokens_per_step_per_request=tokens_per_step, operators_ms_per_step=forward_ops)
    report.write()


if __name__ == "__main__":
    main()
