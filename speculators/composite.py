"""Several proposers drafting for one sequence, their trees merged into one verify tree
(`--speculator eagle+lookahead`).

A learned head and the Lookahead Cache miss in different places: the head guesses the
target's next words from its features, the cache copies spans the sequence has already
seen (code, lists, quoted text), often further than the head sees. Both trees hang from
the same root, so one target pass verifies their union.

Per step and sequence, the node budget the engine gives is split between the parts in
proportion to their default sizes (`shares`, e.g. 16 : 8 for eagle and lookahead), the
first part taking what rounding leaves; a part whose share rounds to 0 is not asked,
unless it reads the target's features of every committed token (EAGLE): it is asked for
at least one node every step, or it would lose them (the merged tree is then cut back
to the budget).
Each part drafts with its own tree width. The trees are merged as tries (a part's node
that the tree already holds, the same token below the same parent, is verified once),
their nodes interleaved in proportion to the parts' sizes, each part's in its own order:
every proposer puts its likelier nodes first, so the first n merged nodes are about what
the composite drafts for a budget of n, which is what the speculation controller
assumes when it measures what each node is worth (runtime.speculation).
Nodes are verified as one-hot proposals (a part's draft_probs are dropped), which is
lossless for any way of choosing the tokens; a sampled draft model merely loses the
extra acceptance its probabilities would give.
The parts belong to the engine's proposer pool, which shares each with the requests that
ask for that part alone: the composite neither closes them, nor counts their workers' time,
nor has them draft ahead during verification (the pool asks each part once a step).
"""
from __future__ import annotations

import dataclasses

from speculators.base import ProposalRequest, Proposer
from runtime.draft_tree import DraftTree


def merge_trees(trees: list[DraftTree]) -> DraftTree:
    """The union of trees below one root, as a trie. The trees' nodes are interleaved in
    proportion to the trees' sizes (tree j's k-th node at (k + 1) / len_j, the earlier tree
    first on ties), each tree's in its own order, so parents still come before children and
    the first n merged nodes hold about the same share of each tree as the whole does."""
    picks = sorted(((k + 1) / len(tree), j, k) for j, tree in enumerate(trees) for k in range(len(tree)))
    tokens: list[int] = []
    parents: list[int] = []
    node_of: dict[tuple[int, int], int] = {}  # (parent, token) -> merged node
    merged_index: list[dict[int, int]] = [{} for _ in trees]  # per tree: its node -> merged node
    for _, j, k in picks:
        parent = trees[j].parents[k]
        key = (-1 if parent < 0 else merged_index[j][parent], trees[j].token_ids[k])
        if key not in node_of:
            node_of[key] = len(tokens)
            tokens.append(key[1])
            parents.append(key[0])
        merged_index[j][k] = node_of[key]
    return DraftTree(tokens, parents)


def split_budget(max_nodes: int, shares: list[int]) -> list[int]:
    """max_nodes split in proportion to shares (floors; the first part takes the rest)."""
    total = sum(shares)
    budgets = [max_nodes * share // total for share in shares]
    budgets[0] += max_nodes - sum(budgets)
    return budgets


class CompositeProposer(Proposer):
    def __init__(self, parts: list[Proposer], shares: list[int], tree_widths: list[int]):
        if not len(parts) == len(shares) == len(tree_widths) or len(parts) < 2:
            raise ValueError("a composite proposer needs two or more parts, each with a share and a tree width")
        if min(shares) < 1:
            raise ValueError(f"every part needs a share >= 1, got {shares}")
        self.parts, self.shares, self.tree_widths = parts, shares, tree_widths
        self.name = "+".join(part.name for part in parts)
        self.needs_logits = any(part.needs_logits for part in parts)
        self.needs_hidden_states = any(part.needs_hidden_states for part in parts)
        self.needs_features = any(part.needs_features for part in parts)
        self.feature_layers = next((part.feature_layers for part in parts if part.feature_layers), ())

    def propose(self, requests: list[ProposalRequest]) -> list[DraftTree]:
        budgets = [[max(b, 1) if part.needs_features else b
                    for part, b in zip(self.parts, split_budget(r.max_nodes, self.shares))]
                   for r in requests]  # [request][part]
        trees: list[list[DraftTree]] = [[] for _ in requests]
        for j, (part, width) in enumerate(zip(self.parts, self.tree_widths)):
            asked = [i for i, b in enumerate(budgets) if b[j] > 0]
            if not asked:
                continue
            sub = [dataclasses.replace(requests[i], max_nodes=budgets[i][j], tree_width=width) for i in asked]
            for i, tree in zip(asked, part.propose(sub)):
                trees[i].append(tree)
        return [merge_trees(t).truncated(r.max_nodes) for r, t in zip(requests, trees)]

    def on_accepted(self, request_id: str, token_ids: list[int], num_accepted: int) -> None:
        for part in self.parts:
            part.on_accepted(request_id, token_ids, num_accepted)

    def release(self, request_id: str) -> None:
        for part in self.parts:
            part.release(request_id)

