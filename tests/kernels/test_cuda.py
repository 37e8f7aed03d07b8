"""The target on a CUDA GPU, end to end (skipped without one; run by scripts/device_check.sh):
the default model (or HETEROSPEC_CUDA_MODEL: the GPU check's random-weight model of its
shape, since the GGUF cannot travel there) through the Triton attention backend and CUDA
graphs against HF transformers on the same GPU (float32 greedy, token for token), graphs
against eager steps, speculation against plain decoding, structured output under
speculation (grammar masks filled while the GPU runs) and the int4 kernels against the
CPU's. Kernel-level checks against the PyTorch reference, bf16 included, are in
tests/kernels/test_triton_attention.py.
"""
from __future__ import annotations

import os

import pytest
import torch
from tests.helpers import greedy
from runtime.models.loader import DEFAULT_MODEL

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
MODEL = os.environ.get("HETEROSPEC_CUDA_MODEL") or DEFAULT_MODEL

NUM_TOKENS = 32
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a young girl who loved to read books about "
    "dragons, knights and the old kings of the north. One day she",
    "1, 2, 3, 4,",
]


def f32_llm(**kwargs):
    """MODEL on the GPU in float32 (unquantized: HF's weights), with any other settings."""
    from runtime import LLM
    return LLM(model=MODEL, device="cuda", dtype="float32", kv_cache_memory="1GiB", max_num_seqs=8,
               quantization="none", **kwargs)


def outputs(llm) -> list[list[int]]:
    return [r.token_ids for r in llm.generate(PROMPTS, greedy(NUM_TOKENS), use_tqdm=False)]


@pytest.fixture(scope="module")
def graphs_f32():
    llm = f32_llm()
    assert llm.engine.runner.attention.name == "triton" and llm.engine.runner.graphs is not None
    return llm


@pytest.fixture(scope="module")
def hf_cuda_greedy(graphs_f32):
    """HF transformers' greedy continuation of every prompt, float32 on the GPU."""
    from scripts.harness import load_hf
    model = load_hf(MODEL, torch.float32, "cuda")
    refs = []
    for prompt in PROMPTS:
        ids = torch.tensor([graphs_f32.engine.tokenize(prompt)], device="cuda")
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_TOKENS,
                             min_new_tokens=NUM_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
        refs.append(out[0, ids.shape[1]:].tolist())
    return refs


def test_triton_and_graphs_greedy_equals_hf_on_the_gpu(graphs_f32, hf_cuda_greedy):
    steps_before = graphs_f32.engine.stats.num_steps
    assert outputs(graphs_f32) == hf_cuda_greedy
    assert graphs_f32.engine.stats.num_steps > steps_before


def test_one_request_at_a_time_equals_hf(graphs_f32, hf_cuda_greedy):
    for prompt, ref in zip(PROMPTS, hf_cuda_greedy):
        assert graphs_f32.generate([prompt], greedy(NUM_TOKENS), use_tqdm=False)[0].token_ids == ref


def test_graph_steps_equal_eager_steps(graphs_f32):
    eager = f32_llm(enforce_eager=True)
    assert eager.engine.runner.graphs is None
    assert outputs(eager) == outputs(graphs_f32)


@pytest.mark.parametrize("speculator", ["ngram", "lookahead"])
def test_speculation_on_graphs_equals_plain(graphs_f32, hf_cuda_greedy, speculator):
    llm = f32_llm(speculator=speculator, adaptive_speculation=False)
    assert outputs(llm) == hf_cuda_greedy
    assert llm.engine.stats.num_draft_tokens > 0


def test_structured_output_with_speculation_on_the_gpu(graphs_f32):
    """A JSON schema on the GPU: the masks filled on the grammar thread while the target runs,
    written by xgrammar's kernel for the device; speculation (with the grammar's forced
    text) keeps plain decoding's output, and the output is the schema's."""
    pytest.importorskip("xgrammar")
    import json
    from runtime import GuidedSpec, SamplingParams
    # enums: every output is short and complete, whatever the weights (a random model's string never ends)
    schema = {"type": "object", "properties": {"job": {"enum": ["nurse", "teacher", "pilot"]},
                                               "city": {"enum": ["Madrid", "Paris", "Rome"]}},
              "required": ["job", "city"], "additionalProperties": False}
    prompt = [{"role": "user", "content": "Extract the person as JSON: Maria Lopez, 34, is a nurse in Madrid."}]
    plain, spec = [graphs_f32.generate([prompt], SamplingParams(temperature=0, max_tokens=60, speculator=s,
                                                                guided=GuidedSpec("json", schema)), use_tqdm=False)[0]
                   for s in ("none", "lookahead")]
    assert spec.text == plain.text and spec.metrics.num_forced_draft_tokens > 0, (plain.text, spec.text)
    assert set(json.loads(plain.text)) == {"job", "city"}


def prompt_logits(engine) -> torch.Tensor:
    """The logits [1, V] after one prefill of the long prompt, on the CPU, in float32."""
    from runtime.sequence import Sequence
    seq = Sequence("x", engine.tokenize(PROMPTS[2]), greedy(NUM_TOKENS))
    engine.block_manager.may_append(seq, len(seq.token_ids))
    logits = engine.runner.execute([seq], [len(seq.token_ids)], [True]).float().cpu()
    engine.block_manager.free(seq)
    return logits


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours - reference).abs().max() / reference.abs().max())


def test_bf16_triton_logits_close_to_the_torch_backend():
    """One prefill of the model in bf16: Triton and the reference agree."""
    from runtime.engine import LLMEngine
    triton, reference = (prompt_logits(LLMEngine(model=MODEL, device="cuda", dtype="bfloat16",
                                                 kv_cache_memory="512MiB", attention_backend=backend,
                                                 enforce_eager=True))
                         for backend in ("triton", "torch"))
    assert relative_error(triton, reference) < 2e-2


@pytest.mark.parametrize("draft_device", ["cuda", "cpu"])
def test_eagle3_head_on_graphs_equals_plain(graphs_f32, hf_cuda_greedy, tmp_path, draft_device):
    """A random EAGLE-3 head (target feature layers through the captured graphs) on the GPU
    or the host: the output is HF's greedy one."""
    from speculators.eagle_heads import new_eagle3_head, save_head
    model = graphs_f32.engine.model
    torch.manual_seed(0)
    head = new_eagle3_head(model.config, model.embed_tokens, torch.arange(0, model.config.vocab_size, 3))
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.02)
    path = save_head(head.cpu(), tmp_path / "eagle3")
    llm = f32_llm(speculator="eagle", eagle_head=str(path), draft_device=draft_device, adaptive_speculation=False)
    assert llm.engine.runner.feature_layers == head.feature_layers and llm.engine.runner.graphs is not None
    assert outputs(llm) == hf_cuda_greedy
    assert llm.engine.stats.num_draft_tokens > 0


def test_int4_layers_run_tinygemm_on_the_gpu():
    """Int4Linear on CUDA (aten._weight_int4pack_mm, bf16) computes the weight its kernel
    describes, (q - 8) s + z with s, z in bf16, as the CPU kernel does."""
    from runtime.models.quant_linear import Int4Linear
    from runtime.models.quantized_weight import quantize_int4
    weight = quantize_int4(torch.randn(256, 576), "test")
    cuda_layer = Int4Linear(weight, None, torch.bfloat16, torch.device("cuda"))
    cpu_layer = Int4Linear(weight, None, torch.bfloat16, torch.device("cpu"))
    assert "tinygemm" in cuda_layer.kernel
    x = torch.randn(5, 576, dtype=torch.bfloat16)
    torch.testing.assert_close(cuda_layer(x.cuda()).float().cpu(), cpu_layer(x).float(), atol=0.05, rtol=0.02)


def test_int4_model_on_the_gpu_computes_what_the_cpu_does():
    """--quantization int4 in bf16: the GPU's int4 kernels (tinygemm, under CUDA graphs)
    give the CPU's logits for a prompt, within bf16's error, and decode."""
    from runtime import LLM
    gpu = LLM(model=MODEL, device="cuda", dtype="bfloat16", kv_cache_memory="1GiB", max_num_seqs=8,
              quantization="int4")
    assert "tinygemm" in gpu.engine.model.layers[0].mlp.down_proj.kernel
    cpu = LLM(model=MODEL, enforce_eager=True, device="cpu", dtype="bfloat16", kv_cache_memory="256MiB",
              max_num_seqs=8, quantization="int4")
    assert relative_error(prompt_logits(gpu.engine), prompt_logits(cpu.engine)) < 3e-2
    assert all(len(tokens) == NUM_TOKENS for tokens in outputs(gpu))
