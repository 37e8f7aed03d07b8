"""How many draft tokens each sequence gets this step: measured acceptance against
measured cost.

Two things are measured as the engine runs:
  - per request, the conditional acceptance rate a (the chance that a draft token is
    accepted given that its parent was), an exponential moving average over verdicts;
  - the step time as a + b * tokens (StepCostModel), fitted online on steps without
    prefill, forgetting old steps, so b is the marginal cost of one more verified token
    in the current regime (nearly free when memory-bound, a full token's compute when
    the batch is large).

A sequence's j-th draft token (a chain, or the j-th node of a tree) adds a^j expected
tokens. Draft tokens are handed out greedily by that gain while it beats the step's
current throughput: adding gain g at cost b raises tokens / time iff g / b > E / t.
So drafts are long when acceptance is high and verification is cheap, shrink as the
batch grows, and stop for a sequence whose drafts keep missing; such a sequence gets a
one-token probe every `probe_interval` steps so that its estimate can recover.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass


class StepCostModel:
    """Least-squares fit of step seconds = intercept + slope * tokens with exponential
    forgetting; the slope is pulled toward `prior_ratio` x the mean step time while the
    token counts seen barely vary (ridge with weight `prior_weight`, in tokens^2)."""

    def __init__(self, decay: float = 0.97, prior_ratio: float = 0.02, prior_weight: float = 1.0):
        self.decay = decay
        self.prior_ratio = prior_ratio
        self.prior_weight = prior_weight
        self.s0 = self.sx = self.sy = self.sxx = self.sxy = 0.0

    @property
    def has_data(self) -> bool:
        return self.s0 > 0

    def observe(self, num_tokens: int, seconds: float) -> None:
        d = self.decay
        x, y = float(num_tokens), float(seconds)
        self.s0 = d * self.s0 + 1.0
        self.sx = d * self.sx + x
        self.sy = d * self.sy + y
        self.sxx = d * self.sxx + x * x
        self.sxy = d * self.sxy + x * y

    def coefficients(self) -> tuple[float, float]:
        """(intercept, slope) in seconds and seconds per token."""
        mean_x, mean_y = self.sx / self.s0, self.sy / self.s0
        var_x = max(self.sxx / self.s0 - mean_x * mean_x, 0.0)
        cov = self.sxy / self.s0 - mean_x * mean_y
        prior_slope = self.prior_ratio * mean_y
        slope = (cov + self.prior_weight * prior_slope) / (var_x + self.prior_weight)
        slope = max(slope, 1e-3 * prior_slope, 1e-9)
        return max(mean_y - slope * mean_x, 0.0), slope


@dataclass(slots=True)
class _Acceptance:
    rate: float
    steps_without_draft: int = 0


class SpeculationController:
    def __init__(self, adaptive: bool = True, prior_acceptance: float = 0.6, smoothing: float = 0.2,
                 probe_interval: int = 8):
        self.adaptive = adaptive
        self.prior_acceptance = prior_acceptance
        self.smoothing = smoothing
        self.probe_interval = probe_interval
        self.cost = StepCostModel()
        self.requests: dict[str, _Acceptance] = {}

    def acceptance(self, request_id: str) -> float:
        state = self.requests.get(request_id)
        return self.prior_acceptance if state is None else state.rate

    def budgets(self, request_ids: list[str], caps: list[int]) -> list[int]:
        """Draft nodes per sequence this step, each at most its cap."""
        if not self.adaptive or not self.cost.has_data:
            return list(caps)
        intercept, per_token = self.cost.coefficients()
        expected = float(len(caps))  # every sequence emits at least one token
        seconds = intercept + per_token * len(caps)
        rates = [self.acceptance(r) for r in request_ids]
        budgets = [0] * len(caps)
        heap = [(-rate, i) for i, (rate, cap) in enumerate(zip(rates, caps)) if cap > 0]
        heapq.heapify(heap)
        while heap:
            neg_gain, i = heap[0]
            if -neg_gain * seconds <= per_token * expected:
                break
            heapq.heappop(heap)
            budgets[i] += 1
            expected -= neg_gain
            seconds += per_token
            if budgets[i] < caps[i]:
                heapq.heappush(heap, (neg_gain * rates[i], i))
        for i, request_id in enumerate(request_ids):
            state = self.requests.setdefault(request_id, _Acceptance(self.prior_acceptance))
            if budgets[i] == 0 and caps[i] > 0 and state.rate < self.prior_acceptance:  # shut off by misses
                state.steps_without_draft += 1
                if state.steps_without_draft >= self.probe_interval:
                    budgets[i] = 1
                    state.steps_without_draft = 0
        return budgets

    def observe_verdict(self, request_id: str, num_accepted: int, rejected: bool) -> None:
        """A verify step accepted num_accepted draft tokens, then (if rejected) missed one."""
        state = self.requests.setdefault(request_id, _Acceptance(self.prior_acceptance))
        state.steps_without_draft = 0
        for outcome in [1.0] * num_accepted + ([0.0] if rejected else []):
            state.rate += self.smoothing * (outcome - state.rate)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.cost.observe(num_tokens, seconds)

    def release(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
