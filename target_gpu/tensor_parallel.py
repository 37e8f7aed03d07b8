"""The target over N tensor-parallel ranks: this process is rank 0, N - 1 worker processes
hold the other shards (runtime.models.tensor_parallel).

Rank 0 keeps the scheduler, proposers and sampler (the engine). Each step it prepares the
pass as plain data (ModelRunner.prepare: token ids, positions, KV slots, block tables,
tree masks) and broadcasts it over the gloo group as one message; every rank then runs
its shard over its own shard of the paged KV cache (the same block ids on every rank),
and the vocab-parallel LM head gathers the logits. KV commits and feature-layer changes
are broadcast the same way. With N = 1 none of this exists: the engine uses a
ModelRunner directly.

This first version runs on the CPU with float weights, eagerly (no compiled decode step,
no CUDA graphs); placement, multi-node launch and worker fault handling come next.
"""
from __future__ import annotations

import logging
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runtime.models.tensor_parallel import TPGroup, shard_model, sharded_config
from target_gpu.model_runner import ModelRunner

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(rank: int, world_size: int, init_method: str, model_path: str, dtype: str, num_blocks: int,
                 block_size: int, timeout_s: float) -> None:
    """A worker rank: load and shard the model, then run what rank 0 broadcasts until "stop"."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    from runtime.models.loader import load_model
    model = load_model(model_path, dtype, torch.device("cpu"), "none")[0]
    config = sharded_config(model.config, world_size)
    shard_model(model, TPGroup(rank, world_size))
    runner = ModelRunner(model, config, num_blocks, block_size, torch.device("cpu"))
    dist.barrier()  # loaded
    try:
        while True:
            message = [None]
            dist.broadcast_object_list(message, src=0)
            command, args = message[0]
            if command == "stop":
                break
            getattr(runner, command)(*args)
    finally:
        dist.destroy_process_group()


class TPRunner:
    """ModelRunner's interface over N ranks; this process is rank 0."""

    def __init__(self, model, model_path: str, dtype: str, world_size: int, num_blocks_of, block_size: int,
                 timeout_s: float = 300.0):
        """model: the whole float model, loaded here (rank 0 keeps its shard of it);
        num_blocks_of(per-rank ModelConfig) -> the KV blocks every rank allocates."""
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        config = sharded_config(model.config, world_size)
        num_blocks = num_blocks_of(config)
        context = mp.get_context("spawn")
        self.workers = [context.Process(target=_worker_main, daemon=True, name=f"tp-rank-{rank}",
                                        args=(rank, world_size, init_method, model_path, dtype, num_blocks,
                                              block_size, timeout_s))
                        for rank in range(1, world_size)]
        try:
            for worker in self.workers:
                worker.start()
            dist.init_process_group("gloo", init_method=init_method, rank=0, world_size=world_size,
                                    timeout=timedelta(seconds=timeout_s))
            shard_model(model, TPGroup(0, world_size))
            self.runner = ModelRunner(model, config, num_blocks, block_size, torch.device("cpu"))
            dist.barrier()  # every rank loaded
        except BaseException:
            self._stop_workers()
            raise
        self.world_size, self.num_blocks, self.config = world_size, num_blocks, config
        log.info("tensor parallel: %d ranks over gloo, %d KV blocks each", world_size, num_blocks)

    # ModelRunner's interface ---------------------------------------------------------------
    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.runner.feature_layers

    def _broadcast(self, command: str, *args) -> None:
        dist.broadcast_object_list([(command, args)], src=0)

    def execute(self, seqs, num_new_tokens, needs_logits, trees=None, return_hidden=False):
        step = self.runner.prepare(seqs, num_new_tokens, needs_logits, trees)
        self._broadcast("run", step, return_hidden)
        return self.runner.run(step, return_hidden)

    def commit_accepted(self, src_slots: list[int], dst_slots: list[int]) -> None:
        if src_slots:
            self._broadcast("commit_accepted", src_slots, dst_slots)
            self.runner.commit_accepted(src_slots, dst_slots)

    def set_feature_layers(self, layers: tuple[int, ...]) -> None:
        self.runner.set_feature_layers(layers)  # checked here first
        self._broadcast("set_feature_layers", tuple(layers))

    def close(self) -> None:
        """Stop the workers and leave the process group (idempotent)."""
        if not self.workers:
            return
        try:
            self._broadcast("stop")
        finally:
            self._stop_workers()
            if dist.is_initialized():
                dist.destroy_process_group()

    def _stop_workers(self) -> None:
        for worker in self.workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.kill()
        self.workers = []
