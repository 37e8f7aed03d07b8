"""Proposers behind one interface (speculators.base): prompt lookup (`ngram`), the
Lookahead Cache (`lookahead`); the draft model, EAGLE and Medusa come next.

`build_proposer(name, config)` makes one from the engine's settings (runtime.config.EngineConfig).
"""
from __future__ import annotations

from speculators.base import ProposalRequest, Proposer
from speculators.tree import DraftTree

NOT_YET_AVAILABLE = ("draft", "eagle", "medusa")


def check_available(name: str) -> None:
    """ValueError unless a proposer of that name can be built (names: runtime.sampling_params.SPECULATORS)."""
    if name in NOT_YET_AVAILABLE:
        raise ValueError(f"speculator {name!r} is not available yet in this version; use ngram or lookahead")


def build_proposer(name: str, config) -> Proposer:
    check_available(name)
    if name == "ngram":
        from speculators.ngram import NGramProposer
        return NGramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if name == "lookahead":
        from speculators.lookahead import LookaheadProposer
        return LookaheadProposer(max_depth=max(config.speculative_tokens("lookahead"), 1),
                                 min_match=config.prompt_lookup_min, max_match=config.prompt_lookup_max,
                                 global_max_nodes=config.lookahead_global_nodes)
    raise ValueError(f"unknown speculator {name!r}")


__all__ = ["DraftTree", "ProposalRequest", "Proposer", "build_proposer", "check_available"]
