"""The engine with its target split over tensor-parallel ranks (target_gpu.tensor_parallel),
against the single-process engine on the same model, greedy in float32:

- the default model at TP=3 (its 9 heads and 3 KV heads split in 3): plain decoding,
  lookahead trees and a draft model, so tree masks and KV commits cross the process boundary;
- tiny random Llama, Qwen2 and Mistral models at TP=2 over 64 tokens, with prefix caching
  and with a KV cache small enough to preempt;
- two "nodes" on 127.0.0.1 (one rank each: the second started as `python -m runtime.serve
  --node-rank 1`), and two ranks started by torchrun (`torchrun -m runtime.generate`).
close() leaves no worker behind. Faults are in test_tensor_parallel_faults.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from runtime.config import EngineConfig
from runtime.models.loader import DEFAULT_MODEL
from runtime.models.quant_linear import linear_kernels
from target_gpu.tp_launch import TPLaunch
from tests.helpers import free_port, greedy, new_engine, save_tiny_model

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
           "List the planets of the solar system in order: Mercury, Venus,"]
SHARED = "You are a helpful assistant. Answer in one short sentence, plainly and without lists. "
PREFIXED = [SHARED + q for q in ("What is the sun?", "What is rain?", "Why is the sea salty?", "What is a cat?")]


def test_tp3_equals_tp1_plain_lookahead_and_draft_model(engine_f32, generate):
    plain = generate(engine_f32, PROMPTS, greedy(32))
    engine = new_engine(tensor_parallel_size=3, adaptive_speculation=False, speculator="draft",
                        draft_model=DEFAULT_MODEL, draft_device="cpu", draft_dtype="float32",
                        num_speculative_tokens=3)
    workers = list(engine.runner.workers.values())
    try:
        assert len(workers) == 2 and all(w.is_alive() for w in workers)
        assert generate(engine, PROMPTS, greedy(32, speculator="none")) == plain
        for speculator in ("lookahead", "draft"):
            drafted, accepted = engine.stats.num_draft_tokens, engine.stats.num_accepted_tokens
            assert generate(engine, PROMPTS, greedy(32, speculator=speculator)) == plain, speculator
            assert engine.stats.num_draft_tokens > drafted and engine.stats.num_accepted_tokens > accepted
    finally:
        engine.close()
    assert not any(w.is_alive() for w in workers)


def test_tp3_with_the_files_quantized_weights_equals_tp1(generate):
    """--quantization auto under TP on a CPU: every rank loads the GGUF's int4/int8 layers and
    keeps its blocks of them. In float32 they are dequantized at load to the values the
    kernels would use (the Q8_0 layer requantized per channel, so not engine_f32's weights),
    so the tokens are those of the single-process engine with the same quantization."""
    single = new_engine(quantization="auto")
    try:
        expected = generate(single, PROMPTS[:2], greedy(24))
    finally:
        single.close()
    engine = new_engine(tensor_parallel_size=3, quantization="auto")
    try:
        assert "int4" in linear_kernels(engine.model)
        assert generate(engine, PROMPTS[:2], greedy(24)) == expected
    finally:
        engine.close()


@pytest.fixture(scope="module", params=["llama3", "qwen2", "mistral"])
def tiny_dir(request, engine_f32, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"tp-{request.param}")
    save_tiny_model(request.param, directory, engine_f32.tokenizer)
    return str(directory)


def test_tiny_models_tp2_equal_tp1_with_prefix_caching_and_preemption(tiny_dir, generate):
    """64 greedy tokens each; the second round reuses cached prefixes; a KV cache of 16
    blocks of 16 tokens cannot hold the four sequences at once, so some are preempted."""
    params = greedy(64)
    outputs = {}
    for tp in (1, 2):
        engine = new_engine(model=tiny_dir, tensor_parallel_size=tp, kv_cache_memory=kv_bytes(tiny_dir, tp))
        try:
            outputs[tp] = [generate(engine, PREFIXED, params), generate(engine, PREFIXED, params)]
            assert engine.stats.num_cached_prompt_tokens > 0
            assert engine.stats.num_preemptions > 0
        finally:
            engine.close()
    assert outputs[2] == outputs[1]


def kv_bytes(model_dir: str, tp: int, blocks: int = 16) -> int:
    """The KV memory that holds `blocks` blocks of 16 tokens on each of `tp` ranks."""
    config = json.load(open(os.path.join(model_dir, "config.json")))
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] // tp * 16 * 4  # K and V, fp32
    return blocks * 16 * per_token


@pytest.mark.parametrize("tiny_dir", ["qwen2"], indirect=True)
def test_two_nodes_on_localhost_equal_tp1(tiny_dir, generate):
    """Node 1 is `python -m runtime.serve --nnodes 2 --node-rank 1 ...` (it runs its rank only,
    no server); node 0 is the engine here. One rank per node."""
    reference = new_engine(model=tiny_dir)
    try:
        expected = generate(reference, PROMPTS, greedy(32))
    finally:
        reference.close()
    port = free_port()
    node1 = subprocess.Popen([sys.executable, "-m", "runtime.serve", "--model", tiny_dir, "--dtype", "float32",
                              "--device", "cpu", "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1",
                              "--master-addr", "127.0.0.1", "--master-port", str(port)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        engine = new_engine(model=tiny_dir, tensor_parallel_size=2, nnodes=2, node_rank=0, master_port=port)
        try:
            assert engine.runner.workers == {}  # rank 1 is the other node's
            assert generate(engine, PROMPTS, greedy(32)) == expected
        finally:
            engine.close()
        output, _ = node1.communicate(timeout=60)
        assert node1.returncode == 0, output
    finally:
        if node1.poll() is None:
            node1.kill()


@pytest.mark.parametrize("tiny_dir", ["llama3"], indirect=True)
def test_torchrun_ranks_equal_tp1(tiny_dir, tmp_path, generate):
    """`torchrun --nproc-per-node 2 -m runtime.generate`: rank 0 writes the outputs, rank 1 runs
    its shard; no --tensor-parallel-size needed (WORLD_SIZE says it)."""
    reference = new_engine(model=tiny_dir)
    try:
        expected = generate(reference, PROMPTS, greedy(16))
    finally:
        reference.close()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "out.jsonl"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    run = subprocess.run([torchrun, "--nproc-per-node", "2", "--master-port", str(free_port()), "-m",
                          "runtime.generate", "--model", tiny_dir, "--dtype", "float32", "--device", "cpu",
                          "--input", str(prompts), "--output", str(out), "--max-tokens", "16", "--temperature",
                          "0", "--quantization", "none", "--enforce-eager"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["token_ids"] for line in lines] == expected


def test_bad_tensor_parallel_settings_are_refused(monkeypatch):
    EngineConfig(tensor_parallel_size=2, quantization="int8")  # a CPU target splits quantized weights
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="int8"):  # on CUDA, float weights only for now
        EngineConfig(tensor_parallel_size=2, quantization="int8", device="cuda")
    monkeypatch.undo()
    with pytest.raises(ValueError, match=">= 1"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="multiple of --nnodes"):
        EngineConfig(tensor_parallel_size=3, nnodes=2)
    with pytest.raises(ValueError, match="--node-rank"):
        EngineConfig(tensor_parallel_size=2, nnodes=2, node_rank=2)
    with pytest.raises(ValueError, match="--worker-timeout"):
        EngineConfig(tensor_parallel_size=2, worker_timeout=0)
    with pytest.raises(ValueError, match="9 attention heads, 3 KV heads"):
        new_engine(tensor_parallel_size=2)


def test_launch_from_flags_and_from_torchruns_environment():
    assert TPLaunch.of(1) is None
    two_nodes = TPLaunch.of(4, nnodes=2, node_rank=1, master_addr="10.0.0.1")
    assert (two_nodes.rank, two_nodes.spawned, two_nodes.init_method) == (2, [(3, 1)], "tcp://10.0.0.1:29500")
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1234"}
    torchrun = TPLaunch.of(1, environ=env)
    assert (torchrun.world_size, torchrun.rank, torchrun.local_rank, torchrun.spawned) == (2, 1, 1, [])
    with pytest.raises(ValueError, match="torchrun started 2"):
        TPLaunch.of(4, environ=env)


@pytest.mark.parametrize("tiny_dir", ["llama3"], indirect=True)
def test_ranks_pinned_to_their_own_cores_and_released(tiny_dir):
    """Two ranks on two or more cores: the worker on its share, the engine's process on the
    first (with the remainder); close() gives this process its cores back."""
    from draft_cpu.placement import available_cores, split_cores
    cores = available_cores()
    if len(cores) < 2:
        pytest.skip("needs 2 cores")
    shares = split_cores(cores, 2)
    engine = new_engine(model=tiny_dir, tensor_parallel_size=2)
    try:
        worker = engine.runner.workers[1]
        assert sorted(os.sched_getaffinity(worker.pid)) == shares[1]
        assert available_cores() == shares[0]
    finally:
        engine.close()
    assert available_cores() == cores


def test_split_cores():
    from draft_cpu.placement import split_cores
    assert split_cores(list(range(8)), 3) == [[0, 1, 2, 3], [4, 5], [6, 7]]
    assert split_cores(list(range(8)), 2, reserved=[6, 7]) == [[0, 1, 2], [3, 4, 5]]
    assert split_cores([0, 1], 3) is None


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_on_two_gpus_equals_tp1(generate):
    """The CUDA path (rank i on cuda:i, activations over NCCL) on a tiny model: 32 greedy
    tokens equal to one GPU's, float32 (scripts/device_check.sh runs it on a multi-GPU box,
    where the default model's tokenizer comes with HETEROSPEC_CUDA_MODEL)."""
    import os
    import tempfile
    from runtime.models.loader import DEFAULT_MODEL, load_tokenizer, resolve_model
    tokenizer = load_tokenizer(resolve_model(os.environ.get("HETEROSPEC_CUDA_MODEL") or DEFAULT_MODEL))
    with tempfile.TemporaryDirectory() as directory:
        save_tiny_model("qwen2", directory, tokenizer)
        outputs = {}
        for tp in (1, 2):
            engine = new_engine(model=directory, device="cuda", tensor_parallel_size=tp, kv_cache_memory="64MiB")
            try:
                outputs[tp] = generate(engine, PROMPTS, greedy(32))
            finally:
                engine.close()
    assert outputs[2] == outputs[1]
