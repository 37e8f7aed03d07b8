"""One LLMEngine shared by every HTTP request, driven from a dedicated "engine loop" thread.

    event loop (asyncio)                               engine loop (thread)
    add_request / abort --> command list --notify-->   engine.add_request / engine.abort
                                                       engine.step() while there is work
    RequestStream <-- asyncio.Queue <--call_soon_threadsafe-- RequestOutput per request

The loop thread is also the thread that builds the engine, when AsyncEngine is given a
function that builds one (the server does so): torch's CPU threads form one OpenMP team per
calling thread, and a team left behind by the thread that loaded the models slows every
step of the one that runs them (draft_cpu.placement says how).

Continuous batching across clients falls out of this: whatever requests are queued when
a step ends join the next one. The engine is not thread-safe, so only the loop thread
mutates it; commands wait in a list until the step in progress ends. An add's ValueError
comes back through a concurrent Future, so the caller sees it before any output. Idle,
the thread sleeps on a Condition (no busy spin). If a step raises, every request in
flight gets EngineDeadError and the loop stops for good (`is_dead`; /health says 503).

`prompt_token_ids` runs on the caller's thread: it only reads the tokenizer and
the model config, and a fast tokenizer's encode and decode may run concurrently (both
take shared borrows of the Rust tokenizer; only changing its truncation/padding would not).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from runtime.engine import LLMEngine, Prompt
from runtime.outputs import RequestOutput
from runtime.sampling_params import SamplingParams

log = logging.getLogger("runtime.async_engine")

_ABORTED = object()  # queued to a request's stream when it is aborted: the stream just ends


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (it raised, or was shut down); no request can run."""


@dataclass(slots=True)
class _Stream:
    """Where the loop thread puts one request's outputs: a queue owned by an event loop."""

    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop

    def put(self, item: RequestOutput | BaseException | object) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    stream: _Stream
    added: concurrent.futures.Future


@dataclass(slots=True)
class _Abort:
    request_id: str


class AsyncEngine:
    """Drives `engine`, or the engine that `engine()` builds on the loop thread (its error,
    if it raises, is raised here). `on_death(error)`, when given, is called from the loop
    thread if the loop dies."""

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], on_death=None):
        self.on_death = on_death
        self._cond = threading.Condition()
        self._commands: list[_Add | _Abort] = []  # guarded by _cond
        self._error: EngineDeadError | None = None  # guarded by _cond
        self._stopping = False
        self._streams: dict[str, _Stream] = {}  # touched by the loop thread only
        built = concurrent.futures.Future()
        if isinstance(engine, LLMEngine) or not callable(engine):
            built.set_result(engine)
        self._thread = threading.Thread(target=self._run, args=(engine, built), name="engine-loop", daemon=True)
        self._thread.start()
        self.engine: LLMEngine = built.result()

    # ---- any thread / the event loop ------------------------------------------------------
    @property
    def is_dead(self) -> bool:
        return self._error is not None

    @property
    def error(self) -> EngineDeadError | None:
        return self._error

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: queued in the engine, or on their way to it."""
        with self._cond:
            pending = sum(isinstance(c, _Add) for c in self._commands)
        return pending + len(self.engine.scheduler.waiting)

    def prompt_token_ids(self, prompt: Prompt) -> list[int]:
        """The engine's validated tokenization (ValueError if the prompt cannot run)."""
        return self.engine.prompt_token_ids(prompt)

    async def add_request(self, prompt: Prompt, params: SamplingParams,
                          request_id: str) -> AsyncIterator[RequestOutput]:
        """Queue a request; raise its ValueError (or EngineDeadError) here, else stream its outputs."""
        if params.guided is not None:  # compiled on a worker thread, not on the engine's loop (cached for it)
            await asyncio.to_thread(self.engine.grammars.compile, params.guided)
        stream = _Stream(asyncio.Queue(), asyncio.get_running_loop())
        added = concurrent.futures.Future()
        self._submit(_Add(request_id, prompt, params, stream, added))
        try:
            await asyncio.wrap_future(added)
        except asyncio.CancelledError:
            self.abort(request_id)  # in case the add ran before the cancellation reached it
            raise
        return self._iterate(request_id, stream)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks (a no-op if it has finished or is unknown)."""
        try:
            self._submit(_Abort(request_id))
        except EngineDeadError:
            pass

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.engine.close()

    def _submit(self, command: _Add | _Abort) -> None:
        with self._cond:
            if self._error is not None:
                raise EngineDeadError(str(self._error))
            self._commands.append(command)
            self._cond.notify()

    async def _iterate(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if item is _ABORTED:
                    return
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # the consumer stopped early, was cancelled, or the engine died
                self.abort(request_id)

    # ---- the loop thread --------------------------------------------------------------------
    def _run(self, engine, built: concurrent.futures.Future) -> None:
        if not built.done():  # `engine` builds the engine
            try:
                engine = engine()
            except BaseException as e:  # noqa: BLE001 - raised again on the constructing thread
                built.set_exception(e)
                return
            built.set_result(engine)
        self.engine = engine
        try:
            while (commands := self._next_commands()) is not None:
                for command in commands:
                    self._apply(command)
                if self.engine.has_unfinished:
                    self._deliver(self.engine.step())
        except BaseException as e:  # noqa: BLE001 - whatever it was, requests must hear of it
            log.exception("the engine loop died")
            self._die(EngineDeadError(f"the engine loop died: {type(e).__name__}: {e}"), e)
        else:
            self._die(EngineDeadError("the engine was shut down"), None)

    def _next_commands(self) -> list[_Add | _Abort] | None:
        """Wait until there are commands or unfinished requests; None once shut down."""
        with self._cond:
            while not (self._commands or self.engine.has_unfinished or self._stopping):
                self._cond.wait(timeout=1.0)
                self.engine.check_health()  # idle, a tensor-parallel rank may still fail
            if self._stopping:
                return None
            commands, self._commands = self._commands, []
            return commands

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            self.engine.abort(command.request_id)
            stream = self._streams.pop(command.request_id, None)
            if stream is not None:
                stream.put(_ABORTED)
            return
        if not command.added.set_running_or_notify_cancel():
            return  # the caller gave up before we got here: do not run it at all
        try:
            self.engine.add_request(command.prompt, command.params, command.request_id)
        except Exception as e:  # noqa: BLE001 - a bad request fails alone, not the engine
            command.added.set_exception(e)
            return
        self._streams[command.request_id] = command.stream
        command.added.set_result(None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            stream.put(out)

    def _die(self, error: EngineDeadError, cause: BaseException | None) -> None:
        error.__cause__ = cause
        with self._cond:
            self._error = error
            commands, self._commands = self._commands, []
        for command in commands:
            if isinstance(command, _Add) and command.added.set_running_or_notify_cancel():
                command.added.set_exception(error)
        for stream in self._streams.values():
            stream.put(EngineDeadError(str(error)))
        self._streams.clear()
        if self.on_death is not None and cause is not None:
            self.on_death(error)
