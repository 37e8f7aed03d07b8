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
to the budget, the first part's nodes kept first).
Each part drafts with its own tree width. The trees are merged as tries: the first
part's nodes first, in its order, then each later part's nodes that the tree does not
hold yet (same token below the same parent), so shared prefixes are verified once.
Nodes are verified as one-hot proposals (a part's draft_probs are dropped), which is
lossless for any way of choosing the tokens; a sampled draft model merely loses the
extra acceptance its probabilities would give.
"""
from __future__ import annotations

import dataclasses

from speculators.base import ProposalRequest, Proposer
from speculators.tree import DraftTree


def merge_trees(trees: list[DraftTree]) -> DraftTree:
    """The union of trees below one root, as a trie: the first tree's nodes in its order,
    then each later tree's new nodes in theirs (parents still before children)."""
    tokens: list[int] = []
    parents: list[int] = []
    node_of: dict[tuple[int, int], int] = {}  # (parent, token) -> merged node
    for tree in trees:
        merged_index: list[int] = []  # this tree's node -> merged node
        for token, parent in zip(tree.token_ids, tree.parents):
            key = (-1 if parent < 0 else merged_index[parent], token)
            if key not in node_of:
                node_of[key] = len(tokens)
                tokens.append(token)
                parents.append(key[0])
            merged_index.append(node_of[key])
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

    def draft_ahead(self, verifying):
        """The first part that drafts during verification (a draft model) does; one at most."""
        for part in self.parts:
            done = part.draft_ahead(verifying)
            if done is not None:
                return done
        return None

    def busy_between(self, t0: float, t1: float) -> float:
        return sum(part.busy_between(t0, t1) for part in self.parts)

    def on_accepted(self, request_id: str, token_ids: list[int], num_accepted: int) -> None:
        for part in self.parts:
            part.on_accepted(request_id, token_ids, num_accepted)

    def release(self, request_id: str) -> None:
        for part in self.parts:
            part.release(request_id)

    def close(self) -> None:
        for part in self.parts:
            part.close()
