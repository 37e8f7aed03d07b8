"""The draft-model proposer and its CPU worker (draft_cpu/), on the default model.

- Greedy lossless: with (a) the target itself as the draft (nearly every draft accepted)
  and (b) a tiny random model with the target's vocabulary (nearly every draft rejected),
  batched output equals `--speculator none` token for token (float32 target). The same
  with an int8 draft, and with IPEX's bf16 draft when IPEX imports.
- Rollback: after random accept lengths, the draft cache gives the logits of a fresh
  prefill of the committed tokens.
- Placement: the worker thread's affinity and OpenMP thread count are what was asked and
  the rest of the process is moved off those cores (in a subprocess: it pins threads).
- AMX: oneDNN's verbose log of a bf16 draft forward names an AMX kernel.
- A draft worker that raises mid-run: requests complete as without speculation, and the
  error is logged.
- Trees: chain plus siblings ranked by draft path probability, parents first, budgets
  kept, draft_probs of sampled trees are the without-replacement distributions.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import run_to_completion
from runtime.platform import amx_available
from runtime.sampling_params import SamplingParams
from speculators.base import ProposalRequest
from tests.helpers import greedy

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [
    "Repeat this list exactly, once: apple, banana, cherry, date, elderberry, fig.\nList: apple,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):",
    "The capital of France is",
    "Write a short poem about the sea.",
]


@pytest.fixture(scope="module")
def tiny_draft_dir(tmp_path_factory, engine_f32):
    """A 2-layer random Llama in HF format with the default model's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM
    path = tmp_path_factory.mktemp("tiny-draft")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=engine_f32.model_config.vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(str(path), safe_serialization=True)
    engine_f32.tokenizer.save_pretrained(str(path))
    return path


def make_engine(draft_model: str, **kwargs):
    from runtime.engine import LLMEngine
    return LLMEngine(enforce_eager=True, dtype="float32", device="cpu", kv_cache_memory="256MiB", speculator="draft",
                     draft_model=draft_model, **kwargs)


@pytest.fixture(scope="module")
def self_draft_engine():
    # chains: a tree's siblings of a correct draft token are rejected by construction
    # and a fixed draft size: the draft is as dear as the target, so adaptive sizing would
    # (rightly) draft little; these tests are about the proposer and the worker
    engine = make_engine("smollm2-135m", draft_dtype="float32", draft_backend="torch", speculative_tree_width=1,
                         adaptive_speculation=False)
    yield engine
    engine.close()


def plain_outputs(engine, prompts, max_tokens=32):
    return run_to_completion(engine, prompts, greedy(max_tokens, speculator="none"))


def check_lossless(engine, prompts=PROMPTS, max_tokens=32):
    expected = plain_outputs(engine, prompts, max_tokens)
    before = engine.stats.num_draft_tokens, engine.stats.num_accepted_tokens
    got = run_to_completion(engine, prompts, greedy(max_tokens))
    assert got == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    drafted = engine.stats.num_draft_tokens - before[0]
    accepted = engine.stats.num_accepted_tokens - before[1]
    assert drafted > 0
    return accepted / drafted


def test_self_draft_is_lossless_and_accepted(self_draft_engine):
    rate = check_lossless(self_draft_engine)
    assert rate > 0.9, rate  # the draft is the target: only near-ties in other matrix shapes differ


@pytest.fixture(scope="module")
def overlapping():
    """A self-draft engine asked to draft ahead while the target verifies (sharing the
    cores, the draft then gets a thread of its own)."""
    engine = make_engine("smollm2-135m", draft_dtype="float32", draft_backend="torch", speculative_tree_width=1,
                         adaptive_speculation=False, draft_overlap="on")
    yield engine
    engine.close()


def worker_thread_id(engine) -> int:
    return engine.pool.get("draft").worker.submit(threading.get_native_id).result()


def test_a_draft_sharing_the_targets_cores_runs_on_the_engines_thread(self_draft_engine, overlapping):
    """Taking turns on the CPU, draft and target share the engine thread's OpenMP team
    (draft_cpu.placement); a draft asked to overlap has its own thread."""
    assert worker_thread_id(self_draft_engine) == threading.get_native_id()
    assert worker_thread_id(overlapping) != threading.get_native_id()


def test_drafting_ahead_is_lossless_and_overlaps(overlapping, monkeypatch):
    """Draft and target threads run at once (the worker's forwards intersect the target's
    verify windows: torch releases the GIL inside ops), tokens drafted ahead become the
    next step's chain, and the output is still plain decoding's.

    Here the draft is the target itself, as slow as verification; a real draft is several
    times faster. So verification is slowed down to leave the draft time for the two
    forwards ahead that a head start takes (the first one only yields the token that must
    match the target's bonus token)."""
    engine = overlapping
    proposer = engine.pool.get("draft")
    execute = engine.runner.execute

    def slow_execute(*args, **kwargs):
        out = execute(*args, **kwargs)
        time.sleep(0.3)
        return out

    monkeypatch.setattr(engine.runner, "execute", slow_execute)
    before = (proposer.num_ahead_tokens, proposer.num_ahead_used, engine.stats.overlap_seconds)
    rate = check_lossless(engine)
    assert rate > 0.9, rate
    assert proposer.num_ahead_tokens > before[0]
    assert proposer.num_ahead_used > before[1]  # the draft agreed with the bonus token, so its lead was kept
    assert engine.stats.overlap_seconds > before[2]
    timing = engine.stats.timeline[-1]
    assert timing.wall >= timing.verify and timing.idle >= 0


def test_drafting_ahead_with_sampling_and_rejections(overlapping):
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=5)
    outputs = run_to_completion(overlapping, PROMPTS[:3], params)
    assert all(len(t) == 24 for t in outputs)
    assert overlapping.block_manager.num_free_blocks == overlapping.block_manager.num_blocks


def test_random_draft_is_lossless_and_rejected(tiny_draft_dir):
    engine = make_engine(str(tiny_draft_dir), adaptive_speculation=False, num_speculative_tokens=4,
                         draft_overlap="on")
    try:
        rate = check_lossless(engine)
    finally:
        engine.close()
    assert rate < 0.2, rate


def test_int8_draft_is_lossless():
    engine = make_engine("smollm2-135m", draft_dtype="float32", draft_backend="torch", draft_quantization="int8")
    try:
        rate = check_lossless(engine, PROMPTS[:2])
    finally:
        engine.close()
    assert rate > 0.5, rate


def test_ipex_bf16_draft_is_lossless():
    from draft_cpu.backends import import_ipex
    if import_ipex() is None:
        pytest.skip("intel_extension_for_pytorch does not import here")
    engine = make_engine("smollm2-135m", draft_dtype="bfloat16", draft_backend="ipex")
    try:
        assert engine.pool.get("draft").worker.backend == "ipex"
        rate = check_lossless(engine, PROMPTS[:2])
    finally:
        engine.close()
    assert rate > 0.5, rate


def test_sampled_requests_are_reproducible_with_fixed_drafts(self_draft_engine):
    """Seeded sampling with draft probabilities: the same drafts give the same tokens (with
    adaptive sizing the tree shapes, and so the number of draws, follow measured costs; the
    law of the output is the target's either way, tests/unit/test_rejection_sampler.py)."""
    engine = self_draft_engine  # fixed draft sizes
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, ignore_eos=True, seed=3)
    first = run_to_completion(engine, PROMPTS[:2], params)
    again = run_to_completion(engine, PROMPTS[:2], params)
    assert first == again
    assert all(len(t) == 24 for t in first)


def test_failing_worker_degrades_to_plain_decoding(self_draft_engine, caplog, monkeypatch):
    worker = self_draft_engine.pool.get("draft").worker
    calls = {"n": 0}
    real_forward = worker.forward

    def flaky_forward(seqs):
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("draft worker exploded")
        return real_forward(seqs)

    expected = plain_outputs(self_draft_engine, PROMPTS[:2], 20)
    monkeypatch.setattr(worker, "forward", flaky_forward)
    with caplog.at_level(logging.ERROR, logger="runtime.engine"):
        got = run_to_completion(self_draft_engine, PROMPTS[:2], greedy(20))
    assert got == expected
    assert "draft worker exploded" in caplog.text
    assert self_draft_engine.block_manager.num_free_blocks == self_draft_engine.block_manager.num_blocks


# ---- the worker ---------------------------------------------------------------------------------

def test_rollback_matches_fresh_prefill(self_draft_engine):
    worker = self_draft_engine.pool.get("draft").worker
    rng = torch.Generator().manual_seed(0)
    prompt = self_draft_engine.tokenize(PROMPTS[1])
    vocab = self_draft_engine.model_config.vocab_size

    def run(request_id, token_ids):
        def job():
            seq = worker.sync(request_id, token_ids)
            return worker.forward([seq])[0]
        return worker.submit(job).result()

    committed = list(prompt)
    run("rb", committed)
    for _ in range(6):
        drafts = torch.randint(0, vocab, (int(torch.randint(1, 6, (1,), generator=rng)),), generator=rng).tolist()
        for token in drafts:  # the draft runs its chain; positions past the accepted ones become stale
            worker.submit(lambda t=token: (worker.sequences["rb"].token_ids.append(t),
                                           worker.forward([worker.sequences["rb"]]))).result()
        accepted = int(torch.randint(0, len(drafts) + 1, (1,), generator=rng))
        committed = committed + drafts[:accepted] + [int(torch.randint(0, vocab, (1,), generator=rng))]
        kept = run("rb", committed)
        fresh = run("fresh", committed)
        worker.submit(worker.release, "fresh").result()
        torch.testing.assert_close(kept, fresh, atol=1e-4, rtol=1e-4)
    worker.submit(worker.release, "rb").result()
    assert worker.block_manager.num_free_blocks == worker.block_manager.num_blocks


def test_int8_linear_is_close_to_float():
    from draft_cpu.backends import int8_linear
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 128, bias=True)
    x = torch.randn(5, 256)
    error = (int8_linear(linear)(x) - linear(x)).norm() / linear(x).norm()
    assert error < 0.01, error
    x16 = x.bfloat16()
    linear16 = linear.bfloat16()
    error16 = (int8_linear(linear16)(x16).float() - linear16(x16).float()).norm() / linear16(x16).float().norm()
    assert error16 < 0.02, error16


def test_core_lists():
    from draft_cpu.placement import available_cores, format_core_list, parse_core_list
    cores = available_cores()
    assert parse_core_list(format_core_list(cores)) == cores
    assert format_core_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    for bad in ("x", "3-1", "0,,1", "-1"):
        with pytest.raises(ValueError):
            parse_core_list(bad)
    with pytest.raises(ValueError, match="not available"):
        parse_core_list(str(max(cores) + 1000))


_PLACEMENT_SCRIPT = textwrap.dedent("""
    import json, os, sys, threading
    import torch
    from draft_cpu.worker import DraftWorker, DraftWorkerConfig
    draft_cores = [int(c) for c in sys.argv[2].split(",")]
    worker = DraftWorker(DraftWorkerConfig(sys.argv[1], cpu_cores=draft_cores, num_kv_tokens=256))
    affinity, threads = worker.placement()
    others = {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")
              if int(t) != worker._thread_id}
    worker.close()
    after = []
    for t in os.listdir("/proc/self/task"):
        try:
            after.append(sorted(os.sched_getaffinity(int(t))))
        except OSError:  # a thread that has just ended
            pass
    print(json.dumps({"affinity": sorted(affinity), "threads": threads, "main_threads": torch.get_num_threads(),
                      "target_cores": worker.target_cores, "others": list(others.values()), "after_close": after}))
""")


def test_placement_pins_worker_and_moves_the_rest(tiny_draft_dir):
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    draft_cores = cores[-1:]
    out = subprocess.run([sys.executable, "-c", _PLACEMENT_SCRIPT, str(tiny_draft_dir),
                          ",".join(map(str, draft_cores))], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["affinity"] == draft_cores and got["threads"] == len(draft_cores)
    rest = [c for c in cores if c not in draft_cores]
    assert got["target_cores"] == rest
    assert all(set(a) <= set(rest) for a in got["others"]), got["others"]
    assert all(a == cores for a in got["after_close"]), got["after_close"]  # the process has its cores back


_ENGINE_PLACEMENT_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    from runtime.engine import LLMEngine
    before = torch.get_num_threads()
    engine = LLMEngine(enforce_eager=True, dtype="float32", device="cpu", kv_cache_memory="64MiB",
                       speculator="draft", draft_model=sys.argv[1], draft_cpu_cores=sys.argv[2])
    during = (torch.get_num_threads(), sorted(os.sched_getaffinity(0)))
    engine.close()
    print(json.dumps({"before": before, "during": during, "after": torch.get_num_threads(),
                      "affinity_after": sorted(os.sched_getaffinity(0))}))
""")


def test_closing_a_pinned_draft_gives_the_engine_its_cores_back(tiny_draft_dir):
    """A draft on cores of its own narrows the engine thread's cores and OpenMP team; closing
    it (LLM.close, update_speculation) widens them again, so a later draft or a plain target
    does not run on what was left."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    out = subprocess.run([sys.executable, "-c", _ENGINE_PLACEMENT_SCRIPT, str(tiny_draft_dir), str(cores[-1])],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["during"] == [len(cores) - 1, cores[:-1]], got
    assert got["after"] == got["before"] and got["affinity_after"] == cores, got


def test_a_draft_kv_pool_is_capped_by_free_memory(tiny_draft_dir, monkeypatch, caplog):
    """The draft's pool mirrors the target's, which on a GPU is most of its memory; on the
    draft's device it takes at most its share of free memory, says so, and a batch too big
    for it still decodes as without speculation (sequences past it get no drafts)."""
    import target_gpu.kv_cache as kv_cache
    from draft_cpu.worker import DraftWorker, DraftWorkerConfig
    small = DraftWorkerConfig(str(tiny_draft_dir), own_thread=False, num_kv_tokens=16, kv_memory_fraction=0.1)
    worker = DraftWorker(small)
    per_block = kv_cache.bytes_per_block(worker.model_config, small.block_size, worker.model.dtype)
    worker.close()
    config = dataclasses.replace(small, num_kv_tokens=10**6)
    monkeypatch.setattr(kv_cache, "free_memory_bytes", lambda device: 10 * 6 * per_block)  # 0.1 of it: 6 blocks
    with caplog.at_level(logging.INFO, logger="target_gpu.kv_cache"):
        worker = DraftWorker(config)
    assert worker.block_manager.num_blocks == 6
    assert "sequences past them are not drafted for" in caplog.text
    worker.close()
    engine = make_engine(str(tiny_draft_dir), adaptive_speculation=False, num_speculative_tokens=4)
    try:
        assert engine.pool.get("draft").worker.block_manager.num_blocks == 6
        check_lossless(engine)  # 4 requests of about 3 blocks each: some get no drafts
    finally:
        engine.close()
    assert "failed" not in caplog.text  # no forward over-asked the pool (each fit alone, not all together)


_AMX_SCRIPT = textwrap.dedent("""
    import sys
    from draft_cpu.worker import DraftWorker, DraftWorkerConfig
    worker = DraftWorker(DraftWorkerConfig(sys.argv[1], dtype="bfloat16", backend="torch", num_kv_tokens=256))
    def job():
        seq = worker.sync("r", list(range(1, 40)))
        worker.forward([seq])
    worker.submit(job).result()
    worker.close()
""")


def test_bf16_draft_runs_on_amx(tiny_draft_dir):
    if not amx_available():
        pytest.skip("this CPU has no AMX")
    env = dict(os.environ, ONEDNN_VERBOSE="1")
    out = subprocess.run([sys.executable, "-c", _AMX_SCRIPT, str(tiny_draft_dir)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    kernels = [line for line in out.stdout.splitlines() if line.startswith("onednn_verbose") and ",exec," in line]
    assert kernels, "oneDNN ran nothing"
    assert any("amx" in line for line in kernels), kernels[:5]


# ---- configuration ----------------------------------------------------------------------------

def test_draft_settings_are_checked(tiny_draft_dir, tmp_path, engine_f32):
    from runtime.config import EngineConfig
    with pytest.raises(ValueError, match="--draft-model"):
        EngineConfig(speculator="draft")
    with pytest.raises(ValueError, match="draft_backend"):
        EngineConfig(draft_model="x", draft_backend="onnx")
    with pytest.raises(ValueError, match="draft_quantization"):
        EngineConfig(draft_model="x", draft_quantization="int3")
    with pytest.raises(ValueError, match="--draft-cpu-cores"):
        make_engine(str(tiny_draft_dir), draft_cpu_cores="0-x")
    # a draft with another vocabulary is refused at start
    other = tmp_path / "other-vocab"
    other.mkdir()
    for f in tiny_draft_dir.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    tokenizer = engine_f32.tokenizer.__class__.from_pretrained(str(tiny_draft_dir))
    tokenizer.add_tokens(["<not-in-the-target>"])
    tokenizer.save_pretrained(str(other))
    with pytest.raises(ValueError, match="vocabulary"):
        make_engine(str(other))


def test_per_request_draft_needs_a_draft_model(engine_f32):
    with pytest.raises(ValueError, match="draft"):
        engine_f32.add_request("hi", SamplingParams(speculator="draft"))


# ---- trees from the proposer (a scripted draft distribution) ----------------------------------------

class _ScriptedWorker:
    """Stands in for DraftWorker: every forward returns the same logits per row."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits  # [V]
        self.forwards = 0

    def submit(self, fn, *args):
        from concurrent.futures import Future
        future = Future()
        future.set_result(fn(*args))
        return future

    def sync(self, request_id, token_ids):
        from draft_cpu.worker import DraftSequence
        return DraftSequence(list(token_ids), len(token_ids) - 1)

    def can_run(self, seq):
        return True

    def fitting(self, seqs):
        return [True] * len(seqs)

    def truncate(self, seq, num_tokens):
        del seq.token_ids[num_tokens:]
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)

    def forward(self, seqs):
        self.forwards += 1
        for s in seqs:
            s.num_computed_tokens = len(s.token_ids)
        return self.logits.expand(len(seqs), -1).clone()


def _request(max_nodes, width, params):
    return ProposalRequest("r", [1, 2, 3], 3, max_nodes, width, params, None)


def test_tree_is_chain_plus_best_siblings():
    from speculators.draft import DraftModelProposer
    probs = torch.tensor([0.7, 0.2, 0.06, 0.04])
    worker = _ScriptedWorker(probs.log())
    proposer = DraftModelProposer(worker, 4, min_path_prob=0.3)
    tree, = proposer.propose([_request(6, 2, greedy())])
    # chain of token 0 with path probabilities 0.7, 0.49, 0.343, 0.24 (below 0.3: no deeper), siblings
    # (token 1) 0.2, 0.14, 0.098, 0.069: the best six are the chain and the first two siblings
    assert tree.token_ids == [0, 0, 0, 0, 1, 1] and tree.parents == [-1, 0, 1, 2, -1, 0]
    assert tree.draft_probs is None
    values = []
    for i, (token, parent) in enumerate(zip(tree.token_ids, tree.parents)):
        assert parent < i
        path = probs[token] * (values[parent] if parent >= 0 else 1.0)
        values.append(float(path))
    assert values == sorted(values, reverse=True)  # best-first, so any prefix is the best subtree
    assert worker.forwards == 4  # the chain stopped once its path probability fell below 0.3
    chain, = proposer.propose([_request(6, 1, greedy())])
    assert chain.is_chain


def test_sampled_tree_carries_without_replacement_probs():
    from speculators.draft import DraftModelProposer
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    proposer = DraftModelProposer(_ScriptedWorker(probs.log()), 4, min_path_prob=0.0, seed=0)
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=1)
    tree, = proposer.propose([_request(5, 3, params)])
    assert tree.draft_probs is not None and tree.draft_probs.shape == (len(tree), 4)
    for kids in tree.children():
        seen = []
        for child in kids:
            q = tree.draft_probs[child]
            torch.testing.assert_close(q.sum(), torch.tensor(1.0))
            assert all(float(q[t]) == 0.0 for t in seen)  # earlier siblings were drawn without replacement
            expected = probs.clone()
            expected[seen] = 0
            torch.testing.assert_close(q, expected / expected.sum())
            seen.append(tree.token_ids[child])


def test_int8_linear_runs_float_past_its_row_limit():
    from draft_cpu.backends import int8_linear
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=True)
    always_int8, limited = int8_linear(linear), int8_linear(linear, max_int8_rows=2)
    few, many = torch.randn(2, 64), torch.randn(3, 64)
    assert torch.equal(limited(few), always_int8(few))
    assert not torch.equal(always_int8(many), linear(many))  # int8 differs from float...
    assert torch.equal(limited(many), linear(many))  # ...and past the limit the float weight runs


def scripted_timer(int8_ms, float_ms):
    """A timer for int8_row_limit: its calls alternate int8, float at each row count."""
    costs = [c for pair in zip(int8_ms, float_ms) for c in pair]
    calls = []

    def timer(fn):
        calls.append(fn)
        return costs[len(calls) - 1]
    return timer, calls


def test_int8_row_limit_is_the_last_row_count_int8_wins_at():
    from draft_cpu.backends import ROW_LADDER, int8_row_limit
    linear = torch.nn.Linear(32, 16)
    timer, calls = scripted_timer([1, 1, 1, 3], [2, 2, 2, 2])
    assert int8_row_limit(linear, timer) == 4 and len(calls) == 8  # stops at the first loss
    assert int8_row_limit(linear, scripted_timer([3], [2])[0]) == 0
    assert int8_row_limit(linear, scripted_timer([1] * len(ROW_LADDER), [2] * len(ROW_LADDER))[0]) is None


def test_int8_quantization_times_each_layer_shape_once():
    from draft_cpu.backends import Int8Linear, quantize_int8_torch
    model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                                torch.nn.Linear(16, 16), torch.nn.Linear(32, 16))
    timed = []

    def timer(fn):
        timed.append(fn)
        return 1.0  # a tie: int8 loses at one row
    limits = quantize_int8_torch(model, timer)
    assert limits == {(32, 16): 0, (16, 16): 0} and len(timed) == 4
    assert all(isinstance(m, Int8Linear) and m.max_int8_rows == 0 for m in model if not isinstance(m, torch.nn.ReLU))
    x = torch.randn(1, 32)
    assert model[0].float_layer is not None and torch.equal(model[0](x), model[0].float_layer(x))
    assert torch.equal(model[0](x), torch.nn.functional.linear(x, model[0].float_layer.weight, model[0].bias))
