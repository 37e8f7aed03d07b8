"""Token trees: what every proposer returns and what the target verifies in one pass.

A tree hangs below the sequence's last committed token (the root, not a node). Node i
holds a token and the index of its parent (-1 = the root); parents come before their
children, so any prefix of the nodes is a tree too (that is how a tree is cut to a
budget). A chain of k tokens is a tree with parents [-1, 0, 1, ...]; an empty tree means
plain decoding. Siblings are tried by the rejection sampler in node order, so proposers
put the likelier child first.

`draft_probs[i]`, when given, is the distribution node i's token was drawn from, given
the siblings drawn before it (for draws without replacement: q with those siblings
zeroed and renormalised). Without it a node is a one-hot proposal (q = indicator), which
keeps rejection sampling exact for deterministic proposers (n-gram, lookahead).

The last `num_forced` nodes, when a request keeps to a grammar, were not proposed: they
are the text the grammar forces after a path (runtime.structured_output), accepted
whenever their path is where the grammar leaves one token, verified as any draft where it
allows another split of that text. They are counted apart, so that they say nothing of
how well the proposer drafts.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class DraftTree:
    token_ids: list[int]  # [n]
    parents: list[int]  # [n], -1 = the last committed token
    draft_probs: torch.Tensor | None = None  # [n, V] float32, or None (one-hot proposals)
    num_forced: int = 0  # the last nodes, forced by the request's grammar (the module docstring)
    depths: list[int] = field(init=False)  # [n], children of the root have depth 1

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.parents):
            raise ValueError(f"{len(self.token_ids)} tokens but {len(self.parents)} parents")
        depths = []
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"node {i} has parent {parent}; parents must come before their children")
            depths.append(1 if parent == -1 else depths[parent] + 1)
        self.depths = depths
        if self.draft_probs is not None and self.draft_probs.shape[0] != len(self.token_ids):
            raise ValueError(f"draft_probs has {self.draft_probs.shape[0]} rows for {len(self.token_ids)} nodes")
        if not 0 <= self.num_forced <= len(self.token_ids):
            raise ValueError(f"{self.num_forced} forced nodes in a tree of {len(self.token_ids)}")

    @classmethod
    def chain(cls, token_ids: list[int], draft_probs: torch.Tensor | None = None) -> "DraftTree":
        return cls(list(token_ids), list(range(-1, len(token_ids) - 1)), draft_probs)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    @property
    def is_chain(self) -> bool:
        return all(parent == i - 1 for i, parent in enumerate(self.parents))

    def truncated(self, num_nodes: int) -> "DraftTree":
        """The first num_nodes nodes (a tree, since parents come first)."""
        if num_nodes < 0:
            raise ValueError(f"cannot keep {num_nodes} nodes")
        if num_nodes >= len(self):
            return self
        probs = None if self.draft_probs is None else self.draft_probs[:num_nodes]
        return DraftTree(self.token_ids[:num_nodes], self.parents[:num_nodes], probs,
                         max(0, self.num_forced - (len(self) - num_nodes)))

    @property
    def num_proposed(self) -> int:
        """The nodes the proposer drafted (the first ones)."""
        return len(self) - self.num_forced

    def children(self) -> list[list[int]]:
        """children[0] = the root's children, children[i + 1] = node i's; each in node order."""
        out: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, parent in enumerate(self.parents):
            out[parent + 1].append(i)
        return out

    def attention_mask(self) -> torch.Tensor:
        """bool [n + 1, n + 1] over (root, node 0, ..., node n-1): row r may attend to
        column c when c is r itself or one of its ancestors (the root is everyone's)."""
        n = len(self)
        mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        mask[:, 0] = True
        for i, parent in enumerate(self.parents):
            row = i + 1
            if parent >= 0:
                mask[row] = mask[parent + 1]
            mask[row, row] = True
        return mask
