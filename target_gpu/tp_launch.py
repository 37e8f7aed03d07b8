"""Where tensor-parallel ranks run, how they meet, and the worker ranks' loop.

Ranks are numbered node by node, `ranks_per_node = N / nnodes`.
  - One node: rank 0 spawns ranks 1..N-1 here.
  - Several nodes (--nnodes, --node-rank, --master-addr, --master-port): each node's
    process is the first rank of its node and spawns the rest; node 0's first rank is rank 0.
  - torchrun: every rank is a process torchrun started (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT); nothing is spawned.
A process that is not rank 0 runs `run_node` and exits when rank 0 stops it.

Groups: the default gloo group (a long timeout: ranks join and load their shards) carries
the setup message; the step group (gloo, timeout --worker-timeout; twice that on workers, so
rank 0 notices a failure first) carries every command, and on a CPU the tensors too; on
CUDA the tensors go over an NCCL group. With context parallelism (target_gpu.context_parallel)
the ranks form a mesh of C context-parallel x T tensor-parallel ranks, rank = c * T + t
(`RankGroups`): each c has a tensor group of its T ranks, each t a ring of its C ranks.

Placement: on CUDA rank i takes cuda:(its local rank). On a CPU each rank of a node is
pinned to its own share of the node's cores (the draft worker's cores excluded), when there
are at least as many cores as ranks. Spawned workers exit when their parent does, and
ignore the process group's SIGINT/SIGTERM (rank 0 drains, then stops them).
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from draft_cpu.placement import available_cores, pin_process, split_cores
from runtime.models.tensor_parallel import TPGroup, shard_model, sharded_config
from target_gpu.model_runner import ModelRunner

log = logging.getLogger(__name__)

JOIN_TIMEOUT = timedelta(minutes=30)  # the default group: every rank joins and loads its shard within this
LOST_CONTACT = 3  # a worker's exit status when a peer failed (a consequence, not the cause)
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


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
    context_parallel_size: int = 1  # C of the C x T mesh (target_gpu.context_parallel); world_size = C * T

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.nnodes < 1 or self.world_size % self.nnodes:
            raise ValueError(f"tensor parallel size {self.world_size} does not split over {self.nnodes} nodes "
                             f"(it must be a multiple of --nnodes)")
        if self.context_parallel_size < 1 or self.world_size % self.context_parallel_size:
            raise ValueError(f"{self.world_size} ranks do not form a mesh of {self.context_parallel_size} "
                             f"context-parallel ranks")
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
    def tensor_parallel_size(self) -> int:
        return self.world_size // self.context_parallel_size

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
    quantization: str  # what rank 0 loaded with (runtime.models.loader.QUANTIZATIONS)
    num_blocks: int
    block_size: int
    attention_backend: str


def join(launch: TPLaunch, rank: int, step_timeout_s: float):
    """Join the default group; return the step group (every rank creates groups in this order)."""
    dist.init_process_group("gloo", init_method=launch.init_method, rank=rank, world_size=launch.world_size,
                            timeout=JOIN_TIMEOUT)
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=step_timeout_s))


def rank_device(launch: TPLaunch, local_rank: int) -> torch.device:
    """cuda:(local rank), made this process's current device, or the CPU."""
    if launch.device_type != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


@dataclass(frozen=True)
class RankGroups:
    """A rank's place in the mesh (rank = cp_index * T + tp_index) and the groups it uses."""

    steps: object  # every rank: rank 0's commands
    tensors: object  # the T ranks of its cp_index: the shards' all-reduces and the logits' gather
    ring: object  # the C ranks of its tp_index (ring_ranks, in ring order): ring attention; None without CP
    ring_ranks: tuple[int, ...]
    cp_index: int
    tp_index: int


def rank_groups(launch: TPLaunch, rank: int, device: torch.device, steps, step_timeout_s: float) -> RankGroups:
    """This rank's groups; every rank calls this at the same point (groups are made collectively).
    Activations go over NCCL between GPUs, else over the step group itself (T or C alone) or
    gloo groups of the mesh (C x T, each with the step group's timeout)."""
    c_size, t_size = launch.context_parallel_size, launch.tensor_parallel_size
    cp_index, tp_index = divmod(rank, t_size)
    ring_ranks = tuple(c * t_size + tp_index for c in range(c_size))
    if c_size == 1:
        tensors = dist.new_group(backend="nccl") if device.type == "cuda" else steps
        return RankGroups(steps, tensors, None, ring_ranks, 0, tp_index)
    if t_size == 1:
        return RankGroups(steps, steps, steps, ring_ranks, cp_index, 0)
    timeout = timedelta(seconds=step_timeout_s)
    tensors = [dist.new_group(list(range(c * t_size, (c + 1) * t_size)), timeout=timeout, backend="gloo")
               for c in range(c_size)]
    rings = [dist.new_group([c * t_size + t for c in range(c_size)], timeout=timeout, backend="gloo")
             for t in range(t_size)]
    return RankGroups(steps, tensors[cp_index], rings[tp_index], ring_ranks, cp_index, tp_index)


def shard(model, groups: RankGroups, tp_size: int, device: torch.device):
    """Keep this rank's shard of a model loaded on the host and move it to `device`; its config."""
    if tp_size == 1:
        return model.to(device).config
    config = sharded_config(model.config, tp_size)
    shard_model(model, TPGroup(groups.tp_index, tp_size, groups.tensors))
    model.to(device)
    return config


# ---- worker ranks ------------------------------------------------------------------------------
def is_comm_error(e: BaseException) -> bool:
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
        steps = join(launch, rank, 2 * launch.timeout_s)
        device = rank_device(launch, local_rank)
        groups = rank_groups(launch, rank, device, steps, 2 * launch.timeout_s)
        message = [None]
        dist.broadcast_object_list(message, src=0)
        setup: RankSetup = message[0]
        from runtime.models.loader import load_model
        model = load_model(setup.model_path, setup.dtype, torch.device("cpu"), setup.quantization)[0]
        config = shard(model, groups, launch.tensor_parallel_size, device)
        runner = None if groups.cp_index else ModelRunner(model, config, setup.num_blocks, setup.block_size, device,
                                                          setup.attention_backend)  # the ranks that decode
        if launch.context_parallel_size > 1:
            from target_gpu.context_parallel import RingMember, RingWorker
            runner = RingWorker(RingMember(model, config, groups, launch.context_parallel_size, runner), runner)
        dist.barrier()  # loaded
        while True:
            dist.broadcast_object_list(message, src=0, group=steps)
            command, args = message[0]
            if command == "stop":
                return 0
            if command != "ping":
                getattr(runner, command)(*args)
    except Exception as e:  # noqa: BLE001 - the exit status tells rank 0 what happened
        if is_comm_error(e):
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


def node_cores(launch: TPLaunch, reserved: list[int]) -> list[list[int]] | None:
    """Each local rank's cores on this node (None: fewer cores than ranks, nothing pinned)."""
    cores = split_cores(available_cores(), launch.ranks_per_node, reserved)
    if cores is None and launch.ranks_per_node > 1:
        log.warning("tensor parallel: %d ranks on this node but only %d free cores: ranks are not pinned",
                    launch.ranks_per_node, len(available_cores()) - len(reserved))
    return cores


def spawn(launch: TPLaunch, cores: list[list[int]] | None) -> dict[int, mp.Process]:
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
    cores = node_cores(launch, []) if launch.torchrun_rank is None else None
    workers = spawn(launch, cores)
    log.info("tensor parallel: rank %d of %d%s, joining %s", launch.rank, launch.world_size,
             f" (with ranks {', '.join(map(str, workers))})" if workers else "", launch.init_method)
    code = run_rank(launch, launch.rank, launch.local_rank, cores[0] if cores else None)
    for worker in workers.values():
        worker.join(timeout=2 * launch.timeout_s)
        if worker.is_alive():
            worker.kill()
        code = code or (worker.exitcode != 0)
    return code
