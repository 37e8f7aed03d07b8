"""Choosing the tokens a step emits: lossless verification of draft trees.

Every sequence of a step comes with a draft tree (empty for plain decoding) and its
target logits for the root (the last committed token) and for each node. Walking down
from the root:

  - Greedy: follow the child whose token is the target's argmax at the current node;
    when no child matches (or there are none), emit the argmax itself.
  - Sampling (temperature, top-k, top-p applied to the target first, runtime.sampling):
    recursive rejection sampling (SpecInfer, Miao et al. 2024; for one child per node it
    is exactly Leviathan et al. 2023 / Chen et al. 2023). At a node with target
    distribution p, the residual r starts as p; its children are tried in order: child x
    drawn from q is accepted with probability min(1, r(x) / q(x)); after a rejection
    r <- norm(max(r - q, 0)). When a child is accepted the walk moves there; when all are
    rejected the *recovered* token is drawn from r; at a node without children the
    *bonus* token is drawn from p.
    A proposal without draft probabilities is one-hot (q = indicator of x): acceptance is
    r(x) and the residual drops x. That is run in its coupled form: draw y from p, accept
    the child whose token is y, else emit y (see _match_one_hot) -- the same law, one
    draw per emitted token.

Each emitted token is then distributed exactly as the target (after its filters) says,
whatever the proposer did. Draws use the request's own generator when it has a seed, so
seeded runs are reproducible; with one-hot proposers (n-gram, lookahead) a seeded
request's output is even the same as without speculation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.sampling import target_probs
from runtime.sampling_params import SamplingParams
from runtime.structured_output import StepMasks
from runtime.verify_layout import VerifyLayout, root_rows


@dataclass(slots=True)
class Verdict:
    """What one sequence keeps from a step."""

    accepted_nodes: list[int]  # draft node indices along the accepted path (depth 1, 2, ...)
    accepted_token_ids: list[int]
    next_token_id: int  # the token after the accepted path
    kind: str  # "plain" (no draft), "bonus" (the path reached a leaf) or "recovered" (all children rejected)

    @property
    def token_ids(self) -> list[int]:
        return self.accepted_token_ids + [self.next_token_id]


def residual_after_rejection(residual: torch.Tensor, q: torch.Tensor | None, token_id: int) -> torch.Tensor:
    """norm(max(r - q, 0)) after the draft token `token_id` drawn from q was rejected;
    q None is one-hot on token_id. residual, q: [V]; returns a new tensor."""
    if q is None:
        out = residual.clone()
        out[token_id] = 0.0
    else:
        out = (residual - q).clamp_min_(0.0)
    total = out.sum()
    if float(total) <= 0.0:  # only when r == q up to rounding, where rejection cannot happen
        return residual.clone()
    return out / total


class RejectionSampler:
    def __init__(self, seed: int | None = None):
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def verify(self, logits: torch.Tensor, layout: VerifyLayout, masks: StepMasks | None = None) -> list[Verdict]:
        """One Verdict per sampling sequence of a step's layout; logits [R, V] as it says,
        masked in place first where a sequence keeps to a grammar: with the layout's masks
        (runtime.structured_output.StepMasks, filled while the target ran), else filled now."""
        seqs = layout.sampled_seqs
        trees = (masks or StepMasks.of(layout, torch.device("cpu"))).apply(logits)
        return self(logits, trees, [s.params for s in seqs], [s.generator for s in seqs])

    def __call__(self, logits: torch.Tensor, trees: list, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> list[Verdict]:
        """logits [R, V] with 1 + len(tree) rows per sequence (root, then node 0, 1, ...);
        trees: DraftTree per sequence (runtime.draft_tree); one Verdict per sequence."""
        row_starts = root_rows(trees)  # runtime.verify_layout: the logits layout
        assert logits.shape[0] == sum(1 + len(tree) for tree in trees), (logits.shape, len(trees))
        if all(p.is_greedy for p in params):
            argmax = logits.argmax(dim=-1).tolist()
            return [_walk_greedy(tree, argmax, start) for tree, start in zip(trees, row_starts)]
        row_params = [p for p, tree in zip(params, trees) for _ in range(1 + len(tree))]
        probs = target_probs(logits.float(), row_params)  # [R, V]
        argmax = logits.argmax(dim=-1).tolist() if any(p.is_greedy for p in params) else []
        return [_walk_greedy(tree, argmax, start) if p.is_greedy
                else _walk_sampled(tree, probs, start, gen or self.generator)
                for tree, start, p, gen in zip(trees, row_starts, params, generators)]


def _walk_sampled(tree, probs: torch.Tensor, row_start: int, gen: torch.Generator) -> Verdict:
    children = tree.children()
    node, accepted = -1, []
    while True:
        p = probs[row_start + node + 1]  # [V]
        kids = children[node + 1]
        if not kids:
            kind = "bonus" if len(tree) else "plain"
            return Verdict(accepted, [tree.token_ids[i] for i in accepted], _draw(p, gen), kind)
        if tree.draft_probs is None:
            child, token = _match_one_hot(tree, kids, p, gen)
        else:
            child, token = _recursive_rejection(tree, kids, p, gen)
        if child is None:
            return Verdict(accepted, [tree.token_ids[i] for i in accepted], token, "recovered")
        node = child
        accepted.append(child)



def _match_one_hot(tree, kids: list[int], p: torch.Tensor, gen: torch.Generator) -> tuple[int | None, int]:
    """One-hot children: draw y from p and accept the child whose token is y, if any.

    This is recursive rejection sampling with q = indicator, coupled: child x_i is accepted
    with probability p(x_i) / (1 - p(x_1) - ... - p(x_{i-1})) either way, and a miss emits
    y, which is then distributed as p without the children's tokens, i.e. the residual.
    Drawing exactly one token per emitted token makes a seeded request's output the same
    as without speculation (same draws, same target distributions)."""
    token = _draw(p, gen)
    return next((c for c in kids if tree.token_ids[c] == token), None), token


def _recursive_rejection(tree, kids: list[int], p: torch.Tensor, gen: torch.Generator) -> tuple[int | None, int]:
    """Children drawn from their draft_probs rows: try each in order (SpecInfer)."""
    residual = p
    for child in kids:
        token = tree.token_ids[child]
        q = tree.draft_probs[child].to(p.device)
        q_token = float(q[token])
        ratio = float(residual[token]) / q_token if q_token > 0 else float(residual[token] > 0)
        if float(torch.rand((), generator=gen)) < ratio:
            return child, token
        residual = residual_after_rejection(residual, q, token)
    return None, _draw(residual, gen)


def _walk_greedy(tree, argmax: list[int], row_start: int) -> Verdict:
    node, accepted = -1, []
    children = tree.children() if len(tree) else [[]]
    while True:
        target = argmax[row_start + node + 1]
        kids = children[node + 1]
        match = next((c for c in kids if tree.token_ids[c] == target), None)
        if match is None:
            kind = "recovered" if kids else ("bonus" if len(tree) else "plain")
            return Verdict(accepted, [tree.token_ids[i] for i in accepted], target, kind)
        node = match
        accepted.append(match)


def _draw(probs: torch.Tensor, gen: torch.Generator) -> int:
    """One token from probs [V] (any device, need not sum to 1) by inverse CDF: the uniform
    comes from the request's CPU generator, the search runs where probs are, and only the
    token id crosses back (not the [V] row). Zero-probability tokens are never drawn: the
    clamp is the first index where the CDF reaches its total, the last positive one."""
    cdf = probs.double().cumsum(0)  # [V]
    u = torch.rand((), dtype=torch.float64, generator=gen).to(cdf.device)
    token = torch.searchsorted(cdf, u * cdf[-1], right=True)
    return int(torch.minimum(token, cdf.argmax()))
