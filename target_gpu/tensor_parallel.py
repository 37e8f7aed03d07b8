"""The target over N tensor-parallel ranks, seen from rank 0 (runtime.models.tensor_parallel
shards it; target_gpu.tp_launch starts and runs the other ranks).

Rank 0 is the engine's process: it keeps the scheduler, proposers and sampler. Each step
it prepares the pass as plain data (ModelRunner.prepare: token ids, positions, KV slots,
block tables, tree masks) and broadcasts it over a gloo group as one message; every rank
runs its shard over its own shard of the paged KV cache (the same block ids on every
rank), and the vocab-parallel LM head gathers the logits. KV commits and feature-layer
changes are broadcast the same way. With N = 1 none of this exists: the engine uses a
ModelRunner directly.

Faults: a rank that exits breaks its connections, so rank 0's next collective fails at once;
a rank that hangs makes it time out after --worker-timeout. Either way the step raises
TPWorkerError naming the rank where this process can tell (its own spawned workers), and
every later call raises it too. Rank 0 sends a heartbeat when idle, so workers wait for
commands under the same timeout and exit when rank 0 is gone. Spawned workers also exit
when their parent does, so no shutdown (close(), garbage collection, SIGTERM, SIGKILL)
leaves an orphan.
"""
from __future__ import annotations

import logging
import signal
import threading
import time
import weakref
from contextlib import contextmanager

import torch.distributed as dist
import torch.multiprocessing as mp

from draft_cpu.placement import format_core_list, pin_process
from runtime.models.tensor_parallel import sharded_config
from target_gpu.model_runner import ModelRunner
from target_gpu.tp_launch import (LOST_CONTACT, RankSetup, TPLaunch, is_comm_error, join, node_cores, rank_device,
                                  rank_groups, shard, spawn)

log = logging.getLogger(__name__)


class TPWorkerError(RuntimeError):
    """A tensor-parallel rank died, hung past the worker timeout, or lost its connection."""


def _exit_text(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    if code == LOST_CONTACT:
        return "lost contact with a peer"
    return f"exited with status {code}"


def _proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "?"


class _Ranks:
    """Rank 0's link to the other ranks: every command goes out as one broadcast on the step
    group under one lock (shared with the idle heartbeat); the first failure is kept and
    raised by every later call. Holds no reference to the TPRunner (its finalizer closes it)."""

    def __init__(self, launch: TPLaunch, workers: dict[int, mp.Process], kind: str = "tensor-parallel"):
        self.launch, self.workers, self.kind = launch, workers, kind
        self.steps = None  # the step group, once joined
        self.ready = False  # every rank loaded and waiting for commands
        self.lock = threading.Lock()
        self.error: TPWorkerError | None = None
        self.last_sent = time.monotonic()
        self.restore_cores = None  # undoes rank 0's pinning
        self._stopped = threading.Event()

    def start_heartbeat(self) -> None:
        threading.Thread(target=self._heartbeat, name="tp-heartbeat", daemon=True).start()

    @contextmanager
    def _failures(self):
        """Keep the first failure, as TPWorkerError naming the rank where it can."""
        if self.error is not None:
            raise self.error
        try:
            self._check_workers()
            yield
        except TPWorkerError as e:
            self.error = e
            raise
        except Exception as e:
            self.error = TPWorkerError(self._diagnose(e) if is_comm_error(e) else
                                       f"a {self.kind} step failed on rank 0 (the ranks are out of step now): "
                                       f"{type(e).__name__}: {e}")
            raise self.error from e

    def _broadcast(self, name: str, args: tuple) -> None:
        dist.broadcast_object_list([(name, args)], src=0, group=self.steps)
        self.last_sent = time.monotonic()

    @contextmanager
    def command(self, name: str, *args):
        """Send a command to every rank; the body runs rank 0's part of it."""
        with self.lock, self._failures():
            self._broadcast(name, args)
            yield

    def check(self) -> None:
        """Raise the failure, if any (the heartbeat finds one while the engine is idle)."""
        if self.error is not None:
            raise self.error

    def _heartbeat(self) -> None:
        """While the engine is idle, a "ping" every timeout / 4 keeps the workers waiting,
        and a worker that exits is noticed within a second."""
        while not self._stopped.wait(min(1.0, self.launch.timeout_s / 4)):
            due = time.monotonic() - self.last_sent > self.launch.timeout_s / 4 or self._any_exited()
            if not due or not self.lock.acquire(blocking=False):  # busy: a step is under way
                continue
            try:
                if not self.ready:  # closed meanwhile
                    return
                with self._failures():
                    self._broadcast("ping", ())
            except TPWorkerError as e:
                log.error("%s: %s", self.kind, e)
                return
            finally:
                self.lock.release()

    def _any_exited(self) -> bool:
        return any(w.exitcode is not None for w in self.workers.values())

    def _check_workers(self) -> None:
        for rank, worker in self.workers.items():
            if worker.exitcode is not None:
                self.error = TPWorkerError(f"{self.kind} rank {rank} (pid {worker.pid}) "
                                           f"{_exit_text(worker.exitcode)}")
                raise self.error

    def _diagnose(self, error: BaseException) -> str:
        """Which rank failed: one of ours that exited (waiting a moment for it to be reaped),
        else the ones that cannot be told apart."""
        deadline = time.monotonic() + 1.0
        while not self._any_exited() and time.monotonic() < deadline:
            time.sleep(0.02)
        exited = sorted(((w.exitcode == LOST_CONTACT, rank) for rank, w in self.workers.items()
                         if w.exitcode is not None))
        if exited:
            rank = exited[0][1]
            worker = self.workers[rank]
            return f"{self.kind} rank {rank} (pid {worker.pid}) {_exit_text(worker.exitcode)}"
        stopped = [rank for rank, w in self.workers.items() if _proc_state(w.pid) == "T"]
        others = stopped or [r for r in range(1, self.launch.world_size)]
        what = f"rank {others[0]}" if len(others) == 1 else f"one of ranks {', '.join(map(str, others))}"
        if "Timed out" in str(error):
            return (f"{self.kind} {what}{' (stopped)' if stopped else ''} did not answer within "
                    f"{self.launch.timeout_s:g} s (--worker-timeout)")
        return f"{self.kind} {what} lost its connection to rank 0: {error}"

    def close(self) -> None:
        """Stop the ranks and leave the process group (idempotent; no hang on a failure)."""
        self._stopped.set()
        with self.lock:
            stopping = self.ready and self.error is None
            if stopping:
                try:
                    dist.broadcast_object_list([("stop", ())], src=0, group=self.steps)
                except Exception as e:  # noqa: BLE001 - shutting down: kill what does not stop
                    log.warning("%s: stopping the ranks failed: %s", self.kind, e)
                    stopping = False
            self.steps, self.ready = None, False
            for worker in self.workers.values():
                worker.join(timeout=10 if stopping else 0.5)
                if worker.is_alive():
                    worker.kill()
                    worker.join(timeout=5)
            self.workers = {}
            if dist.is_initialized():
                dist.destroy_process_group()
            if self.restore_cores is not None:
                self.restore_cores()
                self.restore_cores = None


class TPRunner:
    """ModelRunner's interface over the ranks of `launch`; this process is rank 0."""

    kind = "tensor-parallel"

    def __init__(self, model, model_path: str, dtype: str, quantization: str, launch: TPLaunch,
                 num_blocks_of, block_size: int, attention_backend: str = "torch", draft_cores: list[int] = ()):
        """model: the whole model, loaded on the CPU with `quantization` (every rank loads it
        so, then keeps its shard: on
        cuda:(local rank) or the CPU, as launch.device_type says); num_blocks_of(per-rank
        ModelConfig) -> the KV blocks every rank allocates, measured with the shard in place;
        draft_cores: cores the draft worker will take (no rank is pinned there)."""
        launch = launch.with_port()
        world = launch.world_size
        sharded_config(model.config, launch.tensor_parallel_size)  # a model that does not divide fails first
        cores = node_cores(launch, list(draft_cores)) if launch.device_type == "cpu" else None
        self._ranks = ranks = _Ranks(launch, spawn(launch, cores), self.kind)
        self._finalizer = weakref.finalize(self, ranks.close)
        try:
            if cores and self._pins_rank0(launch):
                ranks.restore_cores = pin_process(cores[0])
            log.info("%s: %d ranks (%d node%s), waiting for them at %s", self.kind, world, launch.nnodes,
                     "s" if launch.nnodes > 1 else "", launch.init_method)
            self._while_workers_live(lambda: setattr(ranks, "steps", join(launch, 0, launch.timeout_s)))
            device = rank_device(launch, launch.local_rank)
            self.groups = rank_groups(launch, 0, device, ranks.steps, launch.timeout_s)
            config = shard(model, self.groups, launch.tensor_parallel_size, device)  # before sizing the KV cache
            setup = RankSetup(model_path, dtype, quantization, num_blocks_of(config), block_size, attention_backend)
            self._while_workers_live(lambda: dist.broadcast_object_list([setup], src=0))
            self.runner = ModelRunner(model, config, setup.num_blocks, block_size, device, attention_backend)
            self._while_workers_live(dist.barrier)  # every rank loaded
            ranks.ready = True
        except BaseException:
            self.close()
            raise
        ranks.start_heartbeat()
        self.world_size, self.num_blocks, self.config = world, setup.num_blocks, config
        self.tp_size = launch.tensor_parallel_size
        pinned = self._pins_rank0(launch)
        log.info("%s: %d ranks over gloo%s, %d KV blocks in %s; cores: %s", self.kind, world,
                 " (tensors over NCCL)" if launch.device_type == "cuda" else "", setup.num_blocks,
                 f"each of ranks 0..{self.tp_size - 1}" if self.tp_size > 1 else "rank 0",
                 "; ".join(f"rank {i} {format_core_list(c)}" + ("" if i or pinned else " (not pinned)")
                           for i, c in enumerate(cores)) if cores else "not pinned")

    def _pins_rank0(self, launch: TPLaunch) -> bool:
        """Whether this process takes only its share of the cores, as every rank does."""
        return True

    def _while_workers_live(self, fn) -> None:
        """Run a blocking join step; fail at once if a spawned worker exits meanwhile."""
        result: list[BaseException | None] = []
        thread = threading.Thread(target=lambda: result.append(_capture(fn)), daemon=True, name="tp-join")
        thread.start()
        while thread.is_alive():
            thread.join(timeout=0.1)
            self._ranks._check_workers()
        if result[0] is not None:
            raise result[0]

    # ModelRunner's interface ---------------------------------------------------------------
    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.runner.feature_layers

    @property
    def workers(self) -> dict[int, mp.Process]:
        """The worker processes this process spawned, by rank."""
        return self._ranks.workers

    def execute(self, seqs, num_new_tokens, needs_logits, trees=None, return_hidden=False):
        step = self.runner.prepare(seqs, num_new_tokens, needs_logits, trees)
        with self._ranks.command("run", step, return_hidden):
            return self.runner.run(step, return_hidden)

    def commit_accepted(self, src_slots: list[int], dst_slots: list[int]) -> None:
        if src_slots:
            with self._ranks.command("commit_accepted", src_slots, dst_slots):
                self.runner.commit_accepted(src_slots, dst_slots)

    def set_feature_layers(self, layers: tuple[int, ...]) -> None:
        self.runner.set_feature_layers(layers)  # checked here first
        with self._ranks.command("set_feature_layers", tuple(layers)):
            pass

    def check_health(self) -> None:
        """Raise TPWorkerError once a rank has failed."""
        self._ranks.check()

    def close(self) -> None:
        """Stop the ranks and leave the process group (idempotent)."""
        self._finalizer()


def _capture(fn) -> BaseException | None:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
        return e
    return None
