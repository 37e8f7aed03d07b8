"""Helpers the tests share (fixtures are in conftest.py)."""
from __future__ import annotations

import socket

import torch

from runtime.sampling_params import SamplingParams
from speculators.registry import Speculator, register


def greedy(max_tokens: int = 32, **kwargs) -> SamplingParams:
    """Greedy decoding of exactly max_tokens tokens (EOS ignored), with any other fields."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def run_to_completion(engine, prompts, params, max_steps: int = 100_000) -> list[list[int]]:
    """Add every prompt (with its SamplingParams, or one for all), step until all finish.

    Returns the output token ids of each prompt, in order. Whatever happens, the engine is
    left idle (unfinished requests are aborted), so a failing test cannot poison the next.
    """
    if not isinstance(params, (list, tuple)):
        params = [params] * len(prompts)
    ids = []
    finished: dict[str, list[int]] = {}
    try:
        ids.extend(engine.add_request(p, sp) for p, sp in zip(prompts, params))
        for _ in range(max_steps):
            if not engine.has_unfinished:
                break
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = list(out.token_ids)
        else:
            raise AssertionError(f"engine did not finish within {max_steps} steps")
    finally:
        for rid in ids:
            if rid not in finished:
                engine.abort(rid)
    return [finished[rid] for rid in ids]


def toy_speculator(name: str, proposer, num_speculative_tokens: int = 4, tree_width: int = 1) -> str:
    """Register a speculator whose proposer is the given object (replacing a toy of that
    name); a request asks for it by name. Returns the name."""
    register(Speculator(name, lambda config, target: proposer, num_speculative_tokens, tree_width), replace=True)
    return name


def new_engine(**settings):
    """A float32 CPU engine on the default model of its own (the session's engine_f32 is
    never reconfigured), eager, with these settings."""
    from runtime.engine import LLMEngine
    defaults = dict(enforce_eager=True, dtype="float32", device="cpu", kv_cache_memory="256MiB", quantization="none")
    return LLMEngine(**{**defaults, **settings})


# ---- tiny random HF-format models, loaded by our loader ---------------------------------------

def _randomize(model: torch.nn.Module) -> None:
    """HF initialises biases to 0 and norms to 1; give them values so that loading them matters."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
            elif "norm" in name:
                param.uniform_(0.5, 1.5)


def _tiny_config(kind: str, vocab_size: int):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.2, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    if kind == "qwen2":  # q/k/v bias, GQA 4/2, untied head, theta 1e6
        return Qwen2Config(**common, rope_theta=1e6, tie_word_embeddings=False)
    if kind == "llama3":  # llama3 rope scaling (low/medium/high frequencies all present at head_dim 16)
        return LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=True,
                           rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    if kind == "llama_linear":
        return LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False,
                           rope_scaling={"rope_type": "linear", "factor": 2.0})
    if kind == "mistral":
        return MistralConfig(**common, rope_theta=1e6, tie_word_embeddings=False, sliding_window=None)
    raise ValueError(kind)


def save_tiny_model(kind: str, directory, tokenizer, **overrides):
    """Build a tiny random HF model of `kind`, save it (safetensors) with `tokenizer`; return it."""
    from transformers import AutoModelForCausalLM
    config = _tiny_config(kind, len(tokenizer))
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    _randomize(model)
    model.eval().requires_grad_(False)
    model.save_pretrained(str(directory), safe_serialization=True)
    tokenizer.save_pretrained(str(directory))
    return model


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def save_random_medusa_heads(model, directory):
    """Medusa heads (3 heads, 1 layer each) with small random weights for `model`, saved; their directory."""
    from speculators.medusa import MedusaHeads, save_heads
    torch.manual_seed(3)
    cfg = model.config
    heads = MedusaHeads(cfg.hidden_size, cfg.vocab_size, 3, 1, model.lm_head)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return save_heads(heads, directory)
