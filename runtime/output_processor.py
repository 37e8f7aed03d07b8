"""Tokens in, RequestOutput out: appends a step's tokens to a sequence one at a time,
detokenizes them incrementally, and applies the request's stop conditions (EOS, stop
token ids, stop strings, max_tokens, the context length)."""
from __future__ import annotations

from dataclasses import dataclass, field

from runtime.detokenizer import Detokenizer, DetokenizerState, find_stop
from runtime.logprobs import TokenLogprobs
from runtime.outputs import RequestOutput
from runtime.sequence import Sequence


@dataclass(slots=True)
class RequestState:
    seq: Sequence
    detok: DetokenizerState = field(default_factory=DetokenizerState)
    logprobs: list[TokenLogprobs] | None = None  # per output token, when params.logprobs is set


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int):
        self.detokenizer = Detokenizer(tokenizer)
        self.max_model_len = max_model_len

    def append(self, state: RequestState, token_ids: list[int],
               logprobs: list[TokenLogprobs] | None) -> RequestOutput:
        """Append tokens until they run out or a stop condition holds (the output's
        finish_reason says which; the caller finishes the sequence); report what was
        appended and, when asked for, its logprobs."""
        seq, params = state.seq, state.seq.params
        appended: list[int] = []
        delta_text = ""
        reason = None
        for token in token_ids:
            seq.append_token(token)
            appended.append(token)
            if seq.constraint is not None:
                seq.constraint.accept(token)
            delta = self.detokenizer.delta(seq.output_token_ids, state.detok)
            if delta and params.stop:
                delta, reason = self._cut_at_stop(seq, delta)
            seq.output_text += delta
            delta_text += delta
            reason = reason or self._stop_reason(seq, token)
            if reason is not None:
                break
        if state.logprobs is not None:
            state.logprobs.extend(logprobs[:len(appended)])
        return RequestOutput(seq.request_id, seq.prompt_token_ids, seq.output_token_ids, seq.output_text,
                             appended, delta_text, reason is not None, reason, seq.metrics,
                             None if state.logprobs is None else list(state.logprobs))

    @staticmethod
    def _cut_at_stop(seq: Sequence, delta: str) -> tuple[str, str | None]:
        """(the new text up to a stop string, "stop") when one has appeared; else (delta, None)."""
        params = seq.params
        text = seq.output_text + delta
        at = find_stop(text, len(delta), params.stop)
        if at == -1:
            return delta, None
        stop = next(s for s in params.stop if text.startswith(s, at))
        end = at + len(stop) if params.include_stop_str_in_output else at
        return (text[len(seq.output_text):end] if end > len(seq.output_text) else ""), "stop"

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if (not params.ignore_eos and token in seq.eos_token_ids) or token in params.stop_token_ids:
            return "stop"
        if seq.constraint is not None and seq.constraint.is_finished:
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    @staticmethod
    def failed(state: RequestState | None, seq: Sequence, error: Exception) -> RequestOutput:
        """The last output of a request that failed (finish reason "error"), saying why."""
        return RequestOutput(seq.request_id, seq.prompt_token_ids, seq.output_token_ids, seq.output_text, [], "",
                             True, "error", seq.metrics, None if state is None else state.logprobs,
                             f"{type(error).__name__}: {error}")
