"""A request's state as it moves through the engine: tokens, KV blocks, sampling and timings."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from runtime.draft_tree import DraftTree
    from runtime.structured_output import Constraint


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (time.perf_counter) and what follows from them; see docs/architecture.md, Metrics."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_tokens: int = 0  # output tokens
    num_preemptions: int = 0
    # speculation (docs/architecture.md, Metrics): draft tokens verified, of which accepted,
    # in how many verify steps (steps with a draft), and accepted counts by draft depth
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [d - 1]: steps that accepted depth d
    num_target_forwards: int = 0  # target passes this request took part in (prefill chunks included)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache when it was first scheduled
    num_pruned_draft_tokens: int = 0  # draft nodes its grammar forbade, dropped before verification
    num_forced_draft_tokens: int = 0  # draft nodes its grammar forced (runtime.draft_tree), counted in the drafts too

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def tpot_s(self) -> float | None:
        if self.finished_time is None or self.first_token_time is None or self.num_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_tokens - 1)

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per verify step: 1 + accepted / verify steps."""
        return 1 + self.num_accepted_tokens / self.num_verify_steps if self.num_verify_steps else None

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache / prompt tokens."""
        return self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    @property
    def forwards_per_token(self) -> float | None:
        return self.num_target_forwards / self.num_tokens if self.num_tokens else None

    def record_verification(self, num_draft_tokens: int, num_accepted: int) -> None:
        count_verification(self, num_draft_tokens, num_accepted)

    def as_dict(self) -> dict:
        return {"ttft_s": self.ttft_s, "tpot_s": self.tpot_s, "e2e_s": self.e2e_s,
                "num_tokens": self.num_tokens, "num_prompt_tokens": self.num_prompt_tokens,
                "num_preemptions": self.num_preemptions, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "num_verify_steps": self.num_verify_steps,
                "acceptance_rate": self.acceptance_rate, "mean_acceptance_length": self.mean_acceptance_length,
                "accepted_per_position": list(self.accepted_per_position),
                "num_target_forwards": self.num_target_forwards, "num_cached_tokens": self.num_cached_tokens,
                "num_pruned_draft_tokens": self.num_pruned_draft_tokens,
                "num_forced_draft_tokens": self.num_forced_draft_tokens,
                "prefix_cache_hit_rate": self.prefix_cache_hit_rate}


def count_verification(counts, num_draft_tokens: int, num_accepted: int) -> None:
    """One verify step into counts with num_draft_tokens, num_accepted_tokens,
    num_verify_steps and accepted_per_position (RequestMetrics, runtime.stats.EngineStats)."""
    counts.num_draft_tokens += num_draft_tokens
    counts.num_accepted_tokens += num_accepted
    counts.num_verify_steps += 1
    count_accepted_positions(counts.accepted_per_position, num_accepted)


def count_accepted_positions(per_position: list[int], num_accepted: int) -> None:
    """per_position[d - 1] += 1 for every accepted depth d (growing the list as needed)."""
    if len(per_position) < num_accepted:
        per_position.extend([0] * (num_accepted - len(per_position)))
    for depth in range(num_accepted):
        per_position[depth] += 1


_seq_counter = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One prompt being generated. `token_ids` is prompt + output so far.

    `num_computed_tokens` counts the leading tokens whose KV is in the cache; the
    scheduler runs the rest (a prefill chunk, or the one newest token when decoding).
    Preemption by recomputation resets it to 0 and frees the blocks.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # prefix caching (runtime.block_manager): whether this sequence may take cached blocks,
    # the chained hash of each full block of token_ids computed so far, and how many leading
    # blocks of block_table are cached already (taken from the cache or named in it)
    reads_prefix_cache: bool = True
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    # sliding windows: the leading blocks of block_table given back (the null block now stands there)
    num_freed_blocks: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    output_text: str = ""
    generator: torch.Generator | None = None
    speculator: str = "none"  # who drafts for it (a speculators.registry name), resolved when it is added
    draft_tree: DraftTree | None = None  # this step's proposal, set by the engine before scheduling
    constraint: Constraint | None = None  # the grammar its output keeps to (params.guided), at its committed tokens
    # the target's output for the last token, kept only when a proposer asks for it
    last_logits: torch.Tensor | None = None  # [V]
    last_hidden: torch.Tensor | None = None  # [H]
    # the target's hidden states of committed tokens not yet handed to a proposer that reads
    # features (EAGLE): (first position, [n, H]) per step
    pending_features: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.perf_counter()))

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.metrics.num_prompt_tokens = len(self.prompt_token_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        now = time.perf_counter()
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.num_tokens = self.num_output_tokens

    def finish(self, reason: str) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.metrics.finished_time = time.perf_counter()
