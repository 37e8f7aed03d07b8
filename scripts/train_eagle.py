"""Train an EAGLE head for a target model by self-distillation, on the CPU or a GPU.

The target answers a prompt set (default: training/data/train_prompts.jsonl) through our
engine, its hidden states (features) are recorded, and the head learns to predict the
target's token after next (training/eagle.py). An EAGLE-1/2 head reads
the final hidden state, guesses the next one (feature regression, with EAGLE's feature
noise) and shares the target's LM head. With --eagle3, an EAGLE-3 head reads three
layers' inputs and has its own LM head over the --draft-vocab tokens the target writes
most (initialised from the target's rows). --unroll K trains on the head's own drafts
(training-time test); --soft-labels K against the target's top-K distribution instead of
its greedy token. --feature-cache DIR keeps the target's states for the next run. Writes
a checkpoint in the public EAGLE (or EAGLE-3) layout (model.safetensors + config.json)
that `--speculator eagle --eagle-head DIR` loads.

    python -m scripts.train_eagle --out models/eagle-smollm2             # default model, ~15 min here
    python -m scripts.train_eagle --eagle3 --unroll 3 --out models/eagle3-smollm2
    python -m runtime.generate --speculator eagle --eagle-head models/eagle-smollm2 ...
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

from speculators.eagle_heads import EagleHead, load_head, new_eagle3_head, save_head
from training.common import (add_self_distillation_args, corpus_paths, draft_vocabulary, self_distillation_corpus,
                             trainable_lm_head)
from training.eagle import eagle_data, train_eagle


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_self_distillation_args(p)
    p.add_argument("--steps", type=int, default=1500, help="optimizer steps (default: 1500)")
    p.add_argument("--sequences-per-step", type=int, default=4, help="answers averaged per step (default: 4)")
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default: 3e-4)")
    p.add_argument("--noise", type=float, default=None,
                   help="uniform noise added to input features (default: 0.1 for an EAGLE-1 head; 0 for an "
                        "EAGLE-3 one, new or from --init-head)")
    p.add_argument("--eval-every", type=int, default=100, help="validate (and checkpoint) every N steps")
    p.add_argument("--unroll", type=int, default=1,
                   help="drafting steps the head is trained on, each reading its own previous prediction "
                        "(training-time test; default: 1 = depth 1 only)")
    p.add_argument("--init-head", default=None, help="start from this head checkpoint instead of random weights")
    p.add_argument("--eagle3", action="store_true", help="train an EAGLE-3 head (multi-layer features, own LM head)")
    p.add_argument("--draft-vocab", type=int, default=8192,
                   help="--eagle3: the draft vocabulary, the corpus's most written tokens (default: 8192)")
    p.add_argument("--feature-layers", default=None,
                   help="--eagle3: target layers whose inputs the head reads, e.g. 2,15,27 (default: 2, L/2, L-3)")
    p.add_argument("--soft-labels", type=int, default=0, metavar="K",
                   help="train against the target's next-token distribution, its top K tokens (EAGLE-3's "
                        "soft labels), instead of its greedy token (default: 0 = greedy tokens)")
    p.add_argument("--save-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the checkpoint's weights (default: float32; bfloat16 halves the file: the shipped "
                        "head is saved so)")
    p.add_argument("--feature-cache", default=None, metavar="DIR",
                   help="keep the target's states of the corpora here (about 1 GB per 1,000 answers of the "
                        "default model): a later training with the same target, corpora, feature layers and "
                        "--soft-labels reads them instead of running the target again")
    return p.parse_args(argv)


def new_head(args, model, train_samples):
    """The head to train: from --init-head, else a new EAGLE-1 or EAGLE-3 head."""
    lm_head = trainable_lm_head(model.lm_head)  # an EAGLE-1 head trains through the target's
    if args.init_head:
        return load_head(args.init_head, model.config, model.embed_tokens, lm_head).float()
    if not args.eagle3:
        return EagleHead(model.config, model.embed_tokens, lm_head).float()
    layers = tuple(int(j) for j in args.feature_layers.split(",")) if args.feature_layers else None
    vocab = draft_vocabulary(train_samples, args.draft_vocab, model.config.eos_token_ids)
    answer_tokens = [t for s in train_samples for t in s.token_ids[s.num_prompt_tokens:]]
    covered = torch.isin(torch.tensor(answer_tokens), vocab).float().mean()
    print(f"draft vocabulary: {len(vocab)} tokens cover {covered:.1%} of the training answers' tokens")
    head = new_eagle3_head(model.config, model.embed_tokens, vocab, layers).float()
    with torch.no_grad():  # its final norm and LM head start as the target's
        head.norm.weight.copy_(model.norm.weight)
        head.lm_head.weight.copy_(model.lm_head.weight[vocab])
    return head


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
    head = new_head(args, model, train_samples).to(model.embed_tokens.weight.device)
    train = eagle_data(model, train_samples, head, top_k=args.soft_labels, cache_dir=args.feature_cache)
    val = eagle_data(model, val_samples, head)
    print(f"{len(train)} training answers, {len(val)} validation answers")
    model.requires_grad_(False)
    extra = {"base_model": args.model,
             "training": {"corpora": [path.name for path in corpus_paths(args)],
                          "validation": Path(args.val_prompts).name if args.val_prompts else "first corpus",
                          "answers": len(train_samples) + len(val_samples),
                          "max_tokens": args.max_tokens, "unroll": args.unroll, "init_head": args.init_head,
                          "soft_labels": args.soft_labels, "max_answers": args.max_answers}}

    def checkpoint(figures):
        save_head(head, out, {**extra, "step": figures["step"], "val_loss": figures["val_loss"],
                              "val_depth1_accuracy": figures["val_accuracy"],
                              "val_step_acceptance": figures["val_step_acceptance"]},
                  dtype=getattr(torch, args.save_dtype))

    noise = args.noise if args.noise is not None else (0.1 if head.regresses_features else 0.0)
    result = train_eagle(head, train, val, args.steps, args.lr, args.sequences_per_step, noise,
                         None if args.minutes is None else 60 * args.minutes, args.eval_every, args.seed, checkpoint,
                         unroll=args.unroll)
    print(f"trained in {time.perf_counter() - start:.0f} s: validation depth-1 top-1 accuracy "
          f"{result['val_accuracy']:.2f} (loss {result['val_loss']:.3f}), acceptance per step "
          f"{result['val_step_acceptance']:.2f} (fixed EAGLE-2 trees) -> {out}")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
