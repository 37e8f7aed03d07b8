"""The draft worker: a draft model on its own thread (and cores), or on the caller's thread
when it shares the cores with a CPU target, with its own paged KV cache that rolls back to
any committed length.

The model is the target's decoder code (runtime.models) loaded from any model spec (an
alias, a GGUF file, an HF directory), and it runs through the same ModelRunner as the
target: "these tokens at these positions", over a paged KV cache of its own. Every call
into the worker goes through `submit`, which runs it on the worker's one thread; torch
releases the GIL inside its ops, so the engine thread runs the target meanwhile. A worker
without a thread of its own (`own_thread=False`) runs each call at once on the calling
thread: draft and target then share one OpenMP thread team (draft_cpu.placement says why
that matters).

Per request the worker keeps a DraftSequence: the tokens whose KV it has computed and
their blocks. `sync(request_id, token_ids)` lines it up with the engine's committed
tokens: the KV of the longest common prefix is kept, positions beyond it are dropped
(blocks past it go back to the pool, the rest is overwritten by position on the next
forward). So rollback after a rejected draft costs nothing.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from draft_cpu.backends import load_quantization, prepare_model, resolve_backend
from draft_cpu.placement import available_cores, format_core_list, move_other_threads, pin_current_thread, place
from runtime.block_manager import BlockManager
from runtime.models.loader import load_model
from target_gpu.kv_cache import bytes_per_block, mirror_pool_blocks
from target_gpu.model_runner import ModelRunner

log = logging.getLogger("draft_cpu.worker")


@dataclass(slots=True)
class DraftSequence:
    """One request's state in the draft cache (the fields ModelRunner reads)."""

    token_ids: list[int]  # the tokens known to the worker: [:num_computed_tokens] have KV
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_committed: int = 0  # tokens known to be committed by the engine (they never change)
    num_freed_blocks: int = 0  # BlockManager's: none here (the draft's cache keeps every block)


@dataclass(slots=True)
class DraftWorkerConfig:
    model: str
    device: str = "cpu"  # cpu | cuda | cuda:N
    dtype: str = "float32"  # float32 | bfloat16 | float16
    backend: str = "auto"  # auto | ipex | torch (CPU)
    quantization: str = "auto"  # auto | none | int8 | int4 (draft_cpu.backends.load_quantization)
    cpu_cores: list[int] | None = None  # pin the worker here; None: no pinning
    num_kv_tokens: int = 65536  # KV cache capacity in tokens
    kv_memory_fraction: float = 1.0  # at most this fraction of the device's free memory for it
    block_size: int = 16
    own_thread: bool = True  # False: calls run on the calling thread (InlineExecutor)
    compile_decode: bool = False  # plain decode steps as one compiled graph (target_gpu.compiled_decode), on the
    # CPU with the torch backend (Dynamo cannot trace IPEX's prepacked linear layers)


class InlineExecutor(Executor):
    """An Executor that runs each call at once, on the calling thread, one call at a time."""

    def __init__(self):
        self._lock = threading.RLock()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future = Future()
        with self._lock:
            future.set_running_or_notify_cancel()
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - the caller reads it from the future
                future.set_exception(e)
        return future


class DraftWorker:
    def __init__(self, config: DraftWorkerConfig):
        self.config = config
        self.device = torch.device(config.device)
        self.backend = resolve_backend(config.backend, self.device)
        self.sequences: dict[str, DraftSequence] = {}
        self.busy_seconds = 0.0  # time spent in forward passes
        self.num_forwards = 0
        self._busy_intervals: deque[tuple[float, float]] = deque(maxlen=256)  # recent forwards (perf_counter)
        self._busy_since: float | None = None  # start of the forward in progress
        self.target_cores: list[int] | None = None  # the cores left to the rest of the process, when pinned
        self._executor = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft-worker") if config.own_thread
                          else InlineExecutor())
        self._thread_id: int | None = None
        self._on_close: list = []  # undo what the worker did to the process (its core placement)
        try:
            self.submit(self._start).result()
        except BaseException:
            self.close()
            raise

    # ---- thread -------------------------------------------------------------------------
    def submit(self, fn, *args, **kwargs) -> Future:
        """Run fn(*args, **kwargs) on the worker thread (at once, on this thread, without one)."""
        return self._executor.submit(fn, *args, **kwargs)

    def close(self) -> None:
        """Stop the thread; a pinned worker gives the rest of the process its cores back."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        while self._on_close:
            self._on_close.pop()()

    def on_close(self, undo) -> None:
        """Call undo() when the worker closes (last registered, first called)."""
        self._on_close.append(undo)

    def _start(self) -> None:
        cfg = self.config
        self._thread_id = threading.get_native_id()
        if cfg.cpu_cores is not None and not cfg.own_thread:
            raise ValueError("a draft worker pinned to its own cores needs its own thread")
        if cfg.cpu_cores is not None and self.device.type == "cpu":
            all_cores = available_cores()
            pin_current_thread(cfg.cpu_cores)
            self.target_cores = place(cfg.cpu_cores, self._thread_id, all_cores)
            self.on_close(lambda: move_other_threads(all_cores, keep=set()))
        self.model, self.tokenizer, self.model_config = load_model(cfg.model, cfg.dtype, self.device,
                                                                   load_quantization(cfg.quantization))
        description = prepare_model(self.model, self.backend, cfg.quantization) if self.device.type == "cpu" \
            else f"{cfg.dtype} on {self.device}"
        mc = self.model_config
        per_block = bytes_per_block(mc, cfg.block_size, self.model.dtype)
        num_blocks = mirror_pool_blocks(cfg.num_kv_tokens, cfg.block_size, per_block, self.device,
                                        cfg.kv_memory_fraction, "draft model")
        self.compiles_decode = cfg.compile_decode and self.device.type == "cpu" and self.backend == "torch"
        if self.compiles_decode:
            description += ", compiled decode step"
        self.runner = ModelRunner(self.model, self.model_config, num_blocks, cfg.block_size, self.device,
                                  compile_decode=self.compiles_decode)
        self.block_manager = BlockManager(num_blocks, cfg.block_size)
        kv_mib = num_blocks * per_block / 2**20
        placement = ("cores " + format_core_list(cfg.cpu_cores) + f" ({torch.get_num_threads()} threads)"
                     if cfg.cpu_cores is not None and self.device.type == "cpu"
                     else f"{torch.get_num_threads()} threads, unpinned" if self.device.type == "cpu" else "")
        if not cfg.own_thread:
            placement += ", on the engine's thread"
        log.info("draft model %s (%s, %d layers) on %s: %s; %s; KV cache %d tokens (%.1f MiB)", cfg.model,
                 mc.architecture, mc.num_layers, self.device, description, placement, num_blocks * cfg.block_size,
                 kv_mib)

    def placement(self) -> tuple[set[int], int]:
        """(CPU affinity, OpenMP thread count) of the worker thread, as the worker sees them."""
        return self.submit(lambda: (os.sched_getaffinity(0), torch.get_num_threads())).result()

    # ---- on the worker thread -----------------------------------------------------------
    def sync(self, request_id: str, token_ids: list[int]) -> DraftSequence:
        """The request's DraftSequence lined up with the committed `token_ids`.

        When the committed tokens are a prefix of what the worker holds (it drafted ahead
        and the target agreed), everything is kept: the tokens past them are a head start.
        Otherwise KV is kept for the longest common prefix (at most all but the last
        committed token, whose logits the next forward needs) and the rest is dropped."""
        seq = self.sequences.get(request_id)
        if seq is None:
            seq = self.sequences[request_id] = DraftSequence([])
        old, n = seq.token_ids, len(token_ids)
        if len(old) > n and old[seq.num_committed:n] == token_ids[seq.num_committed:n]:
            seq.num_committed = n
            seq.num_computed_tokens = min(seq.num_computed_tokens, len(old) - 1)
            return seq
        limit = min(seq.num_computed_tokens, n)
        common = min(seq.num_committed, limit)  # committed tokens never change
        while common < limit and old[common] == token_ids[common]:
            common += 1
        seq.token_ids = list(token_ids)
        seq.num_committed = n
        seq.num_computed_tokens = min(common, n - 1)
        self.block_manager.truncate(seq, seq.num_computed_tokens)
        return seq

    def truncate(self, seq: DraftSequence, num_tokens: int) -> None:
        """Forget seq's tokens from num_tokens on (they were drafts nobody will use)."""
        del seq.token_ids[num_tokens:]
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)
        self.block_manager.truncate(seq, seq.num_computed_tokens)

    def can_run(self, seq: DraftSequence) -> bool:
        """Whether the pool has blocks for seq's uncomputed tokens."""
        return self.block_manager.can_allocate(seq, len(seq.token_ids) - seq.num_computed_tokens)

    def fitting(self, seqs: list[DraftSequence]) -> list[bool]:
        """Which of seqs the pool has blocks for in one forward together, taken in order (each
        may fit alone while two cannot share the last free block)."""
        return self.block_manager.fitting([(seq, len(seq.token_ids) - seq.num_computed_tokens) for seq in seqs])

    @torch.inference_mode()
    def forward(self, seqs: list[DraftSequence]) -> torch.Tensor:
        """Run every sequence's uncomputed tokens (its last token again when all are
        computed); logits [B, V] (float32) at each last token."""
        start = self._busy_since = time.perf_counter()
        for seq in seqs:
            seq.num_computed_tokens = min(seq.num_computed_tokens, len(seq.token_ids) - 1)
        num_new = [len(s.token_ids) - s.num_computed_tokens for s in seqs]
        try:
            for seq, n in zip(seqs, num_new):
                self.block_manager.may_append(seq, n)
            logits = self.runner.execute(seqs, num_new, [True] * len(seqs))  # [B, V]
        finally:
            end = time.perf_counter()
            self._busy_intervals.append((start, end))
            self._busy_since = None
            self.busy_seconds += end - start
            self.num_forwards += 1
        for seq, n in zip(seqs, num_new):
            seq.num_computed_tokens += n
        return logits

    def busy_between(self, t0: float, t1: float) -> float:
        """Seconds of forward passes within [t0, t1] (perf_counter), from any thread."""
        total = sum(max(0.0, min(end, t1) - max(start, t0)) for start, end in list(self._busy_intervals))
        since = self._busy_since
        if since is not None:
            total += max(0.0, min(time.perf_counter(), t1) - max(since, t0))
        return total

    def release(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id, None)
        if seq is not None:
            self.block_manager.free(seq)
