"""The OpenAI wire format's responses: the bodies of /v1/models, /v1/completions and
/v1/chat/completions, and their stream chunks (server-sent events: `data: {...}` chunks,
then `data: [DONE]`; with stream_options.include_usage, a last chunk with usage and no
choices). The requests: runtime.openai_protocol.

Chat tool calls (runtime.tool_calls) come back as a message's tool_calls, streamed as one
delta when the choice ends, with finish_reason "tool_calls"; a constrained call cut short by
max_tokens comes back as text. Logprobs are the model's own distribution, before
temperature and top-k/top-p (runtime.logprobs), in each endpoint's layout. `usage` has
OpenAI's counts, prompt_tokens_details.cached_tokens (the prefix cache's share of the
prompt), and an extension, `metrics`: TTFT, TPOT and end-to-end seconds and the
speculation figures (draft tokens proposed and accepted, verify steps, mean acceptance
length). Nothing here knows about HTTP or the engine loop.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Callable

from runtime.logprobs import TokenLogprobs
from runtime.outputs import RequestOutput
from runtime.tool_calls import ToolChoice, ToolStream


def model_list(model: str, created: int, max_model_len: int) -> dict:
    """The body of /v1/models: the one served model."""
    card = {"id": model, "object": "model", "created": created, "owned_by": "heterospec",
            "max_model_len": max_model_len}
    return {"object": "list", "data": [card]}


SSE_DONE = "data: [DONE]\n\n"  # the last event of every stream


def sse(data: dict) -> str:
    """One server-sent event."""
    return "data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def usage(outputs: list[RequestOutput]) -> dict:
    """OpenAI's usage of a request's choices (the last output of each), plus `metrics`."""
    num_prompt, num_output = len(outputs[0].prompt_token_ids), sum(len(out.token_ids) for out in outputs)
    metrics = [out.metrics for out in outputs]
    tpots = [m.tpot_s for m in metrics if m.tpot_s is not None]
    ttfts = [m.ttft_s for m in metrics if m.ttft_s is not None]
    e2es = [m.e2e_s for m in metrics if m.e2e_s is not None]
    accepted, verify_steps = sum(m.num_accepted_tokens for m in metrics), sum(m.num_verify_steps for m in metrics)
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output, "total_tokens": num_prompt + num_output,
            "prompt_tokens_details": {"cached_tokens": metrics[0].num_cached_tokens},
            "metrics": {"ttft_s": min(ttfts, default=None), "tpot_s": sum(tpots) / len(tpots) if tpots else None,
                        "e2e_s": max(e2es, default=None),
                        "draft_tokens": sum(m.num_draft_tokens for m in metrics), "accepted_tokens": accepted,
                        "verify_steps": verify_steps,
                        "mean_acceptance_length": 1 + accepted / verify_steps if verify_steps else None}}


def new_logprobs(out: RequestOutput) -> list[TokenLogprobs]:
    """The logprobs of the tokens this output adds."""
    if out.logprobs is None or not out.new_token_ids:
        return []
    return out.logprobs[len(out.token_ids) - len(out.new_token_ids):]


class CompletionFormat:
    """Bodies of /v1/completions: one response, or stream chunks of the same object type.
    `token_text` turns a token id into its text (for logprobs)."""

    id_prefix = "cmpl"
    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, model: str, include_usage: bool, token_text: Callable[[int], str]):
        self.request_id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.model, self.include_usage, self.token_text = model, include_usage, token_text
        self.created = int(time.time())
        self.text_offsets: dict[int, int] = {}  # choice -> text length of the tokens listed so far

    def envelope(self, object_type: str, choices: list[dict], **extra: Any) -> dict:
        return {"id": self.request_id, "object": object_type, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def chunk(self, index: int, choice: dict, logprobs: dict | None = None) -> dict:
        extra = {"usage": None} if self.include_usage else {}
        return self.envelope(self.chunk_object, [{"index": index, **choice, "logprobs": logprobs}], **extra)

    def usage_chunk(self, outputs: list[RequestOutput]) -> dict:
        return self.envelope(self.chunk_object, [], usage=usage(outputs))

    def response(self, outputs: list[RequestOutput]) -> dict:
        choices = [{"index": i, "text": out.text, "logprobs": self.logprobs(i, out.logprobs),
                    "finish_reason": out.finish_reason} for i, out in enumerate(outputs)]
        return self.envelope(self.object, choices, usage=usage(outputs))

    def chunks(self, index: int, out: RequestOutput) -> list[dict]:
        if not out.delta_text and not out.finished and not new_logprobs(out):
            return []
        logprobs = self.logprobs(index, new_logprobs(out)) if out.logprobs is not None else None
        return [self.chunk(index, {"text": out.delta_text, "finish_reason": out.finish_reason}, logprobs)]

    def logprobs(self, index: int, entries: list[TokenLogprobs] | None) -> dict | None:
        """The legacy completions layout: parallel lists, top tokens as {text: logprob}."""
        if entries is None:
            return None
        tokens = [self.token_text(e.token_id) for e in entries]
        offsets = []
        for token in tokens:
            offsets.append(self.text_offsets.get(index, 0))
            self.text_offsets[index] = offsets[-1] + len(token)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self.token_text(t): lp for t, lp in e.top} for e in entries],
                "text_offset": offsets}


class ChatFormat(CompletionFormat):
    """Bodies of /v1/chat/completions: the role comes in each choice's first chunk, then
    content deltas, then a chunk with an empty delta and the finish reason."""

    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, model: str, include_usage: bool, token_text: Callable[[int], str],
                 tools: ToolChoice | None = None):
        super().__init__(model, include_usage, token_text)
        self.sent_role: set[int] = set()
        self.tools = tools
        self.tool_streams: dict[int, ToolStream] = {}

    def response(self, outputs: list[RequestOutput]) -> dict:
        choices = []
        for i, out in enumerate(outputs):
            content, calls = self._calls(out.text, out.finish_reason)
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [call.body() for call in calls]
            choices.append({"index": i, "message": message, "logprobs": self.logprobs(i, out.logprobs),
                            "finish_reason": "tool_calls" if calls else out.finish_reason})
        return self.envelope(self.object, choices, usage=usage(outputs))

    def _calls(self, text: str, finish_reason: str | None) -> tuple[str | None, list]:
        """(content, tool calls) of a finished choice; a constrained call cut short is text."""
        if self.tools is None or (finish_reason != "stop" and self.tools.mode != "auto"):
            return text, []
        return self.tools.parse(text)

    def chunks(self, index: int, out: RequestOutput) -> list[dict]:
        chunks = []
        if index not in self.sent_role:
            self.sent_role.add(index)
            chunks.append(self.chunk(index, {"delta": {"role": "assistant", "content": ""}, "finish_reason": None}))
        logprobs = self.logprobs(index, new_logprobs(out)) if out.logprobs is not None else None
        content = out.delta_text if self.tools is None else self._stream(index).content(out.delta_text)
        if content or (logprobs and logprobs["content"]):
            chunks.append(self.chunk(index, {"delta": {"content": content}, "finish_reason": None}, logprobs))
        if out.finished:
            reason, calls = out.finish_reason, []
            if self.tools is not None:
                rest, calls = self._stream(index).finish()
                if calls and reason != "stop" and self.tools.mode != "auto":
                    rest, calls = self._stream(index).text, []
                if rest:
                    chunks.append(self.chunk(index, {"delta": {"content": rest}, "finish_reason": None}))
                if calls:
                    chunks.append(self.chunk(index, {"delta": {"tool_calls": [c.body(k) for k, c in enumerate(calls)]},
                                                     "finish_reason": None}))
                    reason = "tool_calls"
            chunks.append(self.chunk(index, {"delta": {}, "finish_reason": reason}))
        return chunks

    def _stream(self, index: int) -> ToolStream:
        return self.tool_streams.setdefault(index, ToolStream(self.tools))

    def logprobs(self, index: int, entries: list[TokenLogprobs] | None) -> dict | None:
        """The chat layout: one object per token, with its bytes and its top alternatives."""
        if entries is None:
            return None

        def token(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**token(e.token_id, e.logprob), "top_logprobs": [token(t, lp) for t, lp in e.top]}
                            for e in entries], "refusal": None}
