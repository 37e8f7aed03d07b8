"""Proposers behind one interface (speculators.base): prompt lookup (`ngram`), the
Lookahead Cache (`lookahead`), a draft model (`draft`, run by draft_cpu's worker);
EAGLE and Medusa come next.

`build_proposer(name, config, target)` makes one from the engine's settings
(runtime.config.EngineConfig) and what it knows of the target (TargetInfo).
"""
from __future__ import annotations

from speculators.base import ProposalRequest, Proposer, TargetInfo
from speculators.tree import DraftTree

NOT_YET_AVAILABLE = ("eagle", "medusa")


def check_available(name: str) -> None:
    """ValueError unless a proposer of that name can be built (names: runtime.sampling_params.SPECULATORS)."""
    if name in NOT_YET_AVAILABLE:
        raise ValueError(f"speculator {name!r} is not available yet in this version; use ngram, lookahead "
                         f"or draft")


def build_proposer(name: str, config, target: TargetInfo) -> Proposer:
    check_available(name)
    if name == "ngram":
        from speculators.ngram import NGramProposer
        return NGramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if name == "lookahead":
        from speculators.lookahead import LookaheadProposer
        return LookaheadProposer(max_depth=max(config.speculative_tokens("lookahead"), 1),
                                 min_match=config.prompt_lookup_min, max_match=config.prompt_lookup_max,
                                 global_max_nodes=config.lookahead_global_nodes)
    if name == "draft":
        from speculators.draft import build_draft_proposer
        return build_draft_proposer(config, target)
    raise ValueError(f"unknown speculator {name!r}")


__all__ = ["DraftTree", "ProposalRequest", "Proposer", "TargetInfo", "build_proposer", "check_available"]
