"""What the engine hands back for a request after each step."""
from __future__ import annotations

from dataclasses import dataclass

from runtime.logprobs import TokenLogprobs
from runtime.sequence import RequestMetrics


@dataclass(slots=True)
class RequestOutput:
    """What a request has produced so far (and what is new since the last step)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all output tokens so far
    text: str  # all output text so far (stop string removed)
    new_token_ids: list[int]
    delta_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    metrics: RequestMetrics
    logprobs: list[TokenLogprobs] | None = None  # per output token so far, when the request asked for them
    error: str | None = None  # why the request failed (finish_reason "error")
