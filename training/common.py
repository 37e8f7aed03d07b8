"""Self-distillation for speculation heads: the target writes its own training text from
a prompt set, and heads learn to predict what the target does next.

  1. `generate_corpus`: the target (our engine, batched) answers every prompt; a sample is
     prompt + answer as token ids. Saved as JSONL so several trainings share one corpus.
  2. `target_states`: one causal forward of the target over a whole sample (dense
     attention, no KV cache) gives its final hidden states [T, H], the features the heads
     read at serving time, its greedy next token at every position and, for soft labels,
     its top next-token probabilities.

The heads' own data, losses and loops: training/medusa.py and training/eagle.py. The
prompt sets and the default model's answers are in training/data/.
"""
from __future__ import annotations

import gzip
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn


DATA = Path(__file__).resolve().parent / "data"  # the prompt sets and the default model's answers


@dataclass(slots=True)
class Sample:
    token_ids: list[int]  # prompt + the target's answer
    num_prompt_tokens: int


def default_prompt_file(split: str = "train") -> Path:
    """The prompt sets in training/data: 'train' (424 prompts, trains in minutes),
    'train_large' (2,265, training/make_prompts.py), 'train_varied' (1,424 of other request
    kinds, make_prompts.py --varied) or 'heldout'."""
    return DATA / f"{split}_prompts.jsonl"


SHIPPED_CORPORA = {  # model alias -> its answers in training/data, greedy first
    "smollm2-135m": ("smollm2-135m-train-large-greedy.jsonl.gz", "smollm2-135m-train-large-t0.8.jsonl.gz",
                     "smollm2-135m-train-varied-greedy.jsonl.gz"),
}


def shipped_corpora(model: str) -> list[Path]:
    """The answers in training/data for this model (none for other models), 192
    tokens at most: the default model's answers to the 2,265 'train_large' prompts, first
    greedy (float32; 79 minutes on a 2-core AVX2 CPU), then sampled at temperature 0.8
    (bf16, seed 2265 + the prompt's index, as a second --corpus writes them; 35 minutes on
    a 2-core AMX Xeon); then its greedy answers to the 1,424 'train_varied' prompts (bf16;
    14 minutes on a 2-core AVX-512 BF16 EPYC)."""
    paths = [DATA / name for name in SHIPPED_CORPORA.get(model, ())]
    return [path for path in paths if path.exists()]


def load_prompts(path: str | Path, limit: int | None = None) -> list:
    """Prompts from JSONL lines {"prompt": "..."} or {"messages": [{"role", "content"}, ...]}."""
    prompts = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        record = json.loads(line)
        prompt = record.get("messages", record.get("prompt"))
        if not prompt:
            raise ValueError(f"{path}:{number}: a prompt line needs 'prompt' or 'messages'")
        prompts.append(prompt)
    return prompts[:limit]


def generate_corpus(engine, prompts: list, max_tokens: int, temperature: float = 0.0, seed: int = 0,
                    progress: bool = True) -> list[Sample]:
    """The target's answers to every prompt (all queued at once, the engine batches them)."""
    from tqdm import tqdm
    from runtime.sampling_params import SamplingParams
    ids = {}
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i, speculator="none")
        ids[engine.add_request(prompt, params)] = i
    samples: list[Sample | None] = [None] * len(prompts)
    with tqdm(total=len(prompts), desc="target writes the corpus", unit="answer", disable=not progress) as bar:
        while engine.has_unfinished:
            for out in engine.step():
                if out.finished:
                    samples[ids[out.request_id]] = Sample(list(out.prompt_token_ids) + list(out.token_ids),
                                                          len(out.prompt_token_ids))
                    bar.update(1)
    return [s for s in samples if s is not None]


def _open_corpus(path: str | Path, mode: str):
    """A corpus file as text: gzip-compressed when its name ends in .gz."""
    return gzip.open(path, mode + "t") if str(path).endswith(".gz") else open(path, mode)


def save_corpus(samples: list[Sample], path: str | Path, model: str) -> None:
    with _open_corpus(path, "w") as f:
        for s in samples:
            f.write(json.dumps({"model": model, "token_ids": s.token_ids, "num_prompt_tokens": s.num_prompt_tokens})
                    + "\n")


def load_corpus(path: str | Path, model: str) -> list[Sample]:
    samples = []
    with _open_corpus(path, "r") as f:
        lines = f.read().splitlines()
    for line in lines:
        record = json.loads(line)
        if record["model"] != model:
            raise ValueError(f"corpus {str(path)!r} was written by {record['model']!r}, not {model!r}")
        samples.append(Sample(record["token_ids"], record["num_prompt_tokens"]))
    return samples


def add_self_distillation_args(parser) -> None:
    """The flags both training scripts share: the target, the prompts, the corpus, where to run."""
    from runtime.models.loader import DEFAULT_MODEL
    p = parser
    p.add_argument("--model", default=DEFAULT_MODEL, help="target model: alias, .gguf file or HF directory")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--data", default=None, help="prompt JSONL ({'prompt'} or {'messages'} per line; default: the "
                                                "shipped training prompts)")
    p.add_argument("--num-prompts", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--corpus", action="append", default=None,
                   help="JSONL (or .jsonl.gz) of the target's answers: read when it exists, else written "
                        "(default: the answers shipped for the default model when --data is not given, else "
                        "OUT/corpus.jsonl). Repeat it for more training text: the second and later corpora "
                        "are answers sampled at --extra-temperature, with their own seeds")
    p.add_argument("--max-tokens", type=int, default=192, help="tokens per answer (default: 192)")
    p.add_argument("--temperature", type=float, default=0.0, help="the target's sampling temperature for the "
                                                                   "first corpus (default: 0 = greedy)")
    p.add_argument("--extra-temperature", type=float, default=0.8,
                   help="the sampling temperature of the second and later corpora (default: 0.8)")
    p.add_argument("--minutes", type=float, default=None, help="stop training after this many minutes")
    p.add_argument("--val-fraction", type=float, default=0.05, help="answers held out for validation")
    p.add_argument("--max-answers", type=int, default=None, metavar="N",
                   help="train on N of the training answers, drawn at random (seeded by --seed) from all the "
                        "corpora (default: all): the target's states cost ~0.3 s an answer on a 2-core CPU")
    p.add_argument("--val-prompts", default=None,
                   help="validate on the target's greedy answers to these prompts instead (e.g. the held-out "
                        "training/data/heldout_prompts.jsonl: acceptance on prompts of a kind training never "
                        "saw); the answers are written once to OUT/val-corpus.jsonl")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (the target and the training)")
    p.add_argument("--dtype", default="auto", help="the target's dtype while writing the corpus (default: auto)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enforce-eager", action="store_true", help="the target runs eagerly (no compiled decode step)")
    p.add_argument("--corpus-only", action="store_true", help="write the corpora that do not exist yet, then "
                                                               "stop (no training)")


def corpus_paths(args) -> list[Path]:
    """The corpora the flags name: --corpus, else the default model's shipped answers when
    no prompts are given, else OUT/corpus.jsonl."""
    if args.corpus:
        return [Path(p) for p in args.corpus]
    shipped = shipped_corpora(args.model) if args.data is None and args.num_prompts is None else []
    return shipped or [Path(args.out) / "corpus.jsonl"]


def self_distillation_corpus(args):
    """(engine, training samples, validation samples) from the flags above. Each corpus is
    read when it exists, else the target writes it (and it is saved). Validation answers
    are the target's answers to --val-prompts, else the first --val-fraction of the first
    corpus; answers to the validation prompts are left out of training."""
    from runtime.engine import LLMEngine
    Path(args.out).mkdir(parents=True, exist_ok=True)
    engine = LLMEngine(model=args.model, device=args.device, dtype=args.dtype, max_num_seqs=64, seed=args.seed,
                       enforce_eager=args.enforce_eager)
    paths = corpus_paths(args)
    prompts = (load_prompts(args.data or default_prompt_file("train"), args.num_prompts)
               if not all(path.exists() for path in paths) else [])
    corpora = []
    for k, path in enumerate(paths):
        start = time.perf_counter()
        if path.exists():
            samples = load_corpus(path, args.model)
            print(f"corpus: {len(samples)} answers from {path}")
        else:
            temperature = args.temperature if k == 0 else args.extra_temperature
            samples = generate_corpus(engine, prompts, args.max_tokens, temperature, args.seed + k * len(prompts))
            save_corpus(samples, path, args.model)
            print(f"corpus: {len(samples)} answers at temperature {temperature} in "
                  f"{time.perf_counter() - start:.0f} s -> {path}")
        corpora.append(samples)
    if args.val_prompts:
        val = validation_corpus(engine, args)
    else:
        num_val = max(1, int(len(corpora[0]) * args.val_fraction))
        val, corpora[0] = corpora[0][:num_val], corpora[0][num_val:]
    val_prompts = {tuple(s.token_ids[:s.num_prompt_tokens]) for s in val}
    train = [s for samples in corpora for s in samples if tuple(s.token_ids[:s.num_prompt_tokens]) not in val_prompts]
    if getattr(args, "max_answers", None) is not None and args.max_answers < len(train):
        import random
        train = random.Random(args.seed).sample(train, args.max_answers)
        print(f"training on {len(train)} answers drawn at random from the corpora")
    return engine, train, val


def validation_corpus(engine, args) -> list[Sample]:
    """The target's greedy answers to --val-prompts: read from OUT/val-corpus.jsonl when it
    holds answers to exactly those prompts, else written there."""
    path = Path(args.out) / "val-corpus.jsonl"
    prompts = load_prompts(args.val_prompts)
    wanted = [engine.prompt_token_ids(prompt) for prompt in prompts]
    if path.exists():
        samples = load_corpus(path, args.model)
        if [s.token_ids[:s.num_prompt_tokens] for s in samples] == wanted:
            print(f"validation: {len(samples)} answers from {path}")
            return samples
    samples = generate_corpus(engine, prompts, args.max_tokens, temperature=0.0)
    save_corpus(samples, path, args.model)
    print(f"validation: the target's greedy answers to {len(samples)} prompts of {args.val_prompts} -> {path}")
    return samples


def dense_causal_attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention over one whole sequence: q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                     is_causal=True)  # [Hq, T, D]
    return out.transpose(0, 1)


@torch.no_grad()  # not inference_mode: the states are training inputs and targets
def target_states(model, samples: list[Sample], feature_layers: tuple[int, ...] = (), greedy: bool = True,
                  top_k: int = 0, progress: bool = True):
    """For each sample in order, (sample, hidden, greedy tokens, top): the target's final
    hidden states (after the last norm) at every position, [T, H] float32, with
    feature_layers [T, (1 + k) H]: then the inputs of those layers (DecoderModel.forward);
    with greedy, its greedy next token after every position ([T], the argmax of its logits;
    else None: the LM head is about a fifth of the forward); with top_k, its next-token
    distribution at every position cut to its top_k tokens, (ids [T, top_k] int32,
    probabilities [T, top_k] float16, not renormalised; else None). One forward per
    sample: packing several into one forward under a block-diagonal mask was slower on the
    CPU (0.27 s a sample alone, 0.32 in packs of 512 tokens, 1.1 in packs of 2048: a masked
    attention takes scaled_dot_product_attention's unfused path)."""
    from tqdm import tqdm
    device = model.embed_tokens.weight.device
    for s in tqdm(samples, desc="target features", unit="sample", disable=not progress):
        ids = torch.tensor(s.token_ids, device=device)
        positions = torch.arange(len(s.token_ids), device=device)
        hidden = model(ids, positions, dense_causal_attention, feature_layers)  # [T, F]
        tokens = top = None
        if greedy or top_k:
            logits = model.compute_logits(hidden[:, :model.config.hidden_size]).float()  # [T, V]
            tokens = logits.argmax(dim=-1).cpu() if greedy else None
            if top_k:
                probs, top_ids = logits.softmax(dim=-1).topk(top_k, dim=-1)  # [T, top_k] each
                top = (top_ids.to(torch.int32).cpu(), probs.to(torch.float16).cpu())
        yield s, hidden.float().cpu(), tokens, top  # [T, F], [T]


def autocast(module: nn.Module):
    """bf16 autocast on the module's device where bf16 math is native (tensor cores on a
    GPU, AMX or AVX-512 BF16 on a CPU); float32 elsewhere (an AVX2 CPU emulates bf16)."""
    from runtime.platform import cpu_has_bf16_math
    device_type = next(module.parameters()).device.type
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=device_type == "cuda" or cpu_has_bf16_math())


def trainable_lm_head(lm_head: nn.Module) -> nn.Module:
    """The target's LM head as a head that projects through it trains through it: a quantized
    one's float copy (its int8/int4 kernels have no backward); a prepacked one as it is (it
    keeps its row-major weight, and backpropagates through that); else itself."""
    from runtime.models.quant_linear import QuantizedLinear, float_linear
    if isinstance(lm_head, QuantizedLinear):  # clones: a dequantized weight may be an inference tensor
        return float_linear(lm_head.dequantize().clone(), None if lm_head.bias is None else lm_head.bias.detach().clone(),
                            prepack=False)
    return lm_head


def optimizer_with_schedule(params, lr: float, steps: int, betas: tuple[float, float]):
    """AdamW with a linear warm-up over the first 5% of steps, then cosine decay to 0."""
    optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=0.0)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    return optimizer, schedule


def draft_vocabulary(samples: list[Sample], size: int, always: list[int] = ()) -> torch.Tensor:
    """EAGLE-3's draft vocabulary: the `size` tokens the target writes most often in the
    samples' answers (and `always`, e.g. the end-of-sequence tokens), as ascending ids."""
    from collections import Counter
    counts = Counter(t for s in samples for t in s.token_ids[s.num_prompt_tokens:])
    chosen = set(always)
    for token, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) >= size:
            break
        chosen.add(token)
    return torch.tensor(sorted(chosen), dtype=torch.long)
