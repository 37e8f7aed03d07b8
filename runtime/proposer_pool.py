"""The proposers one engine runs, and everything between them and the step.

The pool builds a speculator's proposer on first use (speculators.registry), a
combination's from the pool's proposers of its parts (one draft worker, one EAGLE head,
whichever names the requests use), and has the target hand out the feature layers its
proposers read; it keeps a circuit breaker per
proposer (a failing proposer costs drafts, never requests: docs/architecture.md, Nothing
is lost); it sizes each sequence's draft with the SpeculationController and asks each
proposer for its sequences' trees; it lets proposers with their own worker draft ahead
while the target verifies; and after verification it hands them what they read (the
target's features, logits and hidden states) and what was kept.
"""
from __future__ import annotations

import logging
import time

import torch

from runtime.circuit_breaker import CircuitBreaker
from runtime.sequence import Sequence
from runtime.speculation import SpeculationController
from runtime.verify_layout import EMPTY_TREE, VerifyLayout
from speculators import ProposalRequest, Proposer, TargetInfo, build_proposer
from speculators import registry

log = logging.getLogger("runtime.proposer_pool")
NONE = "none"


class ProposerPool:
    def __init__(self, config, target: TargetInfo, runner):
        self.config = config  # runtime.config.EngineConfig
        self.target = target
        self.runner = runner  # target_gpu.model_runner.ModelRunner: hands out feature layers
        self.proposers: dict[str, Proposer] = {}
        self.breakers: dict[str, CircuitBreaker] = {}  # per proposer: repeated failures turn it off a while
        # plain steps compiled, verify steps eager (the CPU): the controller measures a plain step
        compiled_plain = getattr(runner, "compiled_decode", None) is not None
        self.controller = SpeculationController(adaptive=config.adaptive_speculation, plain_probe=compiled_plain)
        self.proposed_at = 0.0  # time.perf_counter() when the last propose() returned
        self.loaded = False  # load() has built the speculators of the start

    # ---- building -----------------------------------------------------------------------
    def get(self, name: str) -> Proposer:
        """The proposer for a speculator name, built on first use; ValueError when it cannot be,
        or when it would load weights after start and the config says not to."""
        proposer = self.proposers.get(name)
        if proposer is None:
            self._check_may_build(name)
            proposer = build_proposer(name, self.config, self.target, part=self.get)  # parts first
            self.proposers[name] = proposer
            try:
                self._sync_feature_layers()
            except ValueError:
                self.proposers.pop(name).close()
                raise
        return proposer

    def _check_may_build(self, name: str) -> None:
        if not self.loaded or self.config.load_speculators_on_request:
            return
        unbuilt = [part for part in registry.parts(name)
                   if part not in self.proposers and registry.get(part).loads_weights]
        if unbuilt:
            built = ", ".join(self.proposers) or "none"
            raise ValueError(f"speculator {unbuilt[0]!r} loads weights and was not built at start (built: {built}); "
                             f"start the server with --speculators {','.join(unbuilt)} (speculators=...) for requests to use it")

    def _sync_feature_layers(self) -> None:
        """Have the target hand out the layer inputs the proposers read (EAGLE-3's), no others."""
        wanted = {p.feature_layers for p in self.proposers.values() if p.feature_layers}
        if len(wanted) > 1:
            raise ValueError(f"the loaded proposers read different target layers: {sorted(wanted)}")
        self.runner.set_feature_layers(wanted.pop() if wanted else ())

    def load(self) -> None:
        """Build the speculators of the start now (--speculator and --speculators: a bad setting
        fails at start), and a draft model when one is configured (so that requests may ask for it)."""
        config = self.config
        for name in config.start_speculators():
            self.get(name)
        if config.draft_model:
            self.get("draft")
        self._sync_feature_layers()  # none wanted: the last pool's, if any, are dropped
        self.loaded = True
        if self.proposers:
            log.info("speculation: %s, %d draft tokens per step, tree width %d, %s; built: %s", config.speculator,
                     config.speculative_tokens(config.speculator), config.tree_width(config.speculator),
                     "adaptive" if config.adaptive_speculation else "fixed", ", ".join(self.proposers))

    def rebuilt(self, config) -> ProposerPool:
        """A pool for another config, loaded, this one closed; on an error, this one loaded
        again and the error raised."""
        self.close()
        pool = ProposerPool(config, self.target, self.runner)
        try:
            pool.load()
        except Exception:
            pool.close()
            self.load()
            raise
        return pool

    def needs_features(self, name: str) -> bool:
        return name != NONE and self.get(name).needs_features

    @property
    def wants_features(self) -> bool:
        return any(p.needs_features for p in self.proposers.values())

    def hidden_for(self, layout: VerifyLayout) -> bool | str:
        """What a step's target pass returns besides logits: "all" (every token's hidden
        states) when one of its sequences feeds features to its proposer, True (the logits
        rows') when a loaded proposer reads hidden states, else False. Steps without such
        sequences keep the compiled decode step, whatever else is loaded."""
        if self.wants_features and any(self.needs_features(seq.speculator) for seq in layout.seqs):
            return "all"
        return self.wants_hidden

    @property
    def wants_hidden(self) -> bool:
        return self.wants_features or any(p.needs_hidden_states for p in self.proposers.values())

    @property
    def wants_last_outputs(self) -> bool:
        return self.wants_hidden or any(p.needs_logits for p in self.proposers.values())

    def close(self) -> None:
        """Close the proposers (the target keeps handing out their feature layers until the
        next pool loads: resetting them would recompile its step on the way out)."""
        for proposer in reversed(list(self.proposers.values())):  # last built first: each undoes its placement
            proposer.close()
        self.proposers.clear()

    # ---- drafting -----------------------------------------------------------------------
    def _breaker(self, name: str) -> CircuitBreaker:
        breaker = self.breakers.get(name)
        if breaker is None:
            breaker = self.breakers[name] = CircuitBreaker(name)
        return breaker

    def _cap(self, seq: Sequence, max_model_len: int) -> int:
        """The most draft nodes seq may verify this step (0: decode plainly)."""
        if seq.speculator == NONE or seq.num_uncomputed_tokens != 1 or self._breaker(seq.speculator).is_open:
            return 0
        params = seq.params
        cap = (params.num_speculative_tokens if params.num_speculative_tokens is not None
               else self.config.speculative_tokens(seq.speculator))
        # the step emits accepted + 1 tokens: stay within max_tokens and the context
        return max(0, min(cap, params.max_tokens - seq.num_output_tokens - 1, max_model_len - seq.num_tokens - 1))

    def propose(self, running: list[Sequence], max_model_len: int) -> None:
        """Set each decoding sequence's draft_tree for this step, sized by the controller,
        which also hears how long drafting took."""
        start = time.perf_counter()
        for seq in running:
            seq.draft_tree = None
        capped = [(seq, cap) for seq in running if (cap := self._cap(seq, max_model_len)) > 0]
        budgets = self.controller.budgets([seq.request_id for seq, _ in capped], [cap for _, cap in capped]) \
            if capped else []
        groups: dict[str, list[tuple[Sequence, int]]] = {}
        for (seq, _), budget in zip(capped, budgets):
            if budget > 0:
                groups.setdefault(seq.speculator, []).append((seq, budget))
        depths = [self._propose_group(name, group) for name, group in groups.items()]
        for seq, cap in capped:
            if seq.constraint is not None:
                self._force(seq, cap)
        self.proposed_at = time.perf_counter()
        depth = max((d for d, _ in depths), default=0)
        if depth:
            self.controller.observe_drafting(depth, sum(s for _, s in depths), self.proposed_at - start)

    def _propose_group(self, name: str, group: list[tuple[Sequence, int]]) -> tuple[int, int]:
        width = self.config.tree_width(name)
        requests = [ProposalRequest(seq.request_id, seq.token_ids, seq.num_prompt_tokens, budget, width, seq.params,
                                    seq.generator, seq.last_logits, seq.last_hidden, seq.pending_features)
                    for seq, budget in group]
        for seq, _ in group:  # the proposer has them now
            seq.pending_features = []
        try:
            trees = self.get(name).propose(requests)
        except Exception:  # a failing proposer costs its drafts, never the step
            log.exception("proposer %s failed; these sequences decode without drafts this step", name)
            self._breaker(name).record_failure()
            return 0, 0
        self._breaker(name).record_success()
        depth = total = 0
        for (seq, budget), tree in zip(group, trees):
            if seq.constraint is not None and len(tree):  # what the grammar forbids costs no target work
                pruned = seq.constraint.prune(tree)
                seq.metrics.num_pruned_draft_tokens += len(tree) - len(pruned)
                tree = pruned
            if len(tree):
                seq.draft_tree = tree.truncated(budget)
                depth = max(depth, seq.draft_tree.max_depth)
                total += seq.draft_tree.max_depth
        return depth, total

    @staticmethod
    def _force(seq: Sequence, cap: int) -> None:
        """Add to seq's draft what its grammar forces after each path, within its cap (even
        when the controller gave it no drafts: a forced token is accepted whenever its path
        is, for one more verified row)."""
        tree = seq.draft_tree or EMPTY_TREE
        extended = seq.constraint.extend(tree, max_depth=cap, max_new=cap)
        if len(extended) > len(tree):
            seq.metrics.num_forced_draft_tokens += len(extended) - len(tree)
            seq.draft_tree = extended

    def draft_ahead(self, layout: VerifyLayout) -> list:
        """Let proposers with their own worker keep drafting while the target verifies,
        each once for all its sequences (a combination's parts are the pool's proposers of
        those names) and only while its breaker is closed; returns the events to set when
        verification is done."""
        verifying: dict[str, list] = {}  # part name -> (request id, tree) pairs
        for seq, tree in zip(layout.seqs, layout.trees):
            for part in (registry.parts(seq.speculator) if len(tree) else ()):
                verifying.setdefault(part, []).append((seq.request_id, tree))
        events = []
        for part, pairs in verifying.items():
            if self._breaker(part).is_open:
                continue
            try:
                done = self.proposers[part].draft_ahead(pairs)
            except Exception:
                log.exception("proposer %s failed to draft ahead", part)
                self._breaker(part).record_failure()
                continue
            if done is not None:
                events.append(done)
        return events

    def busy_between(self, t0: float, t1: float) -> float:
        """Seconds the proposers' own workers computed within [t0, t1]."""
        return sum(p.busy_between(t0, t1) for p in self.proposers.values())

    # ---- after verification -------------------------------------------------------------
    def keep_target_outputs(self, layout: VerifyLayout, verdicts: list, logits: torch.Tensor,
                            hidden: torch.Tensor | None) -> None:
        """Queue the features of every committed token for sequences whose proposer reads
        them (hidden [T, H'] of every token run), and keep each sampling sequence's logits
        [V] and final hidden state [H] at its last kept token (hidden [R, H'] of the logits
        rows when features are not wanted)."""
        if not self.wants_last_outputs:
            return
        if self.hidden_for(layout) == "all":
            by_seq = dict(zip(layout.sampled, verdicts))
            for i, seq in enumerate(layout.seqs):
                if self.needs_features(seq.speculator):
                    verdict = by_seq.get(i)
                    rows = layout.committed_token_rows(i, verdict.accepted_nodes if verdict else [])
                    seq.pending_features.append((seq.num_computed_tokens, hidden[rows]))
            hidden = hidden[layout.logit_token_rows()]  # [R, H']
        final = None if hidden is None else hidden[:, :self.target.model.config.hidden_size]  # [R, H]
        for k, (seq, verdict) in enumerate(zip(layout.sampled_seqs, verdicts)):
            row = layout.kept_logit_rows(k, verdict.accepted_nodes)[-1]
            seq.last_logits = logits[row].clone()
            seq.last_hidden = None if final is None else final[row].clone()

    def observe_verdict(self, seq: Sequence, tree, verdict) -> None:
        """Tell the controller how seq's proposer did: the tree's forced nodes aside."""
        proposed = [node for node in verdict.accepted_nodes if node < tree.num_proposed]
        self.controller.observe_verdict(seq.request_id, len(proposed), verdict.kind == "recovered")
        self.controller.observe_tree(seq.request_id, tree.depths[:tree.num_proposed], proposed)

    def tell(self, seq: Sequence, hook: str, *args) -> None:
        """Call seq's proposer's bookkeeping hook (on_accepted, release); a failure there
        counts against the proposer, never against the request."""
        if seq.speculator not in self.proposers:
            return
        try:
            getattr(self.proposers[seq.speculator], hook)(*args)
        except Exception:
            log.exception("proposer %s failed in %s", seq.speculator, hook)
            self._breaker(seq.speculator).record_failure()

    def release(self, seq: Sequence) -> None:
        """seq has left for good: its proposer and the controller forget it."""
        self.tell(seq, "release", seq.request_id)
        self.controller.release(seq.request_id)
