"""Per-request sampling parameters, validated before anything is scheduled."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

MAX_LOGPROBS = 20  # most likely tokens reported per position (OpenAI's top_logprobs limit)
GUIDED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class GuidedSpec:
    """kind: json (value: a JSON schema, a dict or its text), json_object (any JSON object;
    value None), regex (a pattern), choice (a list of strings: exactly one of them) or
    grammar (EBNF, xgrammar's dialect of GBNF)."""

    kind: str
    value: object = None

    def __post_init__(self) -> None:
        if self.kind not in GUIDED_KINDS:
            raise ValueError(f"guided output kind must be one of {', '.join(GUIDED_KINDS)}, got {self.kind!r}")
        ok = {"json": isinstance(self.value, (dict, str)), "json_object": self.value is None,
              "regex": isinstance(self.value, str) and self.value,
              "choice": isinstance(self.value, (list, tuple)) and self.value
              and all(isinstance(c, str) and c for c in self.value),
              "grammar": isinstance(self.value, str) and self.value}[self.kind]
        if not ok:
            raise ValueError(f"guided {self.kind} needs {_NEEDS[self.kind]}, got {self.value!r:.80}")


_NEEDS = {"json": "a JSON schema", "json_object": "no value", "regex": "a non-empty pattern",
          "choice": "a non-empty list of non-empty strings", "grammar": "a non-empty EBNF grammar"}


@dataclass(slots=True)
class SamplingParams:
    """What to sample and when to stop.

    temperature == 0 means greedy. top_k == 0 (or -1) and top_p == 1 disable those filters.
    `seed` gives the request its own torch.Generator, so a run is reproducible whatever
    else is in the batch.
    """

    max_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # the log probability of each output token and of the `logprobs` most likely tokens at its
    # position (runtime.logprobs); None = none reported
    logprobs: int | None = None
    # speculation for this request; None = the engine's setting, "none" or 0 tokens = off; the
    # engine checks the name against its speculators (speculators.registry) when the request is added
    speculator: str | None = None
    num_speculative_tokens: int | None = None
    # the output held to a JSON schema, a regex, choices or a grammar (runtime.structured_output); None = free
    guided: GuidedSpec | None = None
    # completions sampled for the prompt; each is one engine request (choices())
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop or [], (list, tuple)) or not isinstance(self.stop_token_ids or [], (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings and stop_token_ids a list of integers, "
                             f"got {self.stop!r:.80} and {self.stop_token_ids!r:.80}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not _is_finite_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _is_finite_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0
        if self.seed is not None and not (_is_int(self.seed) and -2**63 <= self.seed < 2**64):
            raise ValueError(f"seed must be an integer from -2**63 to 2**64 - 1 (a torch.Generator seed), "
                             f"got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        if not isinstance(self.ignore_eos, bool) or not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(f"ignore_eos and include_stop_str_in_output must be true or false, got "
                             f"{self.ignore_eos!r} and {self.include_stop_str_in_output!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer from 0 to {MAX_LOGPROBS}, got {self.logprobs!r}")
        if self.speculator is not None and (not isinstance(self.speculator, str) or not self.speculator):
            raise ValueError(f"speculator must be a speculator's name, got {self.speculator!r}")
        if self.num_speculative_tokens is not None and (not _is_int(self.num_speculative_tokens)
                                                        or self.num_speculative_tokens < 0):
            raise ValueError(f"num_speculative_tokens must be an integer >= 0, got {self.num_speculative_tokens!r}")
        if self.guided is not None and not isinstance(self.guided, GuidedSpec):
            raise ValueError(f"guided must be a runtime.sampling_params.GuidedSpec, got {self.guided!r:.80}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def choices(self) -> list[SamplingParams]:
        """The n completions' own params (n == 1 each). Completion i of a seeded request is
        seeded seed + i: each is reproducible alone, and they differ from one another."""
        return [replace(self, n=1, seed=None if self.seed is None else self.seed + i)
                for i in range(self.n)]


def _is_int(value) -> bool:
    """An int, not a bool (True is an int to Python, not to JSON)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite_number(value) -> bool:
    """An int or float, not a bool, NaN or infinite (JSON bodies may hold NaN and Infinity)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
