"""What the engine counts over its life: tokens, prefix-cache hits, speculation, and how
each step's wall time splits between drafting and verifying (docs/architecture.md, Metrics)."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from runtime.sequence import count_verification


@dataclass(slots=True)
class StepTiming:
    """One step's wall time split (seconds): draft worker busy, target busy, both at once."""

    wall: float
    draft: float
    verify: float
    overlap: float

    @property
    def idle(self) -> float:
        """Neither busy: scheduling, sampling, commit, Python between the two."""
        return max(0.0, self.wall - (self.draft + self.verify - self.overlap))


@dataclass(slots=True)
class EngineStats:
    start_time: float = field(default_factory=time.perf_counter)
    num_steps: int = 0
    num_prompt_tokens_computed: int = 0  # prompt tokens the target ran (recomputation after preemption included)
    # prefix caching: prompt tokens of the requests scheduled so far, and those served from the cache
    num_prompt_tokens_scheduled: int = 0
    num_cached_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_finished: int = 0
    num_target_tokens: int = 0  # tokens the target ran (prompt chunks, decode tokens and draft nodes)
    # speculation: draft tokens verified, accepted, verify steps, and what ended each verify step
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    num_bonus_tokens: int = 0
    num_recovered_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [d - 1]: verify steps that accepted depth d
    # time (seconds): proposers' own workers busy, the target busy, both at once (docs/architecture.md, Overlap)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    overlap_seconds: float = 0.0
    timeline: deque = field(default_factory=lambda: deque(maxlen=4096))  # StepTiming of recent steps

    def record_schedule(self, batch) -> None:
        """A runtime.scheduler.ScheduledBatch was scheduled."""
        self.num_preemptions += batch.num_preempted
        self.num_prompt_tokens_scheduled += batch.num_prompt_tokens
        self.num_cached_prompt_tokens += batch.num_cached_tokens

    def record_verification(self, num_draft_tokens: int, num_accepted: int, bonus: bool) -> None:
        count_verification(self, num_draft_tokens, num_accepted)
        if bonus:
            self.num_bonus_tokens += 1
        else:
            self.num_recovered_tokens += 1

    def record_timing(self, timing: StepTiming) -> None:
        self.draft_seconds += timing.draft
        self.verify_seconds += timing.verify
        self.overlap_seconds += timing.overlap
        self.timeline.append(timing)

    @property
    def overlap_fraction(self) -> float | None:
        """Share of the target's busy time during which a draft worker computed too."""
        return self.overlap_seconds / self.verify_seconds if self.verify_seconds else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1 + self.num_accepted_tokens / self.num_verify_steps if self.num_verify_steps else None

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Prompt tokens served from the prefix cache / prompt tokens scheduled."""
        return (self.num_cached_prompt_tokens / self.num_prompt_tokens_scheduled
                if self.num_prompt_tokens_scheduled else None)
