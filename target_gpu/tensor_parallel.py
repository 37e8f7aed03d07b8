"""The target over N tensor-parallel ranks (runtime.models.tensor_parallel shards it).

Rank 0 is the engine's process: it keeps the scheduler, proposers and sampler. Each step
it prepares the pass as plain data (ModelRunner.prepare: token ids, positions, KV slots,
block tables, tree masks) and broadcasts it over a gloo group as one message; every rank
runs its shard over its own shard of the paged KV cache (the same block ids on every
rank), and the vocab-parallel LM head gathers the logits. KV commits and feature-layer
changes are broadcast the same way. With N = 1 none of this exists: the engine uses a
ModelRunner directly.

Launch (TPLaunch): ranks are numbered node by node, `ranks_per_node = N / nnodes`.
  - One node: rank 0 spawns ranks 1..N-1 here.
  - Several nodes (--nnodes, --node-rank, --master-addr, --master-port): each node's
    process is the first rank of its node and spawns the rest; node 0's first rank is rank 0.
  - torchrun: every rank is a process torchrun started (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT); nothing is spawned.
A process that is not rank 0 runs `run_node` and exits when rank 0 stops it.

Groups: the default gloo group (a long timeout: ranks join and load their shards) carries
the setup message; the step group (gloo, timeout --worker-timeout) carries every command,
and on a CPU the tensors too; on CUDA the tensors go over an NCCL group.

Faults: a rank that exits breaks its connections, so rank 0's next collective fails at once;
a rank that hangs makes it time out after --worker-timeout. Either way the step raises
TPWorkerError naming the rank where this process can tell (its own spawned workers), and
every later call raises it too. Rank 0 sends a heartbeat when idle, so workers wait for
commands under the same timeout (twice rank 0's: rank 0 notices first) and exit when rank 0
is gone. Spawned workers also exit when their parent does, so no shutdown (close(), garbage
collection, SIGTERM, SIGKILL) leaves an orphan.

Placement: on CUDA rank i takes cuda:(its local rank). On a CPU each rank of a node is
pinned to its own share of the node's cores (the draft worker's cores excluded), when there
are at least as many cores as ranks; rank 0's process, draft thread included, takes the first.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from draft_cpu.placement import available_cores, format_core_list, pin_process, split_cores
from runtime.models.tensor_parallel import TPGroup, shard_model, sharded_config
from target_gpu.model_runner import ModelRunner

log = logging.getLogger(__name__)

JOIN_TIMEOUT = timedelta(minutes=30)  # the default group: every rank joins and loads its shard within this
LOST_CONTACT = 3  # a worker's exit status when a peer failed (a consequence, not the cause)
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class TPWorkerError(RuntimeError):
    """A tensor-parallel rank died, hung past the worker timeout, or lost its connection."""


@dataclass(frozen=True)
class TPLaunch:
    """Where the ranks run and how they meet (the module docstring)."""

    world_size: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port (one node), torchrun's 29500 (several)
    timeout_s: float = 60.0  # --worker-timeout
    device_type: str = "cpu"  # cpu | cuda: rank i of a node takes cuda:i
    torchrun_rank: int | None = None  # RANK, when torchrun started every rank
    torchrun_local_rank: int = 0  # LOCAL_RANK

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.nnodes < 1 or self.world_size % self.nnodes:
            raise ValueError(f"tensor parallel size {self.world_size} does not split over {self.nnodes} nodes "
                             f"(it must be a multiple of --nnodes)")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in 0..{self.nnodes - 1}, got {self.node_rank}")
        if self.timeout_s <= 0:
            raise ValueError(f"--worker-timeout must be > 0 seconds, got {self.timeout_s}")

    @classmethod
    def of(cls, tensor_parallel_size: int, nnodes: int = 1, node_rank: int = 0, master_addr: str | None = None,
           master_port: int | None = None, timeout_s: float = 60.0, device_type=lambda: "cpu",
           environ=os.environ) -> TPLaunch | None:
        """From the flags, or from torchrun's environment when it started this process
        (WORLD_SIZE > 1); None when there is one rank. device_type() -> cpu | cuda."""
        if all(name in environ for name in TORCHRUN_VARS) and int(environ["WORLD_SIZE"]) > 1:
            world = int(environ["WORLD_SIZE"])
            if tensor_parallel_size not in (1, world):
                raise ValueError(f"--tensor-parallel-size {tensor_parallel_size} but torchrun started {world} "
                                 f"ranks (WORLD_SIZE)")
            return cls(world, master_addr=environ["MASTER_ADDR"], master_port=int(environ["MASTER_PORT"]),
                       timeout_s=timeout_s, device_type=device_type(), torchrun_rank=int(environ["RANK"]),
                       torchrun_local_rank=int(environ.get("LOCAL_RANK", 0)))
        if tensor_parallel_size == 1 and nnodes == 1:
            return None
        return cls(tensor_parallel_size, nnodes, node_rank, master_addr or "127.0.0.1",
                   master_port if master_port is not None else (29500 if nnodes > 1 else None), timeout_s,
                   device_type())

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self.torchrun_rank if self.torchrun_rank is not None else self.node_rank * self.ranks_per_node

    @property
    def local_rank(self) -> int:
        return self.torchrun_local_rank if self.torchrun_rank is not None else 0

    @property
    def spawned(self) -> list[tuple[int, int]]:
        """(rank, local rank) of the workers this process starts."""
        if self.torchrun_rank is not None:
            return []
        return [(self.rank + i, i) for i in range(1, self.ranks_per_node)]

    @property
    def init_method(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"

    def with_port(self) -> TPLaunch:
        """A free local port when none was given (one node)."""
        if self.master_port is not None:
            return self
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return replace(self, master_port=s.getsockname()[1])


@dataclass(frozen=True)
class RankSetup:
    """What rank 0 tells every rank once they have joined."""

    model_path: str
    dtype: str
    num_blocks: int
    block_size: int
    attention_backend: str


def _join(launch: TPLaunch, rank: int, step_timeout_s: float):
    """Join the default group; return the step group (every rank creates groups in this order)."""
    dist.init_process_group("gloo", init_method=launch.init_method, rank=rank, world_size=launch.world_size,
                            timeout=JOIN_TIMEOUT)
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=step_timeout_s))


def _rank_device(launch: TPLaunch, local_rank: int) -> torch.device:
    """cuda:(local rank), made this process's current device, or the CPU."""
    if launch.device_type != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def _tensor_group(device: torch.device, steps):
    """The group for activations: NCCL between GPUs, else the step group itself."""
    return dist.new_group(backend="nccl") if device.type == "cuda" else steps


def _shard(model, rank: int, world: int, device: torch.device, tensors):
    """Keep this rank's shard of a model loaded on the host and move it to `device`; its config."""
    config = sharded_config(model.config, world)
    shard_model(model, TPGroup(rank, world, tensors))
    model.to(device)
    return config


# ---- worker ranks ------------------------------------------------------------------------------
def _is_comm_error(e: BaseException) -> bool:
    return isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and "gloo" in str(e))


def _exit_with_parent(parent_pid: int) -> None:
    """Exit this process when its parent is gone (reparented), however the parent died."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(LOST_CONTACT)
    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def run_rank(launch: TPLaunch, rank: int, local_rank: int, cores: list[int] | None) -> int:
    """One worker rank, until rank 0 says stop (returns 0) or a peer fails (LOST_CONTACT)."""
    if cores:
        pin_process(cores)
    else:
        torch.set_num_threads(1)
    try:
        steps = _join(launch, rank, 2 * launch.timeout_s)
        device = _rank_device(launch, local_rank)
        tensors = _tensor_group(device, steps)
        message = [None]
        dist.broadcast_object_list(message, src=0)
        setup: RankSetup = message[0]
        from runtime.models.loader import load_model
        model = load_model(setup.model_path, setup.dtype, torch.device("cpu"), "none")[0]
        config = _shard(model, rank, launch.world_size, device, tensors)
        runner = ModelRunner(model, config, setup.num_blocks, setup.block_size, device, setup.attention_backend)
        dist.barrier()  # loaded
        while True:
            dist.broadcast_object_list(message, src=0, group=steps)
            command, args = message[0]
            if command == "stop":
                return 0
            if command != "ping":
                getattr(runner, command)(*args)
    except Exception as e:  # noqa: BLE001 - the exit status tells rank 0 what happened
        if _is_comm_error(e):
            log.error("tensor-parallel rank %d lost contact with its peers: %s", rank, e)
            return LOST_CONTACT
        log.exception("tensor-parallel rank %d failed", rank)
        return 1


def _spawned_main(launch: TPLaunch, rank: int, local_rank: int, cores: list[int] | None, parent_pid: int) -> None:
    # Ctrl-C and a service manager's SIGTERM reach the whole process group: the parent drains
    # and then stops this rank, which must keep serving until then
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _exit_with_parent(parent_pid)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank {rank}: %(message)s")
    code = run_rank(launch, rank, local_rank, cores)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip the process group's destructors: they may abort after a failure


def _node_cores(launch: TPLaunch, reserved: list[int]) -> list[list[int]] | None:
    """Each local rank's cores on this node (None: fewer cores than ranks, nothing pinned)."""
    cores = split_cores(available_cores(), launch.ranks_per_node, reserved)
    if cores is None and launch.ranks_per_node > 1:
        log.warning("tensor parallel: %d ranks on this node but only %d free cores: ranks are not pinned",
                    launch.ranks_per_node, len(available_cores()) - len(reserved))
    return cores


def _spawn(launch: TPLaunch, cores: list[list[int]] | None) -> dict[int, mp.Process]:
    context = mp.get_context("spawn")
    workers = {rank: context.Process(target=_spawned_main, daemon=True, name=f"tp-rank-{rank}",
                                     args=(launch, rank, local, cores[local] if cores else None, os.getpid()))
               for rank, local in launch.spawned}
    for worker in workers.values():
        worker.start()
    return workers


def run_node(launch: TPLaunch) -> int:
    """This process's ranks when it is not rank 0 (another node's first rank with the
    node's other ranks, or one torchrun rank); returns the exit status once rank 0 stops
    them (0) or a rank fails."""
    cores = _node_cores(launch, []) if launch.torchrun_rank is None else None
    workers = _spawn(launch, cores)
    log.info("tensor parallel: rank %d of %d%s, joining %s", launch.rank, launch.world_size,
             f" (with ranks {', '.join(map(str, workers))})" if workers else "", launch.init_method)
    code = run_rank(launch, launch.rank, launch.local_rank, cores[0] if cores else None)
    for worker in workers.values():
        worker.join(timeout=2 * launch.timeout_s)
        if worker.is_alive():
            worker.kill()
        code = code or (worker.exitcode != 0)
    return code


# ---- rank 0 ----------------------------------------------------------------------------------
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

    def __init__(self, launch: TPLaunch, workers: dict[int, mp.Process]):
        self.launch, self.workers = launch, workers
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
            self.error = TPWorkerError(self._diagnose(e) if _is_comm_error(e) else
                                       f"a tensor-parallel step failed on rank 0 (the ranks are out of step now): "
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
                log.error("tensor parallel: %s", e)
                return
            finally:
                self.lock.release()

    def _any_exited(self) -> bool:
        return any(w.exitcode is not None for w in self.workers.values())

    def _check_workers(self) -> None:
        for rank, worker in self.workers.items():
            if worker.exitcode is not None:
                self.error = TPWorkerError(f"tensor-parallel rank {rank} (pid {worker.pid}) "
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
            return f"tensor-parallel rank {rank} (pid {worker.pid}) {_exit_text(worker.exitcode)}"
        stopped = [rank for rank, w in self.workers.items() if _proc_state(w.pid) == "T"]
        others = stopped or [r for r in range(1, self.launch.world_size)]
        what = f"rank {others[0]}" if len(others) == 1 else f"one of ranks {', '.join(map(str, others))}"
        if "Timed out" in str(error):
            return (f"tensor-parallel {what}{' (stopped)' if stopped else ''} did not answer within "
                    f"{self.launch.timeout_s:g} s (--worker-timeout)")
        return f"tensor-parallel {what} lost its connection to rank 0: {error}"

    def close(self) -> None:
        """Stop the ranks and leave the process group (idempotent; no hang on a failure)."""
        self._stopped.set()
        with self.lock:
            stopping = self.ready and self.error is None
            if stopping:
                try:
                    dist.broadcast_object_list([("stop", ())], src=0, group=self.steps)
                except Exception as e:  # noqa: BLE001 - shutting down: kill what does not stop
                    log.warning("tensor parallel: stopping the ranks failed: %s", e)
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

    def __init__(self, model, model_path: str, dtype: str, launch: TPLaunch,
                 num_blocks_of, block_size: int, attention_backend: str = "torch", draft_cores: list[int] = ()):
        """model: the whole model, loaded on the CPU (this rank keeps its shard: on
        cuda:(local rank) or the CPU, as launch.device_type says); num_blocks_of(per-rank
        ModelConfig) -> the KV blocks every rank allocates, measured with the shard in place;
        draft_cores: cores the draft worker will take (no rank is pinned there)."""
        launch = launch.with_port()
        world = launch.world_size
        sharded_config(model.config, world)  # a model that does not divide fails before anything starts
        cores = _node_cores(launch, list(draft_cores)) if launch.device_type == "cpu" else None
        self._ranks = ranks = _Ranks(launch, _spawn(launch, cores))
        self._finalizer = weakref.finalize(self, ranks.close)
        try:
            if cores:
                ranks.restore_cores = pin_process(cores[0])
            log.info("tensor parallel: %d ranks (%d node%s), waiting for them at %s", world, launch.nnodes,
                     "s" if launch.nnodes > 1 else "", launch.init_method)
            self._while_workers_live(lambda: setattr(ranks, "steps", _join(launch, 0, launch.timeout_s)))
            device = _rank_device(launch, launch.local_rank)
            tensors = _tensor_group(device, ranks.steps)
            config = _shard(model, 0, world, device, tensors)  # before sizing the KV cache: the shard is there
            setup = RankSetup(model_path, dtype, num_blocks_of(config), block_size, attention_backend)
            self._while_workers_live(lambda: dist.broadcast_object_list([setup], src=0))
            self.runner = ModelRunner(model, config, setup.num_blocks, block_size, device, attention_backend)
            self._while_workers_live(dist.barrier)  # every rank loaded
            ranks.ready = True
        except BaseException:
            self.close()
            raise
        ranks.start_heartbeat()
        self.world_size, self.num_blocks, self.config = world, setup.num_blocks, config
        log.info("tensor parallel: %d ranks over gloo%s, %d KV blocks each; cores: %s", world,
                 " (tensors over NCCL)" if launch.device_type == "cuda" else "", setup.num_blocks,
                 "; ".join(f"rank {i} {format_core_list(c)}" for i, c in enumerate(cores)) if cores else "not pinned")

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
