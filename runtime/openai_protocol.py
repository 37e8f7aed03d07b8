"""The OpenAI wire format: request bodies and their conversion to SamplingParams, the error
body, and the response and stream-chunk bodies of /v1/completions and /v1/chat/completions.

Both endpoints take stream (SSE `data: {...}` chunks, then `data: [DONE]`),
stream_options.include_usage (a last chunk with usage and no choices), max_tokens (chat
also max_completion_tokens), temperature, top_p, seed, stop, and the extensions top_k,
ignore_eos, stop_token_ids and include_stop_str_in_output. Unknown fields are ignored,
as OpenAI does; n must be 1 (n > 1 comes later).

max_tokens when absent: 16 for completions (OpenAI's default on that endpoint); for
chat, all the context the prompt leaves (max_model_len - prompt tokens), as OpenAI and
vLLM do. A prompt plus max_tokens beyond max_model_len is refused, not truncated.

Bad input raises ApiError, whose body is OpenAI's {"error": {"message", "type":
"invalid_request_error", "param", "code"}}. Nothing here knows about HTTP or the engine loop.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, ClassVar

from pydantic import BaseModel

from runtime.engine import RequestOutput
from runtime.sampling_params import SamplingParams


# ---- errors -------------------------------------------------------------------------------------

class ApiError(Exception):
    """A request the server refuses, with the HTTP status and OpenAI error fields to send."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def validation_error(errors: list[dict]) -> ApiError:
    """The ApiError for pydantic's (non-empty) list of errors in a request body."""
    if errors[0].get("type") == "json_invalid":
        return ApiError(f"the request body is not valid JSON ({errors[0].get('ctx', {}).get('error', 'parse error')})")
    message = "; ".join(f"{_loc(e)}: {e.get('msg')}" for e in errors[:3])
    return ApiError(message, _loc(errors[0]).split(".")[0])


def _loc(error: dict) -> str:
    """'messages.0.content' from ('body', 'messages', 0, 'content')."""
    return ".".join(str(part) for part in error.get("loc", ())[1:]) or "body"


# ---- request bodies -----------------------------------------------------------------------------

class StreamOptions(BaseModel):
    include_usage: bool = False


class GenerationRequest(BaseModel):
    """Fields both endpoints share; anything else in the body is ignored."""

    prompt_param: ClassVar[str]  # the field that holds the prompt, as errors name it
    default_max_tokens: ClassVar[int | None]  # None: all the context the prompt leaves

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def check(self, served_model_name: str) -> None:
        """Refuse a request for another model, or for more than one choice."""
        if self.model and self.model != served_model_name:
            raise ApiError(f"the model {self.model!r} does not exist; this server serves {served_model_name!r}",
                           "model", status=404, code="model_not_found")
        if self.n not in (None, 1):
            raise ApiError(f"n must be 1 for now (n > 1 is not supported yet), got {self.n}", "n")

    def sampling_params(self, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
        max_tokens = self._max_tokens(num_prompt_tokens, max_model_len)
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, seed=self.seed,
                stop=self.stop or [], stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos,
                include_stop_str_in_output=self.include_stop_str_in_output)
        except ValueError as e:  # SamplingParams' messages start with the field's name
            raise ApiError(str(e), str(e).split()[0]) from None

    def _max_tokens(self, num_prompt_tokens: int, max_model_len: int) -> int:
        """The requested max tokens, if the context has room for them; else the default."""
        requested, room, param = self.requested_max_tokens, max_model_len - num_prompt_tokens, self.prompt_param
        if requested is None:
            return room if self.default_max_tokens is None else min(self.default_max_tokens, room)
        if requested > room:
            raise ApiError(f"this model's maximum context length is {max_model_len} tokens, but "
                           f"{num_prompt_tokens + requested} were requested ({num_prompt_tokens} in the {param}, "
                           f"{requested} for the completion); reduce the {param} or max_tokens", "max_tokens")
        return requested


class CompletionRequest(GenerationRequest):
    prompt_param: ClassVar[str] = "prompt"
    default_max_tokens: ClassVar[int | None] = 16

    prompt: str | list[int] | list[str] | list[list[int]]

    def to_prompt(self) -> str | list[int]:
        """The one prompt of the request: a batch of prompts is refused unless it holds one."""
        prompt = self.prompt
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            return prompt
        if len(prompt) != 1:
            raise ApiError(f"one prompt per request is supported, got {len(prompt)}; send them as separate "
                           "requests (they are batched together anyway)", "prompt")
        return prompt[0]


class ContentPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    role: str
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.type != "text" or part.text is None for part in self.content):
            raise ApiError("only text content parts are supported", "messages")
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(GenerationRequest):
    prompt_param: ClassVar[str] = "messages"
    default_max_tokens: ClassVar[int | None] = None

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_prompt(self) -> list[dict]:
        """The messages as the engine's chat template takes them."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]


# ---- response bodies ----------------------------------------------------------------------------

def model_list(model: str, created: int, max_model_len: int) -> dict:
    """The body of /v1/models: the one served model."""
    card = {"id": model, "object": "model", "created": created, "owned_by": "heterospec",
            "max_model_len": max_model_len}
    return {"object": "list", "data": [card]}


SSE_DONE = "data: [DONE]\n\n"  # the last event of every stream


def sse(data: dict) -> str:
    """One server-sent event."""
    return "data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def _usage(out: RequestOutput) -> dict:
    num_prompt, num_output = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output, "total_tokens": num_prompt + num_output,
            "prompt_tokens_details": {"cached_tokens": out.metrics.num_cached_tokens}}


class CompletionFormat:
    """Bodies of /v1/completions: one response, or stream chunks of the same object type."""

    id_prefix = "cmpl"
    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, model: str, include_usage: bool):
        self.request_id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.model, self.include_usage = model, include_usage
        self.created = int(time.time())

    def envelope(self, object_type: str, choices: list[dict], **extra: Any) -> dict:
        return {"id": self.request_id, "object": object_type, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def chunk(self, choice: dict) -> dict:
        extra = {"usage": None} if self.include_usage else {}
        return self.envelope(self.chunk_object, [{"index": 0, **choice, "logprobs": None}], **extra)

    def usage_chunk(self, out: RequestOutput) -> dict:
        return self.envelope(self.chunk_object, [], usage=_usage(out))

    def response(self, out: RequestOutput) -> dict:
        choice = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}
        return self.envelope(self.object, [choice], usage=_usage(out))

    def chunks(self, out: RequestOutput) -> list[dict]:
        if not out.delta_text and not out.finished:
            return []
        return [self.chunk({"text": out.delta_text, "finish_reason": out.finish_reason})]


class ChatFormat(CompletionFormat):
    """Bodies of /v1/chat/completions: the role comes in the first chunk, then content deltas,
    then a chunk with an empty delta and the finish reason."""

    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, model: str, include_usage: bool):
        super().__init__(model, include_usage)
        self.sent_role = False

    def response(self, out: RequestOutput) -> dict:
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text}, "logprobs": None,
                  "finish_reason": out.finish_reason}
        return self.envelope(self.object, [choice], usage=_usage(out))

    def chunks(self, out: RequestOutput) -> list[dict]:
        chunks = []
        if not self.sent_role:
            self.sent_role = True
            chunks.append(self.chunk({"delta": {"role": "assistant", "content": ""}, "finish_reason": None}))
        if out.delta_text:
            chunks.append(self.chunk({"delta": {"content": out.delta_text}, "finish_reason": None}))
        if out.finished:
            chunks.append(self.chunk({"delta": {}, "finish_reason": out.finish_reason}))
        return chunks
