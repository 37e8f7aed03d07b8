"""Train Medusa heads for a target model by self-distillation, on the CPU or a GPU.

The target answers a prompt set (default: the package's speculators/data/train_prompts.jsonl)
through our engine, its hidden states are recorded, and K heads learn to predict the
target's own next tokens (speculators/training.py). Writes a checkpoint in the public
Medusa layout (medusa_lm_head.safetensors + config.json) that `--speculator medusa
--medusa-heads DIR` loads.

    python scripts/train_medusa.py --out models/medusa-smollm2           # default model, ~10 min here
    python -m runtime.generate --speculator medusa --medusa-heads models/medusa-smollm2 ...
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from runtime.engine import LLMEngine  # noqa: E402
from runtime.models.loader import DEFAULT_MODEL  # noqa: E402
from speculators.medusa import MedusaHeads, save_heads  # noqa: E402
from speculators.training import (default_prompt_file, generate_corpus, load_corpus, load_prompts,  # noqa: E402
                                  medusa_data, save_corpus, train_medusa)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="target model: alias, .gguf file or HF directory")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--data", default=None, help="prompt JSONL ({'prompt'} or {'messages'} per line; default: the "
                                                "shipped training prompts)")
    p.add_argument("--num-prompts", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--corpus", default=None, help="JSONL of the target's answers: read when it exists, else "
                                                  "written (default: OUT/corpus.jsonl)")
    p.add_argument("--max-tokens", type=int, default=192, help="tokens per answer (default: 192)")
    p.add_argument("--temperature", type=float, default=0.0, help="the target's sampling temperature for the "
                                                                   "corpus (default: 0 = greedy)")
    p.add_argument("--num-heads", type=int, default=4, help="Medusa heads (default: 4)")
    p.add_argument("--num-layers", type=int, default=1, help="residual blocks per head (default: 1)")
    p.add_argument("--own-lm-head", action="store_true", help="give each head its own vocabulary projection "
                   "(initialised from the target's; more memory and slower training) instead of sharing the target's")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps (default: 2000)")
    p.add_argument("--minutes", type=float, default=None, help="stop training after this many minutes")
    p.add_argument("--batch-size", type=int, default=256, help="positions per step (default: 256)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default: 1e-3)")
    p.add_argument("--eval-every", type=int, default=250, help="validate (and checkpoint) every N steps")
    p.add_argument("--val-fraction", type=float, default=0.05, help="answers held out for validation")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (the target and the training)")
    p.add_argument("--dtype", default="auto", help="the target's dtype while writing the corpus (default: auto)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    engine = LLMEngine(model=args.model, device=args.device, dtype=args.dtype, max_num_seqs=64, seed=args.seed)
    corpus_path = Path(args.corpus) if args.corpus else out / "corpus.jsonl"
    start = time.perf_counter()
    if corpus_path.exists():
        samples = load_corpus(corpus_path, args.model)
        print(f"corpus: {len(samples)} answers from {corpus_path}")
    else:
        prompts = load_prompts(args.data or default_prompt_file("train"), args.num_prompts)
        samples = generate_corpus(engine, prompts, args.max_tokens, args.temperature, args.seed)
        save_corpus(samples, corpus_path, args.model)
        print(f"corpus: {len(samples)} answers in {time.perf_counter() - start:.0f} s -> {corpus_path}")
    num_val = max(1, int(len(samples) * args.val_fraction))
    model = engine.model
    train = medusa_data(model, samples[num_val:], args.num_heads)
    val = medusa_data(model, samples[:num_val], args.num_heads)
    print(f"{len(train)} training positions, {len(val)} validation positions")
    cfg = model.config
    heads = MedusaHeads(cfg.hidden_size, cfg.vocab_size, args.num_heads, args.num_layers,
                        None if args.own_lm_head else model.lm_head)
    if args.own_lm_head:
        for head in heads.lm_heads:
            head.weight.data.copy_(model.lm_head.weight.detach().float())
    heads.to(model.embed_tokens.weight.device)
    model.requires_grad_(False)
    extra = {"base_model": args.model, "training": {"answers": len(samples), "max_tokens": args.max_tokens}}

    def checkpoint(step, val_loss, val_acceptance):
        save_heads(heads, out, {**extra, "step": step, "val_loss": val_loss, "val_acceptance": val_acceptance})

    result = train_medusa(heads, train, val, args.steps, args.lr, args.batch_size,
                          None if args.minutes is None else 60 * args.minutes, args.eval_every, args.seed, checkpoint)
    print(f"done in {time.perf_counter() - start:.0f} s: validation top-1 chain acceptance "
          f"{result['val_acceptance']:.2f} (loss {result['val_loss']:.3f}) -> {out}")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
