"""Where each sequence's rows sit in one target pass (vLLM's SpecDecodeMetadata plays this
part there). Computed once per step; the sampler, the logprobs, the features handed to
proposers and the commit all read it.

The pass runs T tokens: for each scheduled sequence, its n new tokens, then its draft
tree's nodes (ModelRunner.execute builds its input in that order). A sequence samples
this step when its new tokens reach its last token (a prefill chunk that does not
reach it samples nothing). The logits [R, V] hold, for each sampling sequence in batch
order, 1 + len(tree) rows: the root (its last new token), then node 0, 1, ...
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

from runtime.draft_tree import DraftTree

EMPTY_TREE = DraftTree([], [])


def root_rows(trees: list[DraftTree]) -> list[int]:
    """The root's logits row of each sampling sequence, given their trees in order."""
    return [0, *accumulate(1 + len(tree) for tree in trees)][:len(trees)]


@dataclass(slots=True)
class VerifyLayout:
    seqs: list  # [B] runtime.sequence.Sequence, in batch order
    num_new_tokens: list[int]  # [B] each sequence's own tokens run this step
    trees: list[DraftTree]  # [B] the draft tree verified (EMPTY_TREE: none)
    samples: list[bool]  # [B] whether the sequence samples this step
    token_starts: list[int]  # [B] the first of its rows among the T tokens run
    sampled: list[int]  # [S] indices (into seqs) of the sampling sequences
    logit_starts: list[int]  # [S] their root's row in the logits [R, V]

    @classmethod
    def of(cls, batch) -> VerifyLayout:
        """The layout of a runtime.scheduler.ScheduledBatch, its trees cut to the scheduled
        number of draft nodes."""
        trees = [seq.draft_tree.truncated(k) if k else EMPTY_TREE
                 for seq, k in zip(batch.seqs, batch.num_draft_tokens)]
        samples = [seq.num_computed_tokens + n == seq.num_tokens for seq, n in zip(batch.seqs, batch.num_new_tokens)]
        token_starts = [0, *accumulate(n + len(t) for n, t in zip(batch.num_new_tokens, trees))][:len(trees)]
        sampled = [i for i, s in enumerate(samples) if s]
        return cls(batch.seqs, batch.num_new_tokens, trees, samples, token_starts, sampled,
                   root_rows([trees[i] for i in sampled]))

    @property
    def sampled_seqs(self) -> list:
        return [self.seqs[i] for i in self.sampled]

    @property
    def sampled_trees(self) -> list[DraftTree]:
        return [self.trees[i] for i in self.sampled]

    @property
    def is_prefill(self) -> bool:
        """Whether a prompt chunk (not one decoding token) ran for some sequence."""
        return any(not s or n > 1 for s, n in zip(self.samples, self.num_new_tokens))

    def logit_token_rows(self) -> list[int]:
        """[R] the token row (among the T run) of each logits row."""
        rows = []
        for i in self.sampled:
            root = self.token_starts[i] + self.num_new_tokens[i] - 1
            rows.extend(range(root, root + 1 + len(self.trees[i])))
        return rows

    def kept_logit_rows(self, k: int, accepted_nodes: list[int]) -> list[int]:
        """The logits rows that produced the tokens the k-th sampling sequence emits: the
        root's, then each accepted node's."""
        start = self.logit_starts[k]
        return [start] + [start + 1 + node for node in accepted_nodes]

    def committed_token_rows(self, i: int, accepted_nodes: list[int]) -> list[int]:
        """The token rows of what sequence i commits this step: its new tokens, then its
        accepted nodes."""
        start, n = self.token_starts[i], self.num_new_tokens[i]
        return list(range(start, start + n)) + [start + n + node for node in accepted_nodes]
