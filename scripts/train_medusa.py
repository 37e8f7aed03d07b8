"""Train Medusa heads for a target model by self-distillation, on the CPU or a GPU.

The target answers a prompt set (default: training/data/train_prompts.jsonl) through our
engine, its hidden states are recorded, and K heads learn to predict the target's own
next tokens (training/medusa.py). Writes a checkpoint in the public
Medusa layout (medusa_lm_head.safetensors + config.json) that `--speculator medusa
--medusa-heads DIR` loads.

    python -m scripts.train_medusa --out models/medusa-smollm2           # default model, ~10 min here
    python -m runtime.generate --speculator medusa --medusa-heads models/medusa-smollm2 ...
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

from speculators.medusa import MedusaHeads, load_heads, save_heads
from training.common import (add_self_distillation_args, corpus_paths, draft_vocabulary, self_distillation_corpus,
                             trainable_lm_head)
from training.medusa import medusa_data, train_medusa


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_self_distillation_args(p)
    p.add_argument("--num-heads", type=int, default=4, help="Medusa heads (default: 4)")
    p.add_argument("--num-layers", type=int, default=1, help="residual blocks per head (default: 1)")
    p.add_argument("--shared-lm-head", action="store_true", help="project every head through the target's LM "
                   "head (its draft-vocabulary rows) instead of a projection of its own, started as those rows: "
                   "less memory, lower acceptance (validation tree acceptance 1.95 against 2.18 for the default "
                   "model after 3000 steps)")
    p.add_argument("--read-token", action=argparse.BooleanOptionalAction, default=True,
                   help="every head also reads the tree's root token, the one the target just chose (default: on; "
                        "--no-read-token: Medusa's heads, which see the hidden state alone)")
    p.add_argument("--draft-vocab", type=int, default=8192, help="the heads' vocabulary: the tokens the corpus "
                   "writes most (default: 8192; 0 = the target's whole vocabulary)")
    p.add_argument("--steps", type=int, default=3000, help="optimizer steps (default: 3000)")
    p.add_argument("--batch-size", type=int, default=256, help="positions per step (default: 256)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default: 1e-3)")
    p.add_argument("--eval-every", type=int, default=250, help="validate (and checkpoint) every N steps")
    p.add_argument("--init-heads", default=None, help="start from this Medusa checkpoint (its heads, blocks and LM "
                                                      "head sharing) instead of fresh heads")
    return p.parse_args(argv)


def new_heads(args, model, train_samples) -> MedusaHeads:
    """The heads to train: from --init-heads, else fresh ones over the draft vocabulary of
    the training answers (a residual block starts as the identity, an own LM head as the
    target's rows)."""
    cfg = model.config
    lm_head = trainable_lm_head(model.lm_head)  # shared heads train through the target's
    if args.init_heads:
        return load_heads(args.init_heads, cfg.hidden_size, cfg.vocab_size, lm_head, model.embed_tokens).float()
    draft_vocab = (draft_vocabulary(train_samples, args.draft_vocab, cfg.eos_token_ids)
                   if 0 < args.draft_vocab < cfg.vocab_size else torch.arange(cfg.vocab_size))  # [Vd] target ids
    heads = MedusaHeads(cfg.hidden_size, cfg.vocab_size, args.num_heads, args.num_layers,
                        lm_head if args.shared_lm_head else None, len(draft_vocab),
                        args.read_token, model.embed_tokens)
    heads.set_draft_vocab(draft_vocab)
    if not args.shared_lm_head:
        for head in heads.lm_heads:
            head.weight.data.copy_(model.lm_head.weight.detach().float()[draft_vocab])
    return heads


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(args.seed)
    out = Path(args.out)
    engine, train_samples, val_samples = self_distillation_corpus(args)
    if args.corpus_only:
        engine.close()
        return 0
    start = time.perf_counter()
    model = engine.model
    heads = new_heads(args, model, train_samples).to(model.embed_tokens.weight.device)
    train = medusa_data(model, train_samples, heads.num_heads, heads.reads_token)
    val = medusa_data(model, val_samples, heads.num_heads, heads.reads_token)
    print(f"{len(train)} training positions, {len(val)} validation positions")
    model.requires_grad_(False)
    extra = {"base_model": args.model,
             "training": {"corpora": [path.name for path in corpus_paths(args)],
                          "validation": Path(args.val_prompts).name if args.val_prompts else "first corpus",
                          "answers": len(train_samples) + len(val_samples),
                          "max_tokens": args.max_tokens, "init_heads": args.init_heads,
                          "max_answers": args.max_answers}}

    def checkpoint(figures):
        save_heads(heads, out, {**extra, **figures})

    result = train_medusa(heads, train, val, args.steps, args.lr, args.batch_size,
                          None if args.minutes is None else 60 * args.minutes, args.eval_every, args.seed, checkpoint)
    print(f"trained in {time.perf_counter() - start:.0f} s: validation acceptance per step "
          f"{result['val_tree_acceptance']:.2f} (tree), {result['val_chain_acceptance']:.2f} (top-1 chain), "
          f"loss {result['val_loss']:.3f} -> {out}")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
