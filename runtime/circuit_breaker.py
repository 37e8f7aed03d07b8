"""A circuit breaker around each proposer: after repeated failures, stop calling it for a
while, then try again.

closed     the proposer is called; `max_failures` failures in a row open the breaker.
open       its sequences decode without drafts (plain decoding is always correct) until
           `cooldown_s` has passed; the cooldown doubles each time the breaker reopens,
           up to `max_cooldown_s`.
half-open  after the cooldown the next call is a trial: success closes the breaker (and
           resets the cooldown), failure opens it again.

Speculation is an optimization, so a failing proposer (a crashed draft worker, a head that
raises) costs speed, never requests; docs/architecture.md, "Nothing is lost".
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

log = logging.getLogger("runtime.circuit_breaker")


@dataclass(slots=True)
class CircuitBreaker:
    name: str
    max_failures: int = 3
    cooldown_s: float = 30.0
    max_cooldown_s: float = 600.0
    clock: object = field(default=time.monotonic, repr=False)
    failures_in_a_row: int = 0
    num_failures: int = 0  # all failures since start
    num_opened: int = 0  # times the breaker opened
    open_until: float | None = None  # None: closed
    _next_cooldown_s: float | None = None

    @property
    def is_open(self) -> bool:
        """True while calls should be skipped (a trial is allowed once the cooldown ends)."""
        return self.open_until is not None and self.clock() < self.open_until

    def record_success(self) -> None:
        if self.open_until is not None:
            log.warning("proposer %s works again: speculation back on", self.name)
        self.failures_in_a_row = 0
        self.open_until = None
        self._next_cooldown_s = None

    def record_failure(self) -> None:
        self.failures_in_a_row += 1
        self.num_failures += 1
        trial_failed = self.open_until is not None  # the call after a cooldown
        if trial_failed or self.failures_in_a_row >= self.max_failures:
            cooldown = self._next_cooldown_s or self.cooldown_s
            self._next_cooldown_s = min(2 * cooldown, self.max_cooldown_s)
            self.open_until = self.clock() + cooldown
            self.num_opened += 1
            log.error("proposer %s failed %d times in a row: its requests decode without speculation for %.0f s",
                      self.name, self.failures_in_a_row, cooldown)
