"""OpenAI-compatible HTTP server: `python -m runtime.serve --model smollm2-135m --port 8000`.

    GET  /v1/models             the one served model
    POST /v1/completions        one prompt: a string or a list of token ids
    POST /v1/chat/completions   messages; the engine applies the model's chat template
    GET  /health                200 {"status": "ok"}; 503 once the engine loop has died
    GET  /metrics               Prometheus text (runtime.server_metrics)

The fields each generation endpoint takes, and the bodies it returns, are in
runtime.openai_protocol. Bad input is a 400 with OpenAI's error body, never a 500. All
requests share one engine through runtime.async_engine (continuous batching); a client that
disconnects, streaming or not, has its request aborted, so its KV blocks come back at once.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from typing import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.async_engine import AsyncEngine, EngineDeadError
from runtime.config import SPECULATION_ARGS, EngineConfig, add_speculation_args
from runtime.engine import LLMEngine, Prompt, RequestOutput
from runtime.models.config import UnsupportedModelError
from runtime.models.loader import DEFAULT_MODEL, ModelNotFoundError
from runtime.openai_protocol import (SSE_DONE, ApiError, ChatCompletionRequest, ChatFormat, CompletionFormat,
                                     CompletionRequest, error_body, model_list, sse, validation_error)
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
    return JSONResponse(error.body(), error.status)


# ---- endpoints ----------------------------------------------------------------------------------

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

    async def models(self) -> dict:
        return model_list(self.model_name, self.created, self.max_model_len)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        return await self.generate(body, CompletionFormat(self.model_name, body.include_usage), request)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        return await self.generate(body, ChatFormat(self.model_name, body.include_usage), request)

    # ---- shared steps ---------------------------------------------------------------------
    async def generate(self, body: CompletionRequest | ChatCompletionRequest, fmt: CompletionFormat,
                       request: Request) -> Response:
        body.check(self.model_name)
        prompt = self.tokenize(body.to_prompt(), body.prompt_param)
        params = body.sampling_params(len(prompt), self.max_model_len)
        try:
            outputs = await self.engine.add_request(prompt, params, fmt.request_id)
        except ValueError as e:
            raise ApiError(str(e)) from None
        self.abort_when_done(request, fmt.request_id)
        outputs = self.metrics.observe(outputs)
        if body.stream:
            return StreamingResponse(self.stream(outputs, fmt), media_type="text/event-stream")
        return await self.respond(outputs, fmt)

    def tokenize(self, prompt: Prompt, param: str) -> list[int]:
        try:
            return self.engine.prompt_token_ids(prompt)
        except ValueError as e:
            raise ApiError(str(e), param) from None

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
        yield SSE_DONE

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
    p.add_argument("--kv-cache-memory", help="bytes (2GiB, 500MB) or a fraction of free memory (0.1); "
                   "default: 0.8 of free GPU memory, 0.1 of free host memory")
    p.add_argument("--seed", type=int, help="seeds the sampler of requests that bring no seed of their own")
    p.add_argument("--served-model-name", help="the model name clients send (default: --model)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"])
    add_speculation_args(p)
    return p.parse_args(argv)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the flags that were given; the rest keep EngineConfig's defaults."""
    names = ("model", "dtype", "device", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
             "block_size", "enable_prefix_caching", "kv_cache_memory", "seed") + SPECULATION_ARGS
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
