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

from runtime.engine import LLMEngine  # noqa: E402
from runtime.models.loader import DEFAULT_MODEL  # noqa: E402
from speculators.eagle import EagleHead, save_head  # noqa: E402
from speculators.training import (default_prompt_file, eagle_data, generate_corpus, load_corpus,  # noqa: E402
                                  load_prompts, save_corpus, train_eagle)


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
    p.add_argument("--steps", type=int, default=1500, help="optimizer steps (default: 1500)")
    p.add_argument("--sequences-per-step", type=int, default=4, help="answers averaged per step (default: 4)")
    p.add_argument("--minutes", type=float, default=None, help="stop training after this many minutes")
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default: 3e-4)")
    p.add_argument("--noise", type=float, default=0.1, help="uniform noise added to input features (default: 0.1)")
    p.add_argument("--eval-every", type=int, default=100, help="validate (and checkpoint) every N steps")
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
    train = eagle_data(model, samples[num_val:])
    val = eagle_data(model, samples[:num_val])
    print(f"{len(train)} training answers, {len(val)} validation answers")
    head = EagleHead(model.config, model.embed_tokens, model.lm_head).float()
    head.to(model.embed_tokens.weight.device)
    model.requires_grad_(False)
    extra = {"base_model": args.model, "training": {"answers": len(samples), "max_tokens": args.max_tokens}}

    def checkpoint(step, val_loss, val_accuracy):
        save_head(head, out, {**extra, "step": step, "val_loss": val_loss, "val_depth1_accuracy": val_accuracy})

    result = train_eagle(head, train, val, args.steps, args.lr, args.sequences_per_step, args.noise,
                         None if args.minutes is None else 60 * args.minutes, args.eval_every, args.seed, checkpoint)
    print(f"done in {time.perf_counter() - start:.0f} s: validation depth-1 top-1 accuracy "
          f"{result['val_accuracy']:.2f} (loss {result['val_loss']:.3f}) -> {out}")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
