"""OpenAI-compatible HTTP server: `python -m runtime.serve --model smollm2-135m --port 8000`.

    GET  /v1/models             the one served model
    POST /v1/completions        one prompt: a string or a list of token ids
    POST /v1/chat/completions   messages; the engine applies the model's chat template
    GET  /health                200 {"status": "ok"}; 503 once the engine loop has died
    GET  /metrics               Prometheus text: requests by finish reason, TTFT/TPOT/e2e
                                histograms, running/waiting sequences, KV blocks, tokens

Both generation endpoints take stream (SSE `data: {...}` chunks, then `data: [DONE]`),
stream_options.include_usage (a last chunk with usage and no choices), max_tokens (chat
also max_completion_tokens), temperature, top_p, seed, stop, and the extensions top_k,
ignore_eos, stop_token_ids and include_stop_str_in_output. Unknown fields are ignored,
as OpenAI does; n must be 1 (n > 1 comes later).

max_tokens when absent: 16 for completions (OpenAI's default on that endpoint); for
chat, all the context the prompt leaves (max_model_len - prompt tokens), as OpenAI and
vLLM do. A prompt plus max_tokens beyond max_model_len is refused, not truncated.

Bad input is a 400 with OpenAI's error body {"error": {"message", "type":
"invalid_request_error", "param", "code"}}, never a 500. All requests share one engine
through runtime.async_engine (continuous batching); a client that disconnects, streaming
or not, has its request aborted, so its KV blocks come back at once.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.async_engine import AsyncEngine, EngineDeadError
from runtime.config import EngineConfig
from runtime.engine import LLMEngine, Prompt, RequestOutput
from runtime.models.config import UnsupportedModelError
from runtime.models.loader import DEFAULT_MODEL, ModelNotFoundError
from runtime.sampling_params import SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16


# ---- request bodies ---------------------------------------------------------------------------

class StreamOptions(BaseModel):
    include_usage: bool = False


class GenerationRequest(BaseModel):
    """Fields both endpoints share; anything else in the body is ignored."""

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


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]


class ContentPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


# ---- errors -------------------------------------------------------------------------------------

class ApiError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), self.status)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _loc(error: dict) -> str:
    """'messages.0.content' from ('body', 'messages', 0, 'content')."""
    return ".".join(str(part) for part in error.get("loc", ())[1:]) or "body"


def validation_error(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    if not errors:
        return ApiError("the request body is invalid")
    if errors[0].get("type") == "json_invalid":
        return ApiError(f"the request body is not valid JSON ({errors[0].get('ctx', {}).get('error', 'parse error')})")
    message = "; ".join(f"{_loc(e)}: {e.get('msg')}" for e in errors[:3])
    return ApiError(message, _loc(errors[0]).split(".")[0])


def install_error_handlers(app: FastAPI) -> None:
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        return e.response()

    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        return validation_error(e).response()

    async def bad_json(_: Request, e: json.JSONDecodeError) -> JSONResponse:
        return ApiError(f"the request body is not valid JSON ({e})").response()

    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:  # 404, 405
        kind = "invalid_request_error" if e.status_code < 500 else "internal_error"
        return ApiError(str(e.detail), status=e.status_code, type=kind).response()

    async def dead(_: Request, e: EngineDeadError) -> JSONResponse:
        return ApiError(str(e), status=503, type="service_unavailable").response()

    async def internal(_: Request, e: Exception) -> JSONResponse:
        return ApiError(f"internal error: {type(e).__name__}: {e}", status=500, type="internal_error").response()

    handlers = ((ApiError, api_error), (RequestValidationError, invalid), (json.JSONDecodeError, bad_json),
                (StarletteHTTPException, http_error), (EngineDeadError, dead), (Exception, internal))
    for exc_type, handler in handlers:
        app.add_exception_handler(exc_type, handler)


# ---- metrics ------------------------------------------------------------------------------------

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    """Prometheus metrics of one app, in a registry of its own (apps may share a process).

    The gauges read the engine's queues and block pool at scrape time from the event loop
    thread; they are len() reads, atomic under the GIL, so a scrape never blocks a step.
    """

    def __init__(self, engine: LLMEngine):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("heterospec_requests", "Finished requests by finish reason "
                                "(stop, length, abort, error)", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("heterospec_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("heterospec_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("heterospec_time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("heterospec_time_per_output_token_seconds", "Mean time per output token "
                              "after the first", buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("heterospec_e2e_request_latency_seconds", "Request latency from arrival "
                             "to the last token", buckets=LATENCY_BUCKETS, registry=r)
        self._gauge("heterospec_num_requests_running", "Sequences in the running batch",
                    lambda: len(engine.scheduler.running))
        self._gauge("heterospec_num_requests_waiting", "Sequences waiting to be scheduled",
                    lambda: len(engine.scheduler.waiting))
        self._gauge("heterospec_kv_cache_used_blocks", "KV cache blocks in use",
                    lambda: engine.block_manager.num_used_blocks)
        self._gauge("heterospec_kv_cache_free_blocks", "KV cache blocks free",
                    lambda: engine.block_manager.num_free_blocks)

    def _gauge(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        Gauge(name, documentation, registry=self.registry).set_function(read)

    def render(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def observe(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """Pass a request's outputs through, counting tokens and timing it when it ends."""
        reason = "abort"
        try:
            async with aclosing(outputs):
                async for out in outputs:
                    self.generation_tokens.inc(len(out.new_token_ids))
                    if out.finished:
                        reason = out.finish_reason or "stop"
                        self._observe_finished(out)
                    yield out
        except EngineDeadError:
            reason = "error"
            raise
        finally:
            self.requests.labels(finish_reason=reason).inc()

    def _observe_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        for histogram, seconds in ((self.ttft, m.ttft_s), (self.tpot, m.tpot_s), (self.e2e, m.e2e_s)):
            if seconds is not None:
                histogram.observe(seconds)


# ---- response bodies ------------------------------------------------------------------------

def usage(out: RequestOutput) -> dict:
    num_prompt, num_output = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output, "total_tokens": num_prompt + num_output}


class CompletionFormat:
    """Bodies of /v1/completions: one response, or stream chunks of the same object type."""

    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, request_id: str, model: str, include_usage: bool):
        self.request_id, self.model, self.include_usage = request_id, model, include_usage
        self.created = int(time.time())

    def envelope(self, object_type: str, choices: list[dict], **extra: Any) -> dict:
        return {"id": self.request_id, "object": object_type, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def chunk(self, choice: dict) -> dict:
        extra = {"usage": None} if self.include_usage else {}
        return self.envelope(self.chunk_object, [{"index": 0, **choice, "logprobs": None}], **extra)

    def usage_chunk(self, out: RequestOutput) -> dict:
        return self.envelope(self.chunk_object, [], usage=usage(out))

    def response(self, out: RequestOutput) -> dict:
        choice = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}
        return self.envelope(self.object, [choice], usage=usage(out))

    def chunks(self, out: RequestOutput) -> list[dict]:
        if not out.delta_text and not out.finished:
            return []
        return [self.chunk({"text": out.delta_text, "finish_reason": out.finish_reason})]


class ChatFormat(CompletionFormat):
    """Bodies of /v1/chat/completions: the role comes in the first chunk, then content deltas,
    then a chunk with an empty delta and the finish reason."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, request_id: str, model: str, include_usage: bool):
        super().__init__(request_id, model, include_usage)
        self.sent_role = False

    def response(self, out: RequestOutput) -> dict:
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text}, "logprobs": None,
                  "finish_reason": out.finish_reason}
        return self.envelope(self.object, [choice], usage=usage(out))

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


def sse(data: dict) -> str:
    return "data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n\n"


# ---- request -> engine ---------------------------------------------------------------------

def single_prompt(prompt: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return prompt
    if len(prompt) != 1:
        raise ApiError(f"one prompt per request is supported, got {len(prompt)}; send them as separate "
                       "requests (they are batched together anyway)", "prompt")
    return prompt[0]


def message_text(content: str | list[ContentPart] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if any(part.type != "text" or part.text is None for part in content):
        raise ApiError("only text content parts are supported", "messages")
    return "".join(part.text for part in content)


def sampling_params(body: GenerationRequest, max_tokens: int) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0, seed=body.seed,
            stop=body.stop or [], stop_token_ids=body.stop_token_ids or [], ignore_eos=body.ignore_eos,
            include_stop_str_in_output=body.include_stop_str_in_output)
    except ValueError as e:  # SamplingParams' messages start with the field's name
        raise ApiError(str(e), str(e).split()[0]) from None


class OpenAIServer:
    """The endpoints, around one AsyncEngine."""

    def __init__(self, engine: AsyncEngine, served_model_name: str):
        self.engine = engine
        self.model_name = served_model_name
        self.max_model_len = engine.engine.max_model_len
        self.metrics = ServerMetrics(engine.engine)
        self.created = int(time.time())
        self._watchers: set[asyncio.Task] = set()

    async def health(self) -> JSONResponse:
        if self.engine.is_dead:
            return JSONResponse({"status": "dead", "error": str(self.engine.error)}, 503)
        return JSONResponse({"status": "ok"})

    async def scrape(self) -> Response:
        return self.metrics.render()

    async def models(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "heterospec",
                "max_model_len": self.max_model_len}
        return {"object": "list", "data": [card]}

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self.check(body)
        prompt = self.tokenize(single_prompt(body.prompt), "prompt")
        max_tokens = self.max_tokens(body.max_tokens, len(prompt), "prompt", DEFAULT_COMPLETION_MAX_TOKENS)
        params = sampling_params(body, max_tokens)
        fmt = CompletionFormat(f"cmpl-{uuid.uuid4().hex}", self.model_name, body.include_usage)
        return await self.generate(request, body, prompt, params, fmt)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check(body)
        messages = [{"role": m.role, "content": message_text(m.content)} for m in body.messages]
        prompt = self.tokenize(messages, "messages")
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = sampling_params(body, self.max_tokens(requested, len(prompt), "messages", default=None))
        fmt = ChatFormat(f"chatcmpl-{uuid.uuid4().hex}", self.model_name, body.include_usage)
        return await self.generate(request, body, prompt, params, fmt)

    # ---- shared steps ---------------------------------------------------------------------
    def check(self, body: GenerationRequest) -> None:
        if body.model and body.model != self.model_name:
            raise ApiError(f"the model {body.model!r} does not exist; this server serves {self.model_name!r}",
                           "model", status=404, code="model_not_found")
        if body.n not in (None, 1):
            raise ApiError(f"n must be 1 for now (n > 1 is not supported yet), got {body.n}", "n")

    def tokenize(self, prompt: Prompt, param: str) -> list[int]:
        try:
            token_ids = self.engine.tokenize(prompt)
        except ValueError as e:
            raise ApiError(str(e), param) from None
        if not token_ids:
            raise ApiError("the prompt is empty after tokenization", param)
        if len(token_ids) >= self.max_model_len:
            raise ApiError(f"this model's maximum context length is {self.max_model_len} tokens, and the {param} "
                           f"has {len(token_ids)} tokens, which leaves no room to generate", param)
        return token_ids

    def max_tokens(self, requested: int | None, num_prompt_tokens: int, param: str, default: int | None) -> int:
        """`requested`, if the context has room for it; else `default` (None: all the room left)."""
        room = self.max_model_len - num_prompt_tokens
        if requested is None:
            return room if default is None else min(default, room)
        if requested > room:
            raise ApiError(f"this model's maximum context length is {self.max_model_len} tokens, but "
                           f"{num_prompt_tokens + requested} were requested ({num_prompt_tokens} in the {param}, "
                           f"{requested} for the completion); reduce the {param} or max_tokens", "max_tokens")
        return requested

    async def generate(self, request: Request, body: GenerationRequest, prompt: list[int],
                       params: SamplingParams, fmt: CompletionFormat) -> Response:
        try:
            outputs = await self.engine.add_request(prompt, params, fmt.request_id)
        except ValueError as e:
            raise ApiError(str(e)) from None
        self.abort_when_done(request, fmt.request_id)
        outputs = self.metrics.observe(outputs)
        if body.stream:
            return StreamingResponse(self.stream(outputs, fmt), media_type="text/event-stream")
        return await self.respond(outputs, fmt)

    async def respond(self, outputs: AsyncIterator[RequestOutput], fmt: CompletionFormat) -> Response:
        last = None
        async for last in outputs:
            pass
        if last is None or not last.finished:
            return Response(status_code=499)  # aborted: the client went away and reads nothing
        return JSONResponse(fmt.response(last))

    async def stream(self, outputs: AsyncIterator[RequestOutput], fmt: CompletionFormat) -> AsyncIterator[str]:
        last = None
        try:
            async for last in outputs:
                for chunk in fmt.chunks(last):
                    yield sse(chunk)
            if fmt.include_usage and last is not None and last.finished:
                yield sse(fmt.usage_chunk(last))
        except EngineDeadError as e:
            yield sse(error_body(str(e), "service_unavailable"))
        yield "data: [DONE]\n\n"

    def abort_when_done(self, request: Request, request_id: str) -> None:
        """Abort the request when its HTTP exchange ends: a no-op once the request has
        finished, and what frees the KV blocks of a client that disconnected."""
        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self.engine.abort(request_id)

        task = asyncio.get_running_loop().create_task(watch())
        self._watchers.add(task)  # the loop keeps only a weak reference to tasks
        task.add_done_callback(self._watchers.discard)


def build_app(async_engine: AsyncEngine, served_model_name: str) -> FastAPI:
    app = FastAPI(title="heterospec", summary="OpenAI-compatible API")
    app.state.server = server = OpenAIServer(async_engine, served_model_name)
    install_error_handlers(app)
    app.get("/health")(server.health)
    app.get("/metrics")(server.scrape)
    app.get("/v1/models")(server.models)
    app.post("/v1/completions")(server.completions)
    app.post("/v1/chat/completions")(server.chat_completions)
    return app


# ---- command line ---------------------------------------------------------------------------

def _default(name: str) -> str:
    return f"default: {EngineConfig.__dataclass_fields__[name].default}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags named as vLLM names them; an engine flag left out keeps EngineConfig's default."""
    p = argparse.ArgumentParser(prog="python -m runtime.serve", description="OpenAI-compatible server.")
    p.add_argument("--model", default=DEFAULT_MODEL, help="alias, .gguf file or HF model directory "
                   f"(default: {DEFAULT_MODEL})")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], help=_default("dtype"))
    p.add_argument("--device", help="auto, cpu or cuda (default: auto)")
    p.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="default: 8000")
    p.add_argument("--max-num-seqs", type=int, help=_default("max_num_seqs"))
    p.add_argument("--max-num-batched-tokens", type=int, help=_default("max_num_batched_tokens"))
    p.add_argument("--max-model-len", type=int, help="default: the model's context, capped by the KV cache")
    p.add_argument("--block-size", type=int, help=_default("block_size"))
    p.add_argument("--kv-cache-memory", help="bytes (2GiB, 500MB) or a fraction of free memory (0.1); "
                   "default: 0.8 of free GPU memory, 0.1 of free host memory")
    p.add_argument("--seed", type=int, help="seeds the sampler of requests that bring no seed of their own")
    p.add_argument("--served-model-name", help="the model name clients send (default: --model)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"])
    return p.parse_args(argv)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the flags that were given; the rest keep EngineConfig's defaults."""
    names = ("model", "dtype", "device", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
             "block_size", "kv_cache_memory", "seed")
    return EngineConfig(**{name: getattr(args, name) for name in names if getattr(args, name) is not None})


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = LLMEngine(engine_config(args))
    except (ModelNotFoundError, UnsupportedModelError, ValueError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)
    async_engine = AsyncEngine(engine)
    app = build_app(async_engine, args.served_model_name or args.model)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        async_engine.shutdown()


if __name__ == "__main__":
    main()
