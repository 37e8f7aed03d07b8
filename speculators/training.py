"""Self-distillation for speculation heads: the target writes its own training text from
a prompt set, and heads learn to predict what the target does next.

  1. `generate_corpus`: the target (our engine, batched) answers every prompt; a sample is
     prompt + answer as token ids. Saved as JSONL so several trainings share one corpus.
  2. `target_states`: one causal forward of the target over a whole sample (dense
     attention, no KV cache) gives its final hidden states [T, H], the features the heads
     read at serving time, and its greedy next token at every position.
  3. `train_medusa`: head k learns, from the hidden state at position p, the target's
     greedy token at p + 2 + k along the written path (`medusa_labels`; in a greedy
     corpus the written token) (cross-entropy per head, later heads weighted down), on
     answer positions only (the prompt is the user's text, not the target's). Soft
     labels (the target's distribution there) were tried: the same validation acceptance
     per step at twice the cost per step on this CPU, so the greedy tokens are the labels.
     Validation: the mean accepted length of the heads' top-1 chain on held-out samples,
     1 (the target's own token) plus how many heads in a row guess right.
  4. `train_eagle`: the head reads (f_p, token p + 1) for every p of a sample in one causal
     pass (EAGLE's uniform noise on the input features) and is scored by the cross-entropy
     of its draft distribution against the target's greedy token at p + 2 (its argmax
     after token p + 1: the token it wrote, in a greedy corpus; in a sampled one, the
     choice a greedy request would verify, where the written token is a draw); an EAGLE-1
     head also against f_{p+1} (smooth L1, with the cross-entropy weighted 0.1). EAGLE-3
     features are three target layers' inputs, and its draft vocabulary the corpus's most
     frequent answer tokens (`draft_vocabulary`). Validation: depth-1 top-1 accuracy,
     teacher-forced.
"""
from __future__ import annotations

import gzip
import json
import logging
import math
import random
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from torch import nn

from speculators.base import IGNORE

log = logging.getLogger("speculators.training")


@dataclass(slots=True)
class Sample:
    token_ids: list[int]  # prompt + the target's answer
    num_prompt_tokens: int


def default_prompt_file(split: str = "train") -> Path:
    """The prompt sets shipped with the package: 'train' (424 prompts, trains in minutes),
    'train_large' (2,265, scripts/make_prompts.py) or 'heldout'."""
    return Path(str(resources.files("speculators") / "data" / f"{split}_prompts.jsonl"))


def shipped_corpus(model: str) -> Path | None:
    """The answers shipped with the package for this model, if any: the default model's
    greedy answers (float32, 192 tokens at most) to the 2,265 'train_large' prompts, which
    took this 2-core AVX2 CPU 79 minutes to write."""
    from runtime.models.loader import DEFAULT_MODEL
    path = Path(str(resources.files("speculators") / "data" / "smollm2-135m-train-large-greedy.jsonl.gz"))
    return path if model == DEFAULT_MODEL and path.exists() else None


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
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (the target and the training)")
    p.add_argument("--dtype", default="auto", help="the target's dtype while writing the corpus (default: auto)")
    p.add_argument("--seed", type=int, default=0)


def self_distillation_corpus(args):
    """(engine, training samples, validation samples) from the flags above. Each corpus is
    read when it exists, else the target writes it (and it is saved). Validation answers
    are the first --val-fraction of the first corpus; the other corpora's answers to those
    prompts are left out of training."""
    from runtime.engine import LLMEngine
    Path(args.out).mkdir(parents=True, exist_ok=True)
    engine = LLMEngine(model=args.model, device=args.device, dtype=args.dtype, max_num_seqs=64, seed=args.seed)
    shipped = shipped_corpus(args.model) if args.data is None and args.num_prompts is None else None
    paths = [Path(p) for p in args.corpus] if args.corpus else [shipped or Path(args.out) / "corpus.jsonl"]
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
    num_val = max(1, int(len(corpora[0]) * args.val_fraction))
    val = corpora[0][:num_val]
    val_prompts = {tuple(s.token_ids[:s.num_prompt_tokens]) for s in val}
    train = corpora[0][num_val:] + [s for samples in corpora[1:] for s in samples
                                    if tuple(s.token_ids[:s.num_prompt_tokens]) not in val_prompts]
    return engine, train, val


def dense_causal_attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention over one whole sequence: q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                     is_causal=True)  # [Hq, T, D]
    return out.transpose(0, 1)


@torch.no_grad()  # not inference_mode: the states are training inputs and targets
def target_states(model, samples: list[Sample], feature_layers: tuple[int, ...] = (), greedy: bool = True,
                  progress: bool = True):
    """For each sample in order, (sample, hidden, greedy tokens): the target's final hidden
    states (after the last norm) at every position, [T, H] float32, with feature_layers
    [T, (1 + k) H]: then the inputs of those layers (DecoderModel.forward); and, with greedy,
    its greedy next token after every position ([T], the argmax of its logits; else None:
    the LM head is about a fifth of the forward). One forward per sample: packing several
    into one forward under a block-diagonal mask was slower on the CPU (0.27 s a sample
    alone, 0.32 in packs of 512 tokens, 1.1 in packs of 2048: a masked attention takes
    scaled_dot_product_attention's unfused path)."""
    from tqdm import tqdm
    device = model.embed_tokens.weight.device
    for s in tqdm(samples, desc="target features", unit="sample", disable=not progress):
        ids = torch.tensor(s.token_ids, device=device)
        positions = torch.arange(len(s.token_ids), device=device)
        hidden = model(ids, positions, dense_causal_attention, feature_layers)  # [T, F]
        tokens = model.compute_logits(hidden[:, :model.config.hidden_size]).argmax(dim=-1).cpu() if greedy else None
        yield s, hidden.float().cpu(), tokens  # [T, F], [T]


def _autocast(module: nn.Module):
    """bf16 autocast on the module's device where bf16 math is native (tensor cores on a
    GPU, AMX or AVX-512 BF16 on a CPU); float32 elsewhere (an AVX2 CPU emulates bf16)."""
    from runtime.config import cpu_has_bf16_math
    device_type = next(module.parameters()).device.type
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=device_type == "cuda" or cpu_has_bf16_math())


def _optimizer(params, lr: float, steps: int, betas: tuple[float, float]):
    """AdamW with a linear warm-up over the first 5% of steps, then cosine decay to 0."""
    optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=0.0)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    return optimizer, schedule


# ---- Medusa -----------------------------------------------------------------------------------

@dataclass(slots=True)
class MedusaData:
    features: torch.Tensor  # [N, H] the target's hidden state at position p
    labels: torch.Tensor  # [N, K] the target's token at p + 2 + k, IGNORE past the sample's end

    def __len__(self) -> int:
        return len(self.features)


def medusa_data(model, samples: list[Sample], num_heads: int, progress: bool = True) -> MedusaData:
    """Features and labels of every answer position of every sample (medusa_labels)."""
    features, labels = [], []
    for s, hidden, greedy in target_states(model, samples, greedy=True, progress=progress):
        positions = torch.arange(max(s.num_prompt_tokens - 1, 0), len(s.token_ids) - 2)  # [n] the next token exists
        if not len(positions):
            continue
        features.append(hidden[positions])
        labels.append(medusa_labels(torch.tensor(s.token_ids), greedy, positions, num_heads))
    return MedusaData(torch.cat(features), torch.cat(labels))


def medusa_labels(tokens: torch.Tensor, greedy: torch.Tensor, positions: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Head k's label at position p [n, K]: the token a greedy request would verify at
    p + 2 + k, the target's argmax there (greedy [T]: after each position) along the
    written path (tokens [T]); IGNORE once the written tokens p + 1 .. p + 1 + k leave the
    greedy path (a sampled corpus: the heads see only h_p, so they are taught the greedy
    continuation, not a draw they cannot know) and past the sample's written end. In a
    greedy corpus these are the written tokens."""
    t = len(tokens)
    on_path = torch.cat([tokens[1:] == greedy[:-1], torch.zeros(num_heads + 2, dtype=torch.bool)])  # [T + K + 1]
    greedy = torch.cat([greedy, torch.full((num_heads + 2,), IGNORE, dtype=greedy.dtype)])
    steps = torch.arange(num_heads)  # [K]
    index = positions[:, None] + steps[None, :]  # [n, K] p + k
    still_greedy = on_path[index].int().cumprod(dim=1).bool()  # written p + 1 .. p + 1 + k are greedy
    inside = index + 2 < t  # token p + 2 + k was written
    return torch.where(still_greedy & inside, greedy[index + 1], IGNORE)  # [n, K]


def head_weights(num_heads: int, decay: float = 0.8) -> torch.Tensor:
    return decay ** torch.arange(num_heads, dtype=torch.float32)  # [K]


def medusa_loss(heads, features: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy per head against the labels, later heads weighted down, tokens
    outside the draft vocabulary skipped; logits [N, K, Vd]). labels [N, K] are target ids."""
    device = next(heads.parameters()).device
    features, labels = features.to(device), heads.draft_ids(labels.to(device))  # [N, H], [N, K] draft ids
    logits = heads(features)  # [N, K, Vd]
    k = logits.shape[1]
    per_position = nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                               ignore_index=IGNORE, reduction="none").view(-1, k)  # [N, K]
    valid = (labels != IGNORE).float()
    per_head = (per_position * valid).sum(0) / valid.sum(0).clamp_min(1.0)  # [K]
    return (per_head * head_weights(k).to(device)).sum(), logits


def chain_acceptance(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean tokens per step of the heads' top-1 chain: 1 + the heads in a row that guess
    right (a missing label ends the chain). logits [N, K, V], labels [N, K]."""
    hits = logits.argmax(dim=-1) == labels.to(logits.device)  # [N, K]
    run = hits.int().cumprod(dim=1).sum(dim=1)  # [N]
    return 1.0 + float(run.float().mean()) if len(run) else 1.0


@torch.no_grad()
def evaluate_medusa(heads, data: MedusaData, batch_size: int = 512) -> tuple[float, float]:
    """(loss, chain acceptance) over data."""
    heads.eval()
    total_loss, accepted, n = 0.0, 0.0, 0
    for start in range(0, len(data), batch_size):
        x, y = data.features[start:start + batch_size], data.labels[start:start + batch_size]
        with _autocast(heads):
            loss, logits = medusa_loss(heads, x, y)
        total_loss += float(loss) * len(x)
        accepted += (chain_acceptance(logits, heads.draft_ids(y.to(logits.device))) - 1.0) * len(x)
        n += len(x)
    heads.train()
    return total_loss / max(n, 1), 1.0 + accepted / max(n, 1)


def train_medusa(heads, train: MedusaData, val: MedusaData, steps: int, lr: float = 1e-3, batch_size: int = 256,
                 max_seconds: float | None = None, eval_every: int = 200, seed: int = 0,
                 on_eval=None, progress: bool = True) -> dict:
    """AdamW with warm-up and cosine decay over `steps` (or until max_seconds); returns the
    final validation figures. on_eval(step, val_loss, val_acceptance) is called at each
    evaluation (e.g. to checkpoint)."""
    from tqdm import tqdm
    params = [p for p in heads.parameters() if p.requires_grad]
    optimizer, schedule = _optimizer(params, lr, steps, betas=(0.9, 0.999))
    rng = random.Random(seed)
    order: list[int] = []
    start = time.perf_counter()
    heads.train()
    result = {}
    bar = tqdm(range(1, steps + 1), desc="training Medusa heads", unit="step", disable=not progress)
    for step in bar:
        if len(order) < batch_size:
            order = list(range(len(train)))
            rng.shuffle(order)
        batch, order = order[:batch_size], order[batch_size:]
        with _autocast(heads):
            loss, _ = medusa_loss(heads, train.features[batch], train.labels[batch])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}")
        out_of_time = max_seconds is not None and time.perf_counter() - start > max_seconds
        if step % eval_every == 0 or step == steps or out_of_time:
            val_loss, val_acc = evaluate_medusa(heads, val)
            result = {"step": step, "val_loss": val_loss, "val_acceptance": val_acc,
                      "seconds": time.perf_counter() - start}
            log.info("step %d: validation loss %.3f, top-1 chain acceptance %.2f", step, val_loss, val_acc)
            bar.write(f"step {step}: validation loss {val_loss:.3f}, top-1 chain acceptance {val_acc:.2f}")
            if on_eval is not None:
                on_eval(step, val_loss, val_acc)
        if out_of_time:
            break
    bar.close()
    heads.eval()
    return result


# ---- EAGLE ------------------------------------------------------------------------------------

@dataclass(slots=True)
class EagleSample:
    token_ids: torch.Tensor  # [T]
    features: torch.Tensor  # [T, F] bfloat16: the target's features the head reads (head.target_features)
    greedy: torch.Tensor  # [T] the target's greedy token after each position
    answer_start: int  # first position p whose token p + 2 the target wrote


def eagle_data(model, samples: list[Sample], head, progress: bool = True) -> list[EagleSample]:
    """The samples with the target's features (kept in bfloat16, which the head's bf16
    autocast reads anyway: half the memory of a large corpus) and greedy tokens."""
    out = []
    samples = [s for s in samples if len(s.token_ids) >= 3]
    for s, hidden, greedy in target_states(model, samples, head.feature_layers, progress=progress):
        out.append(EagleSample(torch.tensor(s.token_ids), head.target_features(hidden).to(torch.bfloat16).contiguous(),
                               greedy, max(s.num_prompt_tokens - 2, 0)))
    return out


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


class UnrolledAttention:
    """Attention for unroll step k of the head over a whole sample ("training-time test",
    EAGLE-3: Li et al. 2025): the query at position p is the head's depth-(k+1) draft
    from context p - k. It sees what the head would have in its KV cache when drafting
    there: step 0's entries (made from the target's own features) at positions <= p - k,
    and one entry of each later step j <= k, its own chain, at position p - k + j."""

    def __init__(self):
        self.keys: list[torch.Tensor] = []  # per step: [T, Hkv, D]
        self.values: list[torch.Tensor] = []

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [T, Hq, D]; k, v [T, Hkv, D] of this step -> [T, Hq, D]
        self.keys.append(k)
        self.values.append(v)
        step, t = len(self.keys) - 1, q.shape[0]
        if step == 0:
            return dense_causal_attention(layer_idx, q, k, v)
        p = torch.arange(t, device=q.device)
        sees_context = p[None, :] <= p[:, None] - step  # [T, T] step 0's entries
        chain = [p[None, :] == p[:, None] - step + j for j in range(1, step + 1)]  # [T, T] each
        mask = torch.cat([sees_context] + chain, dim=1)  # [T, (step + 1) T]
        mask[:, 0] |= ~mask.any(dim=1)  # rows with no valid key (p < step, never scored) stay finite
        group = q.shape[1] // k.shape[1]
        keys = torch.cat(self.keys).repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, (step + 1) T, D]
        values = torch.cat(self.values).repeat_interleave(group, dim=1).transpose(0, 1)
        out = nn.functional.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask)
        return out.transpose(0, 1)  # [T, Hq, D]


def unrolled_predictions(head, tokens: torch.Tensor, features: torch.Tensor, unroll: int) -> list[torch.Tensor]:
    """The head's output states at every p, for steps 0..unroll-1 ([T-1, h] each): step 0's
    input at p is made from the target's features f_p, [T-1, F] (perhaps noised), and the
    token p + 1 of tokens [T]; step k + 1's input at p is step k's output at p - 1 (at
    p = 0, never scored, step 0's input)."""
    positions = torch.arange(len(tokens) - 1, device=tokens.device)
    attention = UnrolledAttention() if unroll > 1 else dense_causal_attention
    states = head.project(features)  # [T-1, h]
    steps = []
    for _ in range(unroll):
        steps.append(head(tokens[1:], positions, states, attention))  # [T-1, h]
        states = torch.cat([states[:1], steps[-1][:-1]])
    return steps


def eagle_loss(head, sample: EagleSample, noise: float = 0.0, ce_weight: float | None = None, unroll: int = 1,
               decay: float = 0.8):
    """(loss, depth-1 top-1 hits, positions).

    Input p = 0..T-2 is (f_p, token p + 1); its draft distribution is scored against the
    target's greedy token at p + 2 (cross-entropy over the draft vocabulary; answer
    positions only, tokens outside the draft vocabulary skipped), and an EAGLE-1 head's
    output also against f_{p+1} (smooth L1; the cross-entropy weighted ce_weight, default
    0.1, else 1). With unroll > 1 the head then drafts on from its own outputs, as it does
    when serving (training-time test, unrolled_predictions): step k is scored against the
    same targets where p >= k, with weight decay^k. Hits count step 0 only."""
    device = head.fc.weight.device
    tokens, feats = sample.token_ids.to(device), sample.features.to(device, torch.float32)
    greedy = sample.greedy.to(device)
    if ce_weight is None:
        ce_weight = 0.1 if head.regresses_features else 1.0
    t = len(tokens)
    inputs = feats[:-1]
    if noise:
        inputs = inputs + (torch.rand_like(inputs) * 2 - 1) * noise  # EAGLE's uniform feature noise
    start = sample.answer_start
    total, hits = 0.0, 0
    for step, predicted in enumerate(unrolled_predictions(head, tokens, inputs, unroll)):
        # step k drafts from a real context at p >= k; tokens are scored on the answer only
        loss = 0.0
        if head.regresses_features:
            loss = nn.functional.smooth_l1_loss(predicted[step:].float(), feats[1 + step:])
        first = max(start, step)
        logits = head.draft_logits(predicted[first:t - 2])  # [n, Vd] token p + 2
        targets = greedy[first + 1:t - 1]  # [n] the target's token p + 2
        labels = head.draft_ids(targets)  # [n], IGNORE outside the draft vocabulary
        if (labels != IGNORE).any():
            loss = loss + ce_weight * nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE)
        total = total + decay ** step * loss
        if step == 0:
            hits = int((head.target_ids(logits.argmax(dim=-1)) == targets).sum())
    if not torch.is_tensor(total):  # nothing to score: a zero that still backpropagates
        total = predicted.sum() * 0.0
    return total, hits, max(t - 2 - start, 0)


@torch.no_grad()
def evaluate_eagle(head, samples: list[EagleSample]) -> tuple[float, float]:
    """(loss, depth-1 top-1 accuracy) over samples, teacher-forced."""
    head.eval()
    total, hits, n = 0.0, 0, 0
    for s in samples:
        with _autocast(head):
            loss, h, k = eagle_loss(head, s)
        total, hits, n = total + float(loss), hits + h, n + k
    head.train()
    return total / max(len(samples), 1), hits / max(n, 1)


def train_eagle(head, train: list[EagleSample], val: list[EagleSample], steps: int, lr: float = 3e-4,
                sequences_per_step: int = 4, noise: float = 0.1, max_seconds: float | None = None,
                eval_every: int = 100, seed: int = 0, on_eval=None, progress: bool = True, unroll: int = 1) -> dict:
    """AdamW with warm-up and cosine decay; each step averages `sequences_per_step` samples,
    the head unrolled `unroll` drafting steps on each (eagle_loss)."""
    from tqdm import tqdm
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer, schedule = _optimizer(params, lr, steps, betas=(0.9, 0.95))
    rng = random.Random(seed)
    order: list[int] = []
    start = time.perf_counter()
    head.train()
    result = {}
    bar = tqdm(range(1, steps + 1), desc="training the EAGLE head", unit="step", disable=not progress)
    for step in bar:
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(sequences_per_step):
            if not order:
                order = list(range(len(train)))
                rng.shuffle(order)
            with _autocast(head):
                loss, _, _ = eagle_loss(head, train[order.pop()], noise, unroll=unroll)
            (loss / sequences_per_step).backward()
            total += float(loss.detach()) / sequences_per_step
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        optimizer.step()
        schedule.step()
        bar.set_postfix(loss=f"{total:.3f}")
        out_of_time = max_seconds is not None and time.perf_counter() - start > max_seconds
        if step % eval_every == 0 or step == steps or out_of_time:
            val_loss, val_acc = evaluate_eagle(head, val)
            result = {"step": step, "val_loss": val_loss, "val_accuracy": val_acc,
                      "seconds": time.perf_counter() - start}
            bar.write(f"step {step}: validation loss {val_loss:.3f}, depth-1 top-1 accuracy {val_acc:.2f}")
            if on_eval is not None:
                on_eval(step, val_loss, val_acc)
        if out_of_time:
            break
    bar.close()
    head.eval()
    return result
