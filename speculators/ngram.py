"""Prompt lookup (Saxena 2023; vLLM's `ngram` method): the simple baseline proposer.

For n from prompt_lookup_max down to prompt_lookup_min, find the most recent earlier
occurrence of the sequence's last n tokens and propose the tokens that followed it, as
one chain. Stateless: every step searches the whole sequence (vectorised, O(L * n)).
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from speculators.base import Proposer, ProposalRequest
from runtime.draft_tree import DraftTree
from speculators.registry import Speculator
from speculators.settings import PROMPT_LOOKUP, check_prompt_lookup


class NGramProposer(Proposer):
    name = "ngram"

    def __init__(self, prompt_lookup_min: int = 2, prompt_lookup_max: int = 4):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{prompt_lookup_min} and {prompt_lookup_max}")
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, requests: list[ProposalRequest]) -> list[DraftTree]:
        return [DraftTree.chain(self.lookup(r.token_ids, r.max_nodes)) for r in requests]

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
        tokens = np.asarray(token_ids, dtype=np.int64)  # [L]
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # windows starting at 0 .. L-n-1: each has at least one token after it
            windows = sliding_window_view(tokens[:-1], n)  # [L - n, n]
            starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if starts.size:
                start = int(starts[-1]) + n
                return tokens[start:start + k].tolist()
        return []


def _build(config, target) -> NGramProposer:
    return NGramProposer(config.prompt_lookup_min, config.prompt_lookup_max)


SPECULATOR = Speculator("ngram", _build, num_speculative_tokens=4, tree_width=1, settings=PROMPT_LOOKUP,
                        check=check_prompt_lookup)
