"""EAGLE heads' self-distillation (the corpus and the target's states: training/common.py).

The head reads (f_p, token p + 1) for every p of a sample in one causal pass (EAGLE's
uniform noise on the input features) and is scored by the cross-entropy of its draft
distribution against the target's greedy token at p + 2 (its argmax after token p + 1:
the token it wrote, in a greedy corpus; in a sampled one, the choice a greedy request
would verify, where the written token is a draw), or with soft labels against the
target's whole next-token distribution there (its top-k; EAGLE-3's recipe); an EAGLE-1
head also against f_{p+1} (smooth L1, with the cross-entropy weighted 0.1). EAGLE-3 features are three target
layers' inputs, and its draft vocabulary the corpus's most frequent answer tokens
(`training.common.draft_vocabulary`). With unroll > 1 the head is also trained on its own drafts
(EAGLE-3's training-time test). Validation: depth-1 top-1 accuracy, teacher-forced, and
acceptance per decode step (`step_acceptance`: the proposer itself drafts its EAGLE-2
trees along each validation answer, as a greedy decode with fixed trees would verify them).
The target's states of a corpus can be cached on disk (eagle_data's cache_dir).
"""
from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from speculators.eagle import DEFAULT_DEPTH, SPECULATOR as EAGLE
from speculators.base import IGNORE, ProposalRequest
from training.common import Sample, autocast, dense_causal_attention, optimizer_with_schedule, target_states
from runtime.draft_tree import DraftTree


@dataclass(slots=True)
class EagleSample:
    token_ids: torch.Tensor  # [T]
    features: torch.Tensor  # [T, F] bfloat16: the target's features the head reads (head.target_features)
    greedy: torch.Tensor  # [T] the target's greedy token after each position
    num_prompt_tokens: int
    top_ids: torch.Tensor | None = None  # [T, k] int32: the target's top-k next tokens after each position
    top_probs: torch.Tensor | None = None  # [T, k] float16: their probabilities (soft labels)

    @property
    def answer_start(self) -> int:
        """The first position p whose token p + 2 the target wrote."""
        return max(self.num_prompt_tokens - 2, 0)


CACHE_CHUNK = 256  # samples per cache file: a corpus added after the others leaves their files valid


def eagle_data(model, samples: list[Sample], head, progress: bool = True, top_k: int = 0,
               cache_dir: str | Path | None = None) -> list[EagleSample]:
    """The samples with the target's features (kept in bfloat16, which the head's bf16
    autocast reads anyway: half the memory of a large corpus), greedy tokens and, with
    top_k, its top_k next-token probabilities (soft labels). With cache_dir, each run of
    CACHE_CHUNK samples is read from there when the same target (its dtype and a
    fingerprint of its weights), feature layers, top_k and samples were extracted before,
    else written there as it is extracted: the target's forward over a large corpus takes
    longer than a continued training."""
    samples = [s for s in samples if len(s.token_ids) >= 3]
    if cache_dir is None:
        return list(_extract(model, samples, head, top_k, progress))
    chunks = [samples[i:i + CACHE_CHUNK] for i in range(0, len(samples), CACHE_CHUNK)]
    target = _target_key(model, head.feature_layers, top_k)
    paths = [Path(cache_dir) / f"eagle-states-{_chunk_key(target, chunk)}.pt" for chunk in chunks]
    extracted = _extract(model, [s for c, path in zip(chunks, paths) if not path.exists() for s in c], head, top_k,
                         progress)
    out = []
    for chunk, path in zip(chunks, paths):
        if path.exists():
            out += _load_states(path, chunk)
        else:
            data = [next(extracted) for _ in chunk]
            _save_states(path, data)
            out += data
    return out


def _extract(model, samples: list[Sample], head, top_k: int, progress: bool):
    for s, hidden, greedy, top in target_states(model, samples, head.feature_layers, top_k=top_k, progress=progress):
        top_ids, top_probs = top if top is not None else (None, None)
        yield EagleSample(torch.tensor(s.token_ids), head.target_features(hidden).to(torch.bfloat16).contiguous(),
                          greedy, s.num_prompt_tokens, top_ids, top_probs)


def _target_key(model, feature_layers: tuple[int, ...], top_k: int) -> str:
    """What the target's states depend on besides the samples: its shapes, dtype and weights
    (a fingerprint: the final norm and the first embedding rows), the layers read, top_k."""
    fingerprint = [float(model.norm.weight.double().sum()), float(model.embed_tokens.weight[:64].double().sum())]
    return json.dumps([repr(model.config), str(model.dtype), fingerprint, list(feature_layers), top_k])


def _chunk_key(target_key: str, samples: list[Sample]) -> str:
    digest = hashlib.sha256(target_key.encode())
    for s in samples:
        digest.update(json.dumps([s.num_prompt_tokens, s.token_ids]).encode())
    return digest.hexdigest()[:16]


def _save_states(path: Path, data: list[EagleSample]) -> None:
    """One file, each field concatenated over the samples (thousands of small tensors save slowly)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = {"features": [d.features for d in data], "greedy": [d.greedy for d in data]}
    if data and data[0].top_ids is not None:
        fields.update(top_ids=[d.top_ids for d in data], top_probs=[d.top_probs for d in data])
    partial = path.with_suffix(".partial")
    torch.save({name: torch.cat(parts) for name, parts in fields.items()}, partial)
    partial.rename(path)  # a killed run leaves no cache that looks whole


def _load_states(path: Path, samples: list[Sample]) -> list[EagleSample]:
    stored = torch.load(path, weights_only=True)
    lengths = [len(s.token_ids) for s in samples]
    parts = {name: tensor.split(lengths) for name, tensor in stored.items()}
    return [EagleSample(torch.tensor(s.token_ids), parts["features"][i], parts["greedy"][i], s.num_prompt_tokens,
                        parts["top_ids"][i] if "top_ids" in parts else None,
                        parts["top_probs"][i] if "top_probs" in parts else None)
            for i, s in enumerate(samples)]


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
    same targets where p >= k, with weight decay^k. Hits count step 0 only. A sample with
    the target's top-k probabilities (eagle_data's top_k) is scored against them instead of
    its greedy token (soft_cross_entropy; EAGLE-3 trains on the target's distribution)."""
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
        if sample.top_ids is not None:
            loss = loss + ce_weight * soft_cross_entropy(head, logits, sample.top_ids[first + 1:t - 1].to(device),
                                                         sample.top_probs[first + 1:t - 1].to(device))
        else:
            labels = head.draft_ids(targets)  # [n], IGNORE outside the draft vocabulary
            if (labels != IGNORE).any():
                loss = loss + ce_weight * nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE)
        total = total + decay ** step * loss
        if step == 0:
            hits = int((head.target_ids(logits.argmax(dim=-1)) == targets).sum())
    if not torch.is_tensor(total):  # nothing to score: a zero that still backpropagates
        total = predicted.sum() * 0.0
    return total, hits, max(t - 2 - start, 0)


def soft_cross_entropy(head, logits: torch.Tensor, top_ids: torch.Tensor, top_probs: torch.Tensor):
    """Cross-entropy of the draft distribution (logits [n, Vd]) against the target's
    (EAGLE-3's soft labels), known by its top-k tokens (top_ids [n, k], top_probs [n, k]):
    the part in the draft vocabulary, renormalised; positions with none of it are skipped.
    Its minimum is the draft distribution equal to the target's there, which is what both
    a greedy verify (the same argmax) and the rejection sampler (sum min(p, q)) reward."""
    draft = head.draft_ids(top_ids.long())  # [n, k], IGNORE outside the draft vocabulary
    probs = torch.where(draft != IGNORE, top_probs.float(), 0.0)  # [n, k]
    target = torch.zeros_like(logits).scatter_add_(1, draft.clamp_min(0), probs)  # [n, Vd]
    mass = target.sum(dim=-1)  # [n]
    kept = mass > 0
    if not kept.any():
        return logits.sum() * 0.0
    target = target[kept] / mass[kept, None]
    return -(target * logits[kept].log_softmax(dim=-1)).sum(dim=-1).mean()


def greedy_path_length(tree: DraftTree, next_tokens: list[int]) -> int:
    """How many of next_tokens a greedy verify of the tree accepts: the longest path from
    the root whose tokens are next_tokens[0], next_tokens[1], ... in turn."""
    children = tree.children()
    node, length = -1, 0
    while length < len(next_tokens):
        match = [i for i in children[node + 1] if tree.token_ids[i] == next_tokens[length]]
        if not match:
            break
        node, length = match[0], length + 1
    return length


def _as_target_hidden(head, features: torch.Tensor) -> torch.Tensor:
    """[n, F] -> [n, H'] laid out as ModelRunner.execute hands hidden states to a proposer
    (the final state, then the feature layers' inputs), zero where the head does not read."""
    if not head.feature_layers:
        return features  # EAGLE-1: the final state is its feature
    return torch.cat([features.new_zeros(features.shape[0], head.target_hidden_size), features], dim=-1)


@torch.no_grad()
def step_acceptance(head, samples: list[EagleSample], depth: int = DEFAULT_DEPTH,
                    tree_width: int = EAGLE.tree_width,
                    max_nodes: int = EAGLE.num_speculative_tokens) -> float:
    """Mean tokens per verify step when a greedy decode with fixed trees (adaptive sizing
    off) walks each sample's answer: after the prefill wrote the first answer token, each
    step the proposer (speculators/eagle.EagleProposer, as the engine runs it) drafts an
    EAGLE-2 tree from the target's features of the tokens committed so far, the verify
    keeps the longest path that the answer follows plus the target's own next token, and
    the next step starts after them. The walk ends where the answer does, so the last step
    keeps only the tokens up to there. The answers should be the target's greedy ones."""
    from runtime.sampling_params import SamplingParams
    from speculators.eagle import EagleProposer
    longest = max((len(s.token_ids) for s in samples), default=1)
    proposer = EagleProposer(head, head.fc.weight.device, depth, num_kv_tokens=longest + 8 * max_nodes + 64)
    params = SamplingParams(temperature=0.0)
    was_training = head.training
    head.eval()
    tokens = steps = 0
    for k, s in enumerate(samples):
        ids, length = s.token_ids.tolist(), len(s.token_ids)
        committed, fed = s.num_prompt_tokens, 0  # tokens 0..committed are in; features from fed on not given yet
        while committed < length - 1:
            hidden = _as_target_hidden(head, s.features[fed:committed].to(head.dtype))  # [n, H']
            request = ProposalRequest(str(k), ids[:committed + 1], s.num_prompt_tokens, max_nodes, tree_width,
                                      params, new_features=[(fed, hidden)])
            tree = proposer.propose([request])[0]
            step = min(greedy_path_length(tree, ids[committed + 1:]) + 1, length - 1 - committed)
            fed, committed = committed, committed + step
            tokens, steps = tokens + step, steps + 1
        proposer.release(str(k))
    head.train(was_training)
    return tokens / steps if steps else 1.0


@torch.no_grad()
def evaluate_eagle(head, samples: list[EagleSample], step_acceptance_tree: dict | None = None) -> dict:
    """{val_loss, val_accuracy (depth-1 top-1, teacher-forced), val_step_acceptance (per
    decode step with fixed trees: step_acceptance with step_acceptance_tree's depth,
    tree_width and max_nodes, default the engine's)} over samples."""
    head.eval()
    total, hits, n = 0.0, 0, 0
    for s in samples:
        with autocast(head):
            loss, h, k = eagle_loss(head, s)
        total, hits, n = total + float(loss), hits + h, n + k
    head.train()
    return {"val_loss": total / max(len(samples), 1), "val_accuracy": hits / max(n, 1),
            "val_step_acceptance": step_acceptance(head, samples, **(step_acceptance_tree or {}))}


def train_eagle(head, train: list[EagleSample], val: list[EagleSample], steps: int, lr: float = 3e-4,
                sequences_per_step: int = 4, noise: float = 0.1, max_seconds: float | None = None,
                eval_every: int = 100, seed: int = 0, on_eval=None, progress: bool = True, unroll: int = 1,
                eval_tree: dict | None = None) -> dict:
    """AdamW with warm-up and cosine decay; each step averages `sequences_per_step` samples,
    the head unrolled `unroll` drafting steps on each (eagle_loss). Returns the last
    validation figures (evaluate_eagle's, with eval_tree; plus step and seconds), which
    on_eval(figures) is also given at every validation (e.g. to checkpoint)."""
    from tqdm import tqdm
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer, schedule = optimizer_with_schedule(params, lr, steps, betas=(0.9, 0.95))
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
            with autocast(head):
                loss, _, _ = eagle_loss(head, train[order.pop()], noise, unroll=unroll)
            (loss / sequences_per_step).backward()
            total += float(loss.detach()) / sequences_per_step
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        optimizer.step()
        schedule.step()
        bar.set_postfix(loss=f"{total:.3f}")
        out_of_time = max_seconds is not None and time.perf_counter() - start > max_seconds
        if step % eval_every == 0 or step == steps or out_of_time:
            result = {"step": step, **evaluate_eagle(head, val, eval_tree), "seconds": time.perf_counter() - start}
            bar.write(f"step {step}: validation loss {result['val_loss']:.3f}, depth-1 top-1 accuracy "
                      f"{result['val_accuracy']:.2f}, acceptance per step {result['val_step_acceptance']:.2f}")
            if on_eval is not None:
                on_eval(result)
        if out_of_time:
            break
    bar.close()
    head.eval()
    return result
