"""Train an EAGLE head for a target model by self-distillation, on the CPU or a GPU.

The target answers a prompt set (default: the package's speculators/data/train_prompts.jsonl)
through our engine, its hidden states (features) are recorded, and the head learns to
predict the target's next feature and, through the target's LM head, its token after
next (speculators/training.py: feature regression + token cross-entropy, with EAGLE's
feature noise). Writes a checkpoint
in the public EAGLE layout (model.safetensors + config.json) that `--speculator eagle
--eagle-head DIR` loads.

    python scripts/train_eagle.py --out models/eagle-smollm2             # default model, ~15 min here
    python -m runtime.generate --speculator eagle --eagle-head models/eagle-smollm2 ...
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from speculators.eagle import EagleHead, load_head, save_head  # noqa: E402
from speculators.training import (add_self_distillation_args, eagle_data, self_distillation_corpus,  # noqa: E402
                                  train_eagle)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_self_distillation_args(p)
    p.add_argument("--steps", type=int, default=1500, help="optimizer steps (default: 1500)")
    p.add_argument("--sequences-per-step", type=int, default=4, help="answers averaged per step (default: 4)")
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default: 3e-4)")
    p.add_argument("--noise", type=float, default=0.1, help="uniform noise added to input features (default: 0.1)")
    p.add_argument("--eval-every", type=int, default=100, help="validate (and checkpoint) every N steps")
    p.add_argument("--unroll", type=int, default=1,
                   help="drafting steps the head is trained on, each reading its own previous prediction "
                        "(training-time test; default: 1 = depth 1 only)")
    p.add_argument("--init-head", default=None, help="start from this head checkpoint instead of random weights")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(args.seed)
    out = Path(args.out)
    engine, train_samples, val_samples = self_distillation_corpus(args)
    start = time.perf_counter()
    model = engine.model
    train = eagle_data(model, train_samples)
    val = eagle_data(model, val_samples)
    print(f"{len(train)} training answers, {len(val)} validation answers")
    if args.init_head:
        head = load_head(args.init_head, model.config, model.embed_tokens, model.lm_head).float()
    else:
        head = EagleHead(model.config, model.embed_tokens, model.lm_head).float()
    head.to(model.embed_tokens.weight.device)
    model.requires_grad_(False)
    extra = {"base_model": args.model,
             "training": {"answers": len(train_samples) + len(val_samples), "max_tokens": args.max_tokens,
                          "unroll": args.unroll, "init_head": args.init_head}}

    def checkpoint(step, val_loss, val_accuracy):
        save_head(head, out, {**extra, "step": step, "val_loss": val_loss, "val_depth1_accuracy": val_accuracy})

    result = train_eagle(head, train, val, args.steps, args.lr, args.sequences_per_step, args.noise,
                         None if args.minutes is None else 60 * args.minutes, args.eval_every, args.seed, checkpoint,
                         unroll=args.unroll)
    print(f"trained in {time.perf_counter() - start:.0f} s: validation depth-1 top-1 accuracy "
          f"{result['val_accuracy']:.2f} (loss {result['val_loss']:.3f}) -> {out}")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
