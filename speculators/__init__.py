"""Proposers behind one interface (speculators.base): prompt lookup (`ngram`), the
Lookahead Cache (`lookahead`), a draft model (`draft`, run by draft_cpu's worker), Medusa
heads on the target's hidden state (`medusa`), and an EAGLE head drafting EAGLE-2 trees
from the target's features (`eagle`); several at once, their trees merged
(`eagle+lookahead`, speculators/composite.py). Medusa and EAGLE heads are trained by
self-distillation (speculators/training.py, training_medusa.py, training_eagle.py).

`build_proposer(name, config, target)` makes one from the engine's settings
(runtime.config.EngineConfig) and what it knows of the target (TargetInfo).
"""
from __future__ import annotations

from speculators.base import ProposalRequest, Proposer, TargetInfo
from speculators.tree import DraftTree

def build_proposer(name: str, config, target: TargetInfo) -> Proposer:
    from runtime.sampling_params import speculator_parts
    parts = speculator_parts(name)
    if len(parts) > 1:  # e.g. eagle+lookahead: one tree from several proposers
        from runtime.config import DEFAULT_SPECULATIVE_TOKENS
        from speculators.composite import CompositeProposer
        return CompositeProposer([build_proposer(part, config, target) for part in parts],
                                 [DEFAULT_SPECULATIVE_TOKENS.get(part, 4) for part in parts],
                                 [config.tree_width(part) for part in parts])
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
    if name == "medusa":
        from speculators.medusa import build_medusa_proposer
        return build_medusa_proposer(config, target)
    if name == "eagle":
        from speculators.eagle import build_eagle_proposer
        return build_eagle_proposer(config, target)
    raise ValueError(f"unknown speculator {name!r}")


__all__ = ["DraftTree", "ProposalRequest", "Proposer", "TargetInfo", "build_proposer"]
