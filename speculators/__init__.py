"""Proposers behind one interface (speculators.base): prompt lookup (`ngram`), the
Lookahead Cache (`lookahead`), a draft model (`draft`, run by draft_cpu's worker), Medusa
heads on the target's hidden state (`medusa`), and an EAGLE head drafting EAGLE-2 trees
from the target's features (`eagle`); several at once, their trees merged
(`eagle+lookahead`, speculators/composite.py). Medusa and EAGLE heads are trained by
self-distillation in the top-level training/ package (not part of the inference packages:
none of them imports it); a trained EAGLE-3 head for the default model ships in
speculators/heads/.

Each speculator declares itself (name, defaults, settings) in its own file; the registry
(speculators.registry) lists them, and `build_proposer(name, config, target)` makes one
from the engine's settings (runtime.config.EngineConfig) and what it knows of the target
(TargetInfo).
"""
from __future__ import annotations

from speculators.base import ProposalRequest, Proposer, TargetInfo
from speculators.registry import Setting, Speculator, build_proposer, register

__all__ = ["ProposalRequest", "Proposer", "Setting", "Speculator", "TargetInfo", "build_proposer", "register"]
