"""Tokens in, RequestOutput out: appends a step's tokens to a sequence one at a time,
detokenizes them incrementally, and applies the request's stop conditions (EOS, stop
token ids, stop strings, max_tokens, the context length).

A stop string may begin in text an earlier step decoded, so the last (longest stop string
- 1) characters are held back from the output until the request finishes or more text
shows they begin no stop string (as vLLM does): what has been reported is never taken
back, and the output ends where the stop string begins."""
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
    reported: int = 0  # characters of seq.output_text reported so far (the rest is held back)


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
            if seq.constraint is not None and not seq.constraint.accept(token):
                reason = "length"  # a dead end of the grammar: the output stops short of complete
                break
            seq.append_token(token)
            appended.append(token)
            delta = self.detokenizer.delta(seq.output_token_ids, state.detok)
            seq.output_text += delta
            if delta and params.stop:
                reason = self._cut_at_stop(seq, len(delta))
            reason = reason or self._stop_reason(seq, token)
            if reason is not None:
                break
        if state.logprobs is not None:
            state.logprobs.extend(logprobs[:len(appended)])
        shown = len(seq.output_text) - (0 if reason is not None else self._held_back(params))
        delta_text = seq.output_text[state.reported:shown] if shown > state.reported else ""
        state.reported = max(state.reported, shown)
        return RequestOutput(seq.request_id, seq.prompt_token_ids, seq.output_token_ids,
                             seq.output_text[:state.reported], appended, delta_text, reason is not None, reason,
                             seq.metrics, None if state.logprobs is None else list(state.logprobs))

    @staticmethod
    def _held_back(params) -> int:
        """Characters that could be the start of a stop string: not reported yet."""
        if not params.stop or params.include_stop_str_in_output:
            return 0
        return max(map(len, params.stop)) - 1

    @staticmethod
    def _cut_at_stop(seq: Sequence, new_chars: int) -> str | None:
        """"stop", with seq.output_text cut after (include_stop_str_in_output) or before the
        stop string, when the last new_chars characters completed one; else None. The cut
        never reaches reported text: a stop string begins at most (its length - 1) characters
        before the new ones, which were held back."""
        params = seq.params
        at = find_stop(seq.output_text, new_chars, params.stop)
        if at == -1:
            return None
        stop = next(s for s in params.stop if seq.output_text.startswith(s, at))
        seq.output_text = seq.output_text[:at + len(stop) if params.include_stop_str_in_output else at]
        return "stop"

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
