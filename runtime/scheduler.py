"""Iteration-level continuous batching (Yu et al. 2022, "Orca") with a token budget.

Every step: the running sequences first, in arrival order, each gets what it has not
computed yet (one token when decoding, the next chunk of a long prompt when prefilling),
within `max_num_batched_tokens`; then the draft trees of decoding sequences get what
budget and free blocks are left (a tree is cut to fit, never a reason to preempt); then
waiting sequences join, first come first served, while the budget, `max_num_seqs` and the
KV pool allow; a joining sequence first takes what the prefix cache holds of its tokens
(runtime.block_manager) and is scheduled for the rest. When the pool runs out, the newest
running sequence is preempted by recomputation: its blocks are freed (its full blocks stay
cached, so its recomputation is mostly cache hits unless they were evicted meanwhile) and it
goes back to the front of the queue with its tokens, to be prefilled again later. Nothing
is dropped, and the engine never crashes for lack of blocks.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from runtime.block_manager import BlockManager
from runtime.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # parallel to seqs: the sequence's own tokens
    num_draft_tokens: list[int] = field(default_factory=list)  # parallel to seqs: draft nodes to verify
    num_preempted: int = 0
    # sequences joining for the first time: their prompt tokens, and those served from the prefix cache
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens) + sum(self.num_draft_tokens)

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)
        self.num_draft_tokens.append(0)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.can_allocate(seq, num_new):
                victim = self.running.pop()  # the newest, never one already scheduled
                self._preempt(victim)
                batch.num_preempted += 1
                if victim is seq:
                    break
            else:
                self.block_manager.may_append(seq, num_new)
                batch.add(seq, num_new)
                budget -= num_new
                i += 1
        budget = self._schedule_drafts(batch, budget)
        while (self.waiting and budget > 0 and not batch.num_preempted
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            num_cached = self.block_manager.claim_cached_prefix(seq)
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self.block_manager.can_allocate(seq, num_new):
                self.block_manager.free(seq)  # the cached blocks it took stay cached
                seq.num_computed_tokens = 0
                break
            if seq.metrics.num_preemptions == 0:
                seq.metrics.num_cached_tokens = num_cached
                batch.num_prompt_tokens += seq.num_prompt_tokens
                batch.num_cached_tokens += num_cached
            self.waiting.popleft()
            self.block_manager.may_append(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, num_new)
            budget -= num_new
        return batch

    def _schedule_drafts(self, batch: ScheduledBatch, budget: int) -> int:
        """Give decoding sequences room for their draft trees (seq.draft_tree) from what is
        left; return the budget left after them."""
        for i, seq in enumerate(batch.seqs):
            tree = seq.draft_tree
            if not tree or seq.num_uncomputed_tokens != batch.num_new_tokens[i] or budget <= 0:
                continue
            num_draft = min(len(tree), budget)
            while num_draft and not self.block_manager.can_allocate(seq, batch.num_new_tokens[i] + num_draft):
                num_draft -= 1
            if num_draft:
                self.block_manager.may_append(seq, batch.num_new_tokens[i] + num_draft)
                batch.num_draft_tokens[i] = num_draft
                budget -= num_draft
        return budget

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.draft_tree = None
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take seq out of the queues for good and return its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.finish(reason)
