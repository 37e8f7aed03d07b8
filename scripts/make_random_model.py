"""Write a randomly initialised model of a known shape as an HF-format directory, for timing.

The GPU box has no internet and weights must travel in a 64 MiB working tree, so models of
the Qwen2.5-Coder 1.5B and 0.5B shapes and of the default model's (SmolLM2-135M) are made
where they run: config.json, random weights in model.safetensors (normal, std 0.02; norms 1)
and a tokenizer, all loadable by runtime.models.loader (and HF transformers) like any HF
model. The tokenizer is a saved one copied from --tokenizer DIR (the default model's shape
needs it: scripts/device_check.sh carries the default model's), or for the Qwen shapes a
byte-level one of the model's vocabulary size (the 256 bytes, Qwen's special tokens at their
ids, "<tN>" for the rest, no merges: transformers 5 reads it as the Qwen2 tokenizer its
config names, 4.x as a plain fast tokenizer, and both encode and decode alike).
The text such a model writes is noise; only its costs (ms per forward, tok/s at fixed
speculation) and its agreement with another implementation on the same weights mean anything.

    .venv/bin/python scripts/make_random_model.py --shape qwen2.5-0.5b --out /tmp/qwen05-random
    .venv/bin/python scripts/make_random_model.py --shape smollm2-135m --tokenizer DIR --out /tmp/smollm2-random
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

# the HF config.json fields of each shape (the published models' own values), over QWEN2_COMMON
SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, tie_word_embeddings=True),
    "smollm2-135m": dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0,
                         max_position_embeddings=8192, attention_bias=False, bos_token_id=1, eos_token_id=2),
}
QWEN2_COMMON = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=151936, rms_norm_eps=1e-6,
                    rope_theta=1000000.0, max_position_embeddings=32768, hidden_act="silu", eos_token_id=151645,
                    bos_token_id=151643, torch_dtype="bfloat16")


def hf_config(shape: str) -> dict:
    return {**QWEN2_COMMON, **SHAPES[shape]}


def random_weights(cfg: dict, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """HF-named tensors of a Qwen2 or Llama model of config `cfg`, random normal (std 0.02), norms 1."""
    gen = torch.Generator().manual_seed(seed)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head_dim = h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim

    def normal(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(dtype)

    weights = {"model.embed_tokens.weight": normal(v, h), "model.norm.weight": torch.ones(h, dtype=dtype)}
    if not cfg["tie_word_embeddings"]:
        weights["lm_head.weight"] = normal(v, h)
    biases = cfg["model_type"] == "qwen2"  # q/k/v biases
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "self_attn.q_proj.weight": normal(q, h), p + "self_attn.k_proj.weight": normal(kv, h),
            p + "self_attn.v_proj.weight": normal(kv, h), p + "self_attn.o_proj.weight": normal(h, q),
            p + "mlp.gate_proj.weight": normal(inter, h), p + "mlp.up_proj.weight": normal(inter, h),
            p + "mlp.down_proj.weight": normal(h, inter),
        })
        if biases:
            weights.update({f"{p}self_attn.{x}_proj.bias": normal(n) for x, n in (("q", q), ("k", kv), ("v", kv))})
    return weights


QWEN2_SPECIAL_TOKENS = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}


def write_tokenizer(out: Path, vocab_size: int) -> None:
    """A byte-level BPE without merges: text encodes to one token per byte (ids 0..255),
    Qwen's special tokens sit at their ids, and every other id is "<tN>"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    byte_symbols = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 bytes as printable characters
    vocab = {symbol: i for i, symbol in enumerate(byte_symbols)}
    vocab.update({QWEN2_SPECIAL_TOKENS.get(i, f"<t{i}>"): i for i in range(len(byte_symbols), vocab_size)})
    tokenizer = Tokenizer(models.BPE(vocab, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "model_max_length": 32768}))


def copy_tokenizer(source: Path, out: Path, vocab_size: int) -> None:
    """A saved tokenizer's files (tokenizer.json, its configs, a chat template) into out."""
    files = [f for f in source.iterdir() if f.is_file() and (f.suffix in (".json", ".jinja", ".txt"))]
    if not (source / "tokenizer.json").is_file():
        raise ValueError(f"--tokenizer {source}: no saved tokenizer there (tokenizer.json)")
    for f in files:
        if f.name != "config.json":
            shutil.copyfile(f, out / f.name)
    size = len(json.loads((out / "tokenizer.json").read_text())["model"]["vocab"])
    if size > vocab_size:
        raise ValueError(f"--tokenizer {source}: {size} tokens, more than the shape's vocabulary of {vocab_size}")


def make_random_model(shape: str, out: str | Path, dtype: str = "bfloat16", seed: int = 0,
                      tokenizer: str | Path | None = None) -> Path:
    from safetensors.torch import save_file
    out = Path(out)
    cfg = hf_config(shape)
    if tokenizer is None and cfg["model_type"] != "qwen2":
        raise ValueError(f"shape {shape} needs --tokenizer DIR (a saved tokenizer of its vocabulary)")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(random_weights(cfg, getattr(torch, dtype), seed), str(out / "model.safetensors"))
    if tokenizer is None:
        write_tokenizer(out, cfg["vocab_size"])
    else:
        copy_tokenizer(Path(tokenizer), out, cfg["vocab_size"])
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", help="a saved tokenizer's directory to copy (default, Qwen shapes only: a byte-level "
                                       "one)")
    args = p.parse_args(argv)
    print(make_random_model(args.shape, args.out, args.dtype, args.seed, args.tokenizer))


if __name__ == "__main__":
    main()
