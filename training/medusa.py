"""Medusa heads' self-distillation (the corpus and the target's states: training/common.py).

Head k learns, from the target's final hidden state at position p (and, for heads that
read it, the written token at p + 1: the tree's root at serving time), the target's greedy
token at p + 2 + k along the written path (`medusa_labels`; in a greedy corpus the written
token), by cross-entropy per head with later heads weighted down, on answer positions only
(the prompt is the user's text, not the target's). Soft labels (the target's distribution
there) were tried: the same validation acceptance per step at twice the cost per step on
a CPU, so the greedy tokens are the labels.

Validation, on held-out answers: the mean accepted length of the heads' top-1 chain (1, the
target's own token, plus how many heads in a row guess right), and of the tree a greedy
request would verify (the proposer's best nodes of the Medusa tree; in a greedy corpus the
labels are the target's own continuation, so this is the fixed-tree acceptance length
verification would give at a position). Both are given per decode step (`step_acceptance`:
each answer walked as a decode walks it, one step from where the last one ended, which is
what the engine measures) and, for the tree, averaged over every position
(`tree_acceptance`). The per-position mean runs ~0.1 higher: a decode lands more often
in the stretches where few drafts are accepted, since it crosses them in short steps.
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

import torch
from torch import nn

from speculators.base import IGNORE
from training.common import Sample, autocast, optimizer_with_schedule, target_states

log = logging.getLogger("training.medusa")


@dataclass(slots=True)
class MedusaData:
    features: torch.Tensor  # [N, H] the target's hidden state at position p
    labels: torch.Tensor  # [N, K] the target's token at p + 2 + k, IGNORE past the sample's end
    roots: torch.Tensor  # [N] the written token at p + 1 (the tree's root at serving time)
    sample_lengths: list[int]  # positions of each sample, in order (a decode walks each on its own)

    def __len__(self) -> int:
        return len(self.features)


def medusa_data(model, samples: list[Sample], num_heads: int, reads_token: bool = False,
                progress: bool = True) -> MedusaData:
    """Features, labels (medusa_labels, for heads that read the root token or not) and root
    tokens of every answer position of every sample."""
    features, labels, roots, lengths = [], [], [], []
    for s, hidden, greedy, _ in target_states(model, samples, greedy=True, progress=progress):
        positions = torch.arange(max(s.num_prompt_tokens - 1, 0), len(s.token_ids) - 2)  # [n] the next token exists
        if not len(positions):
            continue
        tokens = torch.tensor(s.token_ids)  # [T]
        features.append(hidden[positions])
        labels.append(medusa_labels(tokens, greedy, positions, num_heads, reads_token))
        roots.append(tokens[positions + 1])
        lengths.append(len(positions))
    return MedusaData(torch.cat(features), torch.cat(labels), torch.cat(roots), lengths)


def medusa_labels(tokens: torch.Tensor, greedy: torch.Tensor, positions: torch.Tensor, num_heads: int,
                  reads_token: bool = False) -> torch.Tensor:
    """Head k's label at position p [n, K]: the token a greedy request would verify at
    p + 2 + k, the target's argmax there (greedy [T]: after each position) along the
    written path (tokens [T]); IGNORE past the sample's written end, and once the written
    tokens leave the greedy path (a sampled corpus: the heads are taught the greedy
    continuation, not a draw they cannot know). Heads that see only h_p know none of the
    written tokens, so p + 1 .. p + 1 + k must be greedy; heads that read the root token
    know p + 1, so only p + 2 .. p + 1 + k must be. In a greedy corpus these are the
    written tokens."""
    t = len(tokens)
    on_path = torch.cat([tokens[1:] == greedy[:-1], torch.zeros(num_heads + 2, dtype=torch.bool)])  # [T + K + 1]
    greedy = torch.cat([greedy, torch.full((num_heads + 2,), IGNORE, dtype=greedy.dtype)])
    steps = torch.arange(num_heads)  # [K]
    index = positions[:, None] + steps[None, :]  # [n, K] p + k
    greedy_at = on_path[index]  # [n, K]: written p + 1 + k is the greedy token
    if reads_token:
        greedy_at[:, 0] = True  # the root is given, whatever it is
    still_greedy = greedy_at.int().cumprod(dim=1).bool()  # every written token up to p + 1 + k the heads guess
    inside = index + 2 < t  # token p + 2 + k was written
    return torch.where(still_greedy & inside, greedy[index + 1], IGNORE)  # [n, K]


def head_weights(num_heads: int, decay: float = 0.8) -> torch.Tensor:
    return decay ** torch.arange(num_heads, dtype=torch.float32)  # [K]


def medusa_loss(heads, features: torch.Tensor, labels: torch.Tensor,
                roots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy per head against the labels, later heads weighted down, tokens
    outside the draft vocabulary skipped; logits [N, K, Vd]). labels [N, K] and roots [N]
    are target ids."""
    device = next(heads.parameters()).device
    features, labels = features.to(device), heads.draft_ids(labels.to(device))  # [N, H], [N, K] draft ids
    logits = heads(features, roots.to(device))  # [N, K, Vd]
    k = logits.shape[1]
    per_position = nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                               ignore_index=IGNORE, reduction="none").view(-1, k)  # [N, K]
    valid = (labels != IGNORE).float()
    per_head = (per_position * valid).sum(0) / valid.sum(0).clamp_min(1.0)  # [K]
    return (per_head * head_weights(k).to(device)).sum(), logits


def chain_lengths(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Tokens a step at each position accepts with the heads' top-1 chain [N]: 1 + the heads
    in a row that guess right (a missing label ends the chain). logits [N, K, V], labels [N, K]."""
    hits = logits.argmax(dim=-1) == labels.to(logits.device)  # [N, K]
    return 1 + hits.int().cumprod(dim=1).sum(dim=1)


def tree_lengths(logits: torch.Tensor, labels: torch.Tensor, tree, max_nodes: int) -> torch.Tensor:
    """Tokens a step at each position accepts with the tree a greedy request would verify
    [N]: the proposer's best max_nodes nodes of `tree` (speculators.medusa.CompiledTree) by
    path probability, and 1 + the depth of the deepest of them whose whole path guesses
    right. logits [N, K, V], labels [N, K] in the same (draft) ids."""
    if not len(logits):
        return torch.ones(0, dtype=torch.long)
    draft_ids, values = tree.candidates(logits.float().softmax(dim=-1))  # [N, n] each
    in_vocab = tree.path_max_ranks().to(values.device) < logits.shape[-1]  # [n]
    values = values.masked_fill(~in_vocab, -1.0)
    kept = torch.zeros_like(values, dtype=torch.bool)  # [N, n]
    kept.scatter_(1, values.topk(min(max_nodes, int(in_vocab.sum())), dim=1).indices, True)
    depth_index = torch.tensor(tree.depths, device=labels.device) - 1  # [n]
    right = kept & (draft_ids == labels.to(draft_ids.device)[:, depth_index])  # [N, n]
    for i, parent in enumerate(tree.parents):  # parents first: a node counts when its whole path does
        if parent >= 0:
            right[:, i] &= right[:, parent]
    depths = torch.tensor(tree.depths, device=right.device)  # [n]
    return 1 + (right * depths).amax(dim=1)


def tree_acceptance(logits: torch.Tensor, labels: torch.Tensor, tree, max_nodes: int) -> float:
    """tree_lengths' mean over every position."""
    lengths = tree_lengths(logits, labels, tree, max_nodes)
    return float(lengths.float().mean()) if len(lengths) else 1.0


def step_acceptance(accepted: torch.Tensor, sample_lengths: list[int]) -> float:
    """Mean tokens per step of decodes that step through each sample: from its first
    position, a step at position p accepts accepted[p] tokens and the next one starts at
    p + accepted[p] (the last accepted token is its root; the target state that wrote it is
    that position's). The decode ends where the sample does (its end of text or token
    limit), so the last step keeps only the tokens up to there. accepted [N]: per position,
    the samples' positions concatenated; a sample of n positions has n tokens after its root."""
    per_position = accepted.tolist()
    tokens = steps = start = 0
    for length in sample_lengths:
        p = 0
        while p < length:
            step = min(per_position[start + p], length - p)
            tokens, steps, p = tokens + step, steps + 1, p + step
        start += length
    return tokens / steps if steps else 1.0


@torch.no_grad()
def evaluate_medusa(heads, data: MedusaData, tree=None, max_nodes: int | None = None,
                    batch_size: int = 512) -> dict:
    """{val_loss, val_chain_acceptance, val_tree_acceptance (per decode step, step_acceptance),
    val_tree_acceptance_per_position} over data (the tree: `tree`, default the heads'
    default tree, cut to max_nodes, default Medusa's node budget)."""
    from speculators.medusa import SPECULATOR
    from speculators.medusa import CompiledTree, default_choices
    tree = tree or CompiledTree(default_choices(heads.num_heads))
    max_nodes = max_nodes or SPECULATOR.num_speculative_tokens
    heads.eval()
    total_loss, chain, in_tree = 0.0, [], []
    for start in range(0, len(data), batch_size):
        x, y = data.features[start:start + batch_size], data.labels[start:start + batch_size]
        with autocast(heads):
            loss, logits = medusa_loss(heads, x, y, data.roots[start:start + batch_size])
        labels = heads.draft_ids(y.to(logits.device))  # [b, K]
        total_loss += float(loss) * len(x)
        chain.append(chain_lengths(logits, labels).cpu())
        in_tree.append(tree_lengths(logits, labels, tree, max_nodes).cpu())
    heads.train()
    if not chain:
        return {"val_loss": 0.0, "val_chain_acceptance": 1.0, "val_tree_acceptance": 1.0,
                "val_tree_acceptance_per_position": 1.0}
    chain, in_tree = torch.cat(chain), torch.cat(in_tree)  # [N] each
    return {"val_loss": total_loss / len(data), "val_chain_acceptance": step_acceptance(chain, data.sample_lengths),
            "val_tree_acceptance": step_acceptance(in_tree, data.sample_lengths),
            "val_tree_acceptance_per_position": float(in_tree.float().mean())}


def train_medusa(heads, train: MedusaData, val: MedusaData, steps: int, lr: float = 1e-3, batch_size: int = 256,
                 max_seconds: float | None = None, eval_every: int = 200, seed: int = 0,
                 on_eval=None, progress: bool = True) -> dict:
    """AdamW with warm-up and cosine decay over `steps` (or until max_seconds); returns the
    final validation figures (evaluate_medusa's, with step and seconds). on_eval(figures)
    is called at each evaluation (e.g. to checkpoint)."""
    from tqdm import tqdm
    params = [p for p in heads.parameters() if p.requires_grad]
    optimizer, schedule = optimizer_with_schedule(params, lr, steps, betas=(0.9, 0.999))
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
        with autocast(heads):
            loss, _ = medusa_loss(heads, train.features[batch], train.labels[batch], train.roots[batch])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}")
        out_of_time = max_seconds is not None and time.perf_counter() - start > max_seconds
        if step % eval_every == 0 or step == steps or out_of_time:
            result = {"step": step, **evaluate_medusa(heads, val), "seconds": time.perf_counter() - start}
            message = (f"step {step}: validation loss {result['val_loss']:.3f}, acceptance per step of the top-1 "
                       f"chain {result['val_chain_acceptance']:.2f}, of the tree {result['val_tree_acceptance']:.2f} "
                       f"({result['val_tree_acceptance_per_position']:.2f} over every position)")
            log.info(message)
            bar.write(message)
            if on_eval is not None:
                on_eval(result)
        if out_of_time:
            break
    bar.close()
    heads.eval()
    return result
