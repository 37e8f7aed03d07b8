"""OpenAI-compatible HTTP server: `python -m runtime.serve --model smollm2-135m --port 8000`.

    GET  /v1/models             the one served model
    POST /v1/completions        one prompt: a string or a list of token ids
    POST /v1/chat/completions   messages; the engine applies the model's chat template
    GET  /health                200 {"status": "ok"}; 503 once the engine loop has died
    GET  /metrics               Prometheus text (runtime.server_metrics)

The fields each generation endpoint takes are in runtime.openai_protocol, the bodies it
returns in runtime.openai_responses. Bad input is a 4xx with OpenAI's error body, never a 500. All
requests share one engine through runtime.async_engine (continuous batching); a client that
disconnects, streaming or not, has its request aborted, so its KV blocks come back at once.

Production behaviour:
  - `--api-key` (or HETEROSPEC_API_KEY): every endpoint but /health wants
    `Authorization: Bearer KEY`; anything else is a 401.
  - `--max-waiting-requests`: beyond that many requests waiting to run, a new one is a 429
    with Retry-After (the seconds the queue should take to drain at the recent finish rate).
  - A request that fails inside the engine (detokenization, say) is a 500 for it alone; if
    the engine loop itself dies, /health says 503 and the process exits with status 1.
  - SIGTERM: stop accepting, let in-flight requests finish for up to `--shutdown-timeout`
    seconds, abort the rest, exit 0.
  - One JSON log line per finished request (logger runtime.requests): id, status, tokens,
    cached tokens, TTFT, TPOT, e2e, speculation figures.
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import math
import os
import signal
import sys
import time
from collections import deque
from contextlib import aclosing
from typing import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.async_engine import AsyncEngine, EngineDeadError
from runtime.config import ENGINE_ARGS, EngineConfig, add_engine_args
from target_gpu.tensor_parallel import TPWorkerError
from runtime.engine import LLMEngine, Prompt
from runtime.outputs import RequestOutput
from runtime.models.config import UnsupportedModelError
from runtime.models.loader import DEFAULT_MODEL, ModelNotFoundError
from runtime.openai_protocol import (ApiError, ChatCompletionRequest, CompletionRequest, error_body,
                                     validation_error)
from runtime.openai_responses import SSE_DONE, ChatFormat, CompletionFormat, model_list, sse
from runtime.sampling_params import SamplingParams
from runtime.structured_output import GrammarError
from runtime.server_metrics import ServerMetrics


# ---- errors -------------------------------------------------------------------------------------

def api_error(e: Exception) -> ApiError:
    """The OpenAI error for whatever a request raised."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, RequestValidationError):
        return validation_error(e.errors())
    if isinstance(e, StarletteHTTPException):  # 404, 405
        kind = "invalid_request_error" if e.status_code < 500 else "internal_error"
        return ApiError(str(e.detail), status=e.status_code, type=kind)
    if isinstance(e, EngineDeadError):
        return ApiError(str(e), status=503, type="service_unavailable")
    return ApiError(f"internal error: {type(e).__name__}: {e}", status=500, type="internal_error")


async def error_response(_: Request, e: Exception) -> JSONResponse:
    error = api_error(e)
    return JSONResponse(error.body(), error.status, headers=error.headers)


def unauthorized() -> JSONResponse:
    return JSONResponse(error_body("invalid or missing API key: send 'Authorization: Bearer <key>'",
                                   "invalid_request_error", code="invalid_api_key"), 401)


# ---- endpoints ----------------------------------------------------------------------------------

class OpenAIServer:
    """The endpoints, around one AsyncEngine."""

    def __init__(self, engine: AsyncEngine, served_model_name: str, max_waiting_requests: int = 256):
        self.engine = engine
        self.model_name = served_model_name
        self.max_model_len = engine.engine.max_model_len
        self.max_waiting_requests = max_waiting_requests
        self.metrics = ServerMetrics(engine.engine)
        self.created = int(time.time())
        self.finish_times: deque[float] = deque(maxlen=64)  # recent finishes, for Retry-After
        self._watchers: set[asyncio.Task] = set()
        self.token_text = lambda token_id: engine.engine.tokenizer.decode([token_id], skip_special_tokens=True)

    async def health(self) -> JSONResponse:
        if self.engine.is_dead:
            return JSONResponse({"status": "dead", "error": str(self.engine.error)}, 503)
        return JSONResponse({"status": "ok"})

    async def models(self) -> dict:
        return model_list(self.model_name, self.created, self.max_model_len)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        return await self.generate(body, CompletionFormat(self.model_name, body.include_usage, self.token_text),
                                   request)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        return await self.generate(body, ChatFormat(self.model_name, body.include_usage, self.token_text,
                                                    body.tool_use()), request)

    # ---- shared steps ---------------------------------------------------------------------
    async def generate(self, body: CompletionRequest | ChatCompletionRequest, fmt: CompletionFormat,
                       request: Request) -> Response:
        body.check(self.model_name)
        prompt = self.tokenize(body.to_prompt(), body.prompt_param)
        params = body.sampling_params(len(prompt), self.max_model_len)
        self.check_queue(len(params))
        choices = await self.add_choices(prompt, params, fmt.request_id, request, body.constraint_param)
        if body.stream:
            return StreamingResponse(self.stream(choices, fmt), media_type="text/event-stream")
        return await self.respond(choices, fmt)

    def tokenize(self, prompt: Prompt, param: str) -> list[int]:
        try:
            return self.engine.prompt_token_ids(prompt)
        except ValueError as e:
            raise ApiError(str(e), param) from None

    def check_queue(self, num_new: int) -> None:
        """429 when the waiting queue is full; Retry-After estimates when it will have room."""
        waiting = self.engine.num_waiting
        if waiting + num_new <= self.max_waiting_requests:
            return
        times = self.finish_times
        rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 1.0
        retry_after = min(60, max(1, math.ceil((waiting + num_new - self.max_waiting_requests) / rate)))
        raise ApiError(f"the server is busy: {waiting} requests are waiting (the limit is "
                       f"{self.max_waiting_requests}); retry in {retry_after} s", status=429, type="rate_limit_error",
                       code="rate_limit_exceeded", headers={"Retry-After": str(retry_after)})

    async def add_choices(self, prompt: list[int], params: list[SamplingParams], request_id: str,
                          request: Request, constraint_param: str | None) -> list[AsyncIterator[RequestOutput]]:
        """Queue one engine request per choice (ids request_id-0, -1, ...); all or none. A
        grammar that does not compile is blamed on constraint_param, the field that held it."""
        choices: list[AsyncIterator[RequestOutput]] = []
        try:
            for i, choice_params in enumerate(params):
                choice_id = f"{request_id}-{i}"
                outputs = await self.engine.add_request(prompt, choice_params, choice_id)
                self.abort_when_done(request, choice_id)
                choices.append(self.metrics.observe(self.log_finished(outputs, choice_id, request)))
        except BaseException as e:
            for i in range(len(choices)):
                self.engine.abort(f"{request_id}-{i}")
            if isinstance(e, ValueError):
                raise ApiError(str(e), constraint_param if isinstance(e, GrammarError) else None) from None
            raise
        return choices

    async def respond(self, choices: list[AsyncIterator[RequestOutput]], fmt: CompletionFormat) -> Response:
        last: list[RequestOutput | None] = [None] * len(choices)
        async for index, out in merge(choices):
            last[index] = out
        if any(out is None or not out.finished for out in last):
            return Response(status_code=499)  # aborted: the client went away and reads nothing
        failed = next((out for out in last if out.finish_reason == "error"), None)
        if failed is not None:
            raise ApiError(f"the request failed: {failed.error}", status=500, type="internal_error")
        return JSONResponse(fmt.response(last))

    async def stream(self, choices: list[AsyncIterator[RequestOutput]], fmt: CompletionFormat) -> AsyncIterator[str]:
        last: list[RequestOutput | None] = [None] * len(choices)
        try:
            async with aclosing(merge(choices)) as merged:  # a failed choice stops the others at once
                async for index, out in merged:
                    last[index] = out
                    if out.finish_reason == "error":
                        yield sse(error_body(f"the request failed: {out.error}", "internal_error"))
                        break
                    for chunk in fmt.chunks(index, out):
                        yield sse(chunk)
                else:
                    if fmt.include_usage and all(out is not None and out.finished for out in last):
                        yield sse(fmt.usage_chunk(last))
        except EngineDeadError as e:
            yield sse(error_body(str(e), "service_unavailable"))
        yield SSE_DONE

    async def log_finished(self, outputs: AsyncIterator[RequestOutput], request_id: str,
                           request: Request) -> AsyncIterator[RequestOutput]:
        """Pass outputs through; when the request ends, log one JSON line about it."""
        last, status = None, "abort"
        try:
            async for last in outputs:
                if last.finished:
                    status = last.finish_reason
                    self.finish_times.append(time.monotonic())
                yield last
        except EngineDeadError:
            status = "error"
            raise
        finally:
            log_request(request_id, status, last)

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


async def merge(choices: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from all choices as they come. Closing it (or an error in a
    choice) closes every choice, which aborts those still running."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, outputs: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in outputs:
                await queue.put((index, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((index, e))
        finally:
            await queue.put((index, done))

    tasks = [asyncio.get_running_loop().create_task(pump(i, c)) for i, c in enumerate(choices)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is done:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


request_log = logging.getLogger("runtime.requests")


def log_request(request_id: str, status: str, last: RequestOutput | None) -> None:
    """One structured line per finished (or aborted, or failed) request."""
    record: dict = {"event": "request_finished", "id": request_id, "status": status}
    if last is not None:
        m = last.metrics
        record.update(prompt_tokens=len(last.prompt_token_ids), completion_tokens=len(last.token_ids),
                      cached_tokens=m.num_cached_tokens, ttft_s=_round(m.ttft_s), tpot_s=_round(m.tpot_s),
                      e2e_s=_round(m.e2e_s), draft_tokens=m.num_draft_tokens, accepted_tokens=m.num_accepted_tokens,
                      acceptance_length=_round(m.mean_acceptance_length))
        if last.error:
            record["error"] = last.error
    request_log.info(json.dumps(record))


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


class Guard:
    """ASGI middleware: the API key check (every path but /health) and the count of HTTP
    responses by status. Pure ASGI, so that streaming and disconnects pass through as they are."""

    def __init__(self, app, api_key: str | None, count_status):
        self.app, self.count_status = app, count_status
        self.expected = None if not api_key else f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.expected is not None and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                self.count_status(401)
                return await unauthorized()(scope, receive, send)

        async def send_counting(message) -> None:
            if message["type"] == "http.response.start":
                self.count_status(message["status"])
            await send(message)

        await self.app(scope, receive, send_counting)


def build_app(async_engine: AsyncEngine, served_model_name: str, api_key: str | None = None,
              max_waiting_requests: int = 256) -> FastAPI:
    app = FastAPI(title="heterospec", summary="OpenAI-compatible API")
    app.state.server = server = OpenAIServer(async_engine, served_model_name, max_waiting_requests)
    app.add_middleware(Guard, api_key=api_key, count_status=server.metrics.count_http_status)
    for exc_type in (ApiError, RequestValidationError, StarletteHTTPException, EngineDeadError, Exception):
        app.add_exception_handler(exc_type, error_response)
    app.get("/health")(server.health)
    app.get("/metrics")(server.metrics.scrape)
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
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_const", const=False,
                   help="compute every prompt in full instead of reusing the KV of prefixes cached by earlier "
                        "requests")
    p.add_argument("--kv-cache-memory", help="bytes (2GiB, 500MB) or a fraction of free memory (0.1), for each "
                   "tensor-parallel rank; default: 0.8 of free GPU memory, 0.1 of free host memory (shared by the "
                   "ranks on the host)")
    p.add_argument("--seed", type=int, help="seeds the sampler of requests that bring no seed of their own")
    p.add_argument("--served-model-name", help="the model name clients send (default: --model)")
    p.add_argument("--api-key", default=os.environ.get("HETEROSPEC_API_KEY"),
                   help="demand 'Authorization: Bearer KEY' on every endpoint but /health (default: "
                        "$HETEROSPEC_API_KEY; unset: no key)")
    p.add_argument("--max-waiting-requests", type=int, default=256,
                   help="requests allowed to wait for a place in the batch; beyond, 429 (default: %(default)s)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests get to finish before they are aborted "
                        "(default: %(default)s)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"])
    add_engine_args(p)
    return p.parse_args(argv)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the flags that were given; the rest keep EngineConfig's defaults, but for
    load_speculators_on_request."""
    names = ("model", "dtype", "device", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
             "block_size", "enable_prefix_caching", "kv_cache_memory", "seed") + ENGINE_ARGS
    given = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    # a speculator that loads weights is built at start only: built for a request, it would hold up the others
    return EngineConfig(**given, load_speculators_on_request=False)


def main(argv: list[str] | None = None) -> None:
    """Serve until SIGTERM / SIGINT (exit 0 after draining) or until the engine loop dies
    (exit 1)."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.max_waiting_requests < 1 or args.shutdown_timeout < 0:
        print("error: --max-waiting-requests must be >= 1 and --shutdown-timeout >= 0", file=sys.stderr)
        sys.exit(2)
    deaths: list[Exception] = []

    def on_death(error: Exception) -> None:  # from the engine loop thread; uvicorn polls should_exit
        deaths.append(error)
        server.should_exit = True

    try:  # the engine loop's thread builds the engine (runtime.async_engine says why)
        async_engine = AsyncEngine(lambda: LLMEngine(engine_config(args)), on_death=on_death)
    except (ModelNotFoundError, UnsupportedModelError, ValueError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)
    except TPWorkerError as e:  # a rank failed while starting
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    app = build_app(async_engine, args.served_model_name or args.model, args.api_key, args.max_waiting_requests)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=args.shutdown_timeout))
    # uvicorn drains on SIGTERM, then raises the signal again for the handler it found: make
    # that one a no-op, so that a drained server exits 0 rather than dying of the signal
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run()
    finally:
        async_engine.shutdown()
    if deaths:
        print(f"error: {deaths[0]}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
