"""A draft vocabulary: the target tokens a speculation head's LM head covers, in EAGLE-3's
layout (Li et al. 2025). A head that projects onto the Vd < V tokens the target writes most
pays Vd / V of a full LM head per drafted token and loses only the rare tokens.

Draft id i stands for target token i + d2t[i] (d2t [Vd], saved with the head under that
name, as public EAGLE-3 checkpoints do); t2d, the way back, is derived from it. With
d2t = 0 and Vd = V the draft vocabulary is the whole target vocabulary.
"""
from __future__ import annotations

import torch

from speculators.base import IGNORE


class DraftVocabulary:
    """For nn.Module heads: call init_draft_vocab in __init__, refresh_draft_vocab after
    d2t was loaded in place; override on_draft_vocab_change to derive more from it."""

    def init_draft_vocab(self, vocab_size: int, draft_vocab_size: int) -> None:
        if not 0 < draft_vocab_size <= vocab_size:
            raise ValueError(f"a draft vocabulary of {draft_vocab_size} tokens for a target of {vocab_size}")
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))  # target id - draft id
        self.register_buffer("_t2d", torch.arange(vocab_size), persistent=False)  # draft id or IGNORE

    @property
    def draft_vocab_size(self) -> int:
        return self.d2t.numel()

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """token_ids [Vd]: the target tokens draft ids 0.. stand for (distinct, ascending)."""
        token_ids = token_ids.to(self.d2t.device)
        if token_ids.shape != self.d2t.shape:
            raise ValueError(f"a draft vocabulary of {token_ids.numel()} tokens for a head of {self.d2t.numel()}")
        self.d2t.copy_(token_ids - torch.arange(len(token_ids), device=token_ids.device))
        self.refresh_draft_vocab()

    def refresh_draft_vocab(self) -> None:
        """Derive t2d (and what on_draft_vocab_change derives) from d2t as it is now."""
        ids = self.target_ids(torch.arange(self.draft_vocab_size, device=self.d2t.device))  # [Vd]
        self._t2d.fill_(IGNORE)
        self._t2d[ids] = torch.arange(len(ids), device=ids.device)
        self.on_draft_vocab_change()

    def on_draft_vocab_change(self) -> None:
        """Hook: d2t changed."""

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def draft_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids -> draft ids; IGNORE for tokens outside the draft vocabulary (and for IGNORE)."""
        return torch.where(target_ids >= 0, self._t2d[target_ids.clamp_min(0)], IGNORE)
