"""The decoder and the loader against HF transformers, which nobody here wrote.

- SmolLM2-135M (the embedded GGUF, dequantized by us and by HF independently): logits
  through the paged KV cache (batched ragged prefill, decode, chunked prefill, mixed
  steps) within 1e-4 of HF's float32 logits; 64 greedy tokens identical to HF
  ``generate(do_sample=False)`` at batch size 1, batched, and with a tiny token budget.
- Tiny randomly initialised Qwen2 (q/k/v bias, GQA, untied head, theta 1e6), Llama
  (llama3 rope scaling, tied embeddings) and Mistral models saved as HF directories
  (config.json + safetensors + tokenizer) and loaded by our loader: the same checks.
- Loader errors name what was looked for.
"""
from __future__ import annotations

import json
from contextlib import contextmanager

import pytest
import torch

from runtime.sequence import Sequence
from tests.helpers import greedy, save_tiny_model

ATOL = 2e-4  # float32 logits of magnitude ~20: summation order alone moves them ~1e-4
NUM_GREEDY = 64

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a young girl who loved to read books about "
    "dragons, knights and the old kings of the north. One day she",
    "1, 2, 3, 4,",
]


def hf_greedy(hf_model, token_ids: list[int], num_tokens: int) -> list[int]:
    """HF generate(do_sample=False) for exactly num_tokens new tokens (EOS does not stop it)."""
    ids = torch.tensor([token_ids])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens,
                            min_new_tokens=num_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    new = out[0, len(token_ids):].tolist()
    assert len(new) == num_tokens
    return new


@torch.no_grad()
def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    """HF's logits at every position of token_ids: [L, V] (float32)."""
    return hf_model(torch.tensor([token_ids])).logits[0].float()


def first_difference(a: list[int], b: list[int]) -> int:
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@contextmanager
def sequences(engine, token_lists):
    """Sequences that hold blocks of `engine`'s pool while the block runs, freed afterwards."""
    assert not engine.has_unfinished
    seqs = [Sequence(f"logits-{i}", list(ids), greedy(NUM_GREEDY)) for i, ids in enumerate(token_lists)]
    try:
        yield seqs
    finally:
        for seq in seqs:
            engine.block_manager.free(seq)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def execute(engine, seqs, num_new: list[int]) -> torch.Tensor:
    """One runner step: seqs[i] runs its next num_new[i] tokens; logits of each chunk's last token."""
    for seq, n in zip(seqs, num_new):
        engine.block_manager.may_append(seq, n)
    logits = engine.runner.execute(seqs, num_new, [True] * len(seqs))
    for seq, n in zip(seqs, num_new):
        seq.num_computed_tokens += n
    return logits


def check_prefill_and_decode(engine, hf_model, prompts: list[list[int]], num_decode: int = 4) -> None:
    """Batched ragged prefill of all prompts, then num_decode batched decode steps fed with HF's
    greedy continuation; every step's logits within ATOL of HF's full-sequence forward."""
    continuations = [hf_greedy(hf_model, ids, num_decode) for ids in prompts]
    refs = [hf_logits(hf_model, ids + cont) for ids, cont in zip(prompts, continuations)]
    with sequences(engine, prompts) as seqs:
        logits = execute(engine, seqs, [len(ids) for ids in prompts])
        for i, ids in enumerate(prompts):
            torch.testing.assert_close(logits[i], refs[i][len(ids) - 1], atol=ATOL, rtol=0,
                                       msg=lambda m: f"prefill logits of prompt {i}: {m}")
        for step in range(num_decode):
            for seq, cont in zip(seqs, continuations):
                seq.token_ids.append(cont[step])
            logits = execute(engine, seqs, [1] * len(seqs))
            for i, ids in enumerate(prompts):
                torch.testing.assert_close(logits[i], refs[i][len(ids) + step], atol=ATOL, rtol=0,
                                           msg=lambda m: f"decode step {step} of prompt {i}: {m}")


# ---- SmolLM2 (the default model) against HF ------------------------------------------------

@pytest.fixture(scope="module")
def prompt_ids(engine_f32):
    return [engine_f32.tokenize(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_reference(hf_smollm, prompt_ids):
    """HF's greedy continuation of every prompt (computed once)."""
    return [hf_greedy(hf_smollm, ids, NUM_GREEDY) for ids in prompt_ids]


def test_prompt_lengths_cover_both_attention_paths(prompt_ids):
    from target_gpu.attention import MAX_BATCHED_QUERY_LEN
    lengths = [len(ids) for ids in prompt_ids]
    assert min(lengths) <= MAX_BATCHED_QUERY_LEN < max(lengths)


def test_prefill_and_decode_logits_match_hf(engine_f32, hf_smollm, prompt_ids):
    check_prefill_and_decode(engine_f32, hf_smollm, prompt_ids, num_decode=3)


def test_chunked_prefill_logits_match_hf_at_every_position(engine_f32, hf_smollm, prompt_ids):
    """One prompt run in chunks of 1, 2, 3, ... tokens, batched with another sequence that
    decodes meanwhile: the last logits of every chunk match HF's at that position."""
    long_ids, short_ids = prompt_ids[2], prompt_ids[0]
    ref_long, ref_short = hf_logits(hf_smollm, long_ids), hf_logits(hf_smollm, short_ids)
    with sequences(engine_f32, [long_ids, short_ids[:1]]) as (long_seq, short_seq):
        start, size = 0, 1
        while start < len(long_ids):
            n = min(size, len(long_ids) - start)
            runs_short = short_seq.num_computed_tokens < len(short_ids)
            if runs_short and short_seq.num_computed_tokens == short_seq.num_tokens:
                short_seq.token_ids.append(short_ids[short_seq.num_tokens])
            seqs, num_new = ([long_seq, short_seq], [n, 1]) if runs_short else ([long_seq], [n])
            logits = execute(engine_f32, seqs, num_new)
            start += n
            torch.testing.assert_close(logits[0], ref_long[start - 1], atol=ATOL, rtol=0)
            if runs_short:
                torch.testing.assert_close(logits[1], ref_short[short_seq.num_computed_tokens - 1], atol=ATOL, rtol=0)
            size += 1


def test_greedy_matches_hf_batch_size_1(engine_f32, generate, prompt_ids, hf_reference):
    for i in (0, 2):  # the shortest and the longest prompt, one at a time
        [ours] = generate(engine_f32, [prompt_ids[i]], greedy(NUM_GREEDY))
        assert ours == hf_reference[i], f"prompt {i}: first difference at token {first_difference(ours, hf_reference[i])}"


def test_greedy_matches_hf_batched(engine_f32, generate, prompt_ids, hf_reference):
    """All prompts (different lengths) in one engine at once, plus text prompts tokenized by the engine."""
    outputs = generate(engine_f32, prompt_ids + PROMPTS[:2], greedy(NUM_GREEDY))
    assert outputs == hf_reference + hf_reference[:2]
    assert engine_f32.block_manager.num_free_blocks == engine_f32.block_manager.num_blocks


def test_greedy_matches_hf_when_requests_arrive_while_others_decode(engine_f32, prompt_ids, hf_reference):
    """Continuous batching: prompts join at different steps (the long one while two others decode:
    a step of [1, 1, 36] tokens, which crashed the attention backend at bf8529a)."""
    engine, arrivals = engine_f32, {0: [0, 1], 3: [2], 8: [3]}  # step -> prompts added before it
    request_ids, outputs = {}, {}
    try:
        for step in range(10_000):
            for i in arrivals.get(step, []):
                request_ids[engine.add_request(prompt_ids[i], greedy(NUM_GREEDY))] = i
            if not engine.has_unfinished and len(request_ids) == len(prompt_ids):
                break
            for out in engine.step():
                if out.finished:
                    outputs[request_ids[out.request_id]] = out.token_ids
    finally:
        for rid, i in request_ids.items():
            if i not in outputs:
                engine.abort(rid)
    assert [outputs[i] for i in range(len(prompt_ids))] == hf_reference


def test_greedy_matches_hf_with_chunked_prefill(generate, prompt_ids, hf_reference):
    """A token budget of 8 splits every prompt into chunks that share steps with decodes."""
    from runtime.engine import LLMEngine
    engine = LLMEngine(enforce_eager=True, dtype="float32", device="cpu", kv_cache_memory="32MiB", max_num_batched_tokens=8,
                       quantization="none")
    outputs = generate(engine, prompt_ids, greedy(NUM_GREEDY))
    assert outputs == hf_reference
    assert engine.stats.num_steps >= NUM_GREEDY + max(len(ids) for ids in prompt_ids) // 8
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# ---- tiny HF-format models written here, loaded by our loader ------------------------------

TINY_KINDS = ["qwen2", "llama3", "llama_linear", "mistral"]


@pytest.fixture(scope="module", params=TINY_KINDS)
def tiny(request, engine_f32, tmp_path_factory):
    """(HF model, our engine on the same directory) for one tiny architecture."""
    from runtime.engine import LLMEngine
    directory = tmp_path_factory.mktemp(f"tiny-{request.param}")
    hf_model = save_tiny_model(request.param, directory, engine_f32.tokenizer)
    engine = LLMEngine(enforce_eager=True, model=str(directory), dtype="float32", device="cpu", kv_cache_memory="16MiB")
    return hf_model, engine


def test_tiny_config_read(tiny):
    hf_model, engine = tiny
    hc, mc = hf_model.config, engine.model_config
    assert mc.architecture == hc.model_type
    assert (mc.num_heads, mc.num_kv_heads, mc.head_dim) == (4, 2, 16)
    hf_rope_theta = getattr(hc, "rope_parameters", None) or {"rope_theta": hc.rope_theta}  # transformers 5 | 4
    assert mc.rope_theta == hf_rope_theta["rope_theta"]
    assert mc.tie_word_embeddings == hc.tie_word_embeddings
    assert mc.attention_bias == (hc.model_type == "qwen2")


def test_tiny_logits_match_hf(tiny, prompt_ids):
    hf_model, engine = tiny
    check_prefill_and_decode(engine, hf_model, prompt_ids, num_decode=4)


def test_tiny_greedy_matches_hf(tiny, generate, prompt_ids):
    hf_model, engine = tiny
    expected = [hf_greedy(hf_model, ids, 32) for ids in prompt_ids]
    assert generate(engine, prompt_ids, greedy(32)) == expected


@pytest.mark.parametrize("attention", ["reference", "compiled decode"])
def test_mistral_sliding_window_matches_hf_past_the_window(engine_f32, tmp_path, prompt_ids, generate, attention):
    """A window of 8 tokens with prompts of up to ~40 and 24 more decoded: prefill (batched
    and one call per long prompt) and decode logits equal HF's, and so do greedy outputs
    (decoded by the compiled step when it is on); the context is no longer capped."""
    from runtime.engine import LLMEngine
    hf_model = save_tiny_model("mistral", tmp_path, engine_f32.tokenizer, sliding_window=8)
    engine = LLMEngine(enforce_eager=attention == "reference", model=str(tmp_path), dtype="float32", device="cpu",
                       kv_cache_memory="16MiB")
    assert engine.model_config.sliding_window == 8 and engine.max_model_len == 256
    assert max(len(ids) for ids in prompt_ids) > 8 + 16
    if attention == "reference":
        check_prefill_and_decode(engine, hf_model, prompt_ids, num_decode=4)
    expected = [hf_greedy(hf_model, ids, 24) for ids in prompt_ids]
    assert generate(engine, prompt_ids, greedy(24)) == expected


def test_sliding_window_gives_back_the_blocks_it_left_behind(engine_f32, tmp_path, prompt_ids):
    """Decoding 48 tokens past a window of 8 (blocks of 16), a sequence holds at most the 2
    blocks its last 8 tokens touch after every step, where its context needs 6: the blocks
    behind the window go back as it moves (outputs are checked against HF's above)."""
    from runtime.engine import LLMEngine
    save_tiny_model("mistral", tmp_path, engine_f32.tokenizer, sliding_window=8)
    engine = LLMEngine(enforce_eager=True, model=str(tmp_path), dtype="float32", device="cpu",
                       kv_cache_memory="16MiB")
    ids = max(prompt_ids, key=len)
    engine.add_request(ids, greedy(48))
    peak = 0
    while engine.has_unfinished:
        engine.step()
        peak = max(peak, engine.block_manager.num_used_blocks)
    bm = engine.block_manager
    assert peak <= 2 < bm.num_blocks_for(len(ids) + 48)
    assert bm.num_free_blocks == bm.num_blocks


def test_windowed_tree_verification_equals_plain(engine_f32, tmp_path, prompt_ids, generate):
    """Trees verified past the window (a wrong first child, then the right chain 3 deep)
    give plain decoding's greedy output, with drafts accepted."""
    from runtime.draft_tree import DraftTree
    from runtime.engine import LLMEngine
    from speculators.base import Proposer
    from tests.helpers import toy_speculator
    save_tiny_model("mistral", tmp_path, engine_f32.tokenizer, sliding_window=8)
    engine = LLMEngine(enforce_eager=True, model=str(tmp_path), dtype="float32", device="cpu",
                       kv_cache_memory="16MiB", adaptive_speculation=False)
    plain = generate(engine, prompt_ids, greedy(40))
    expected = {tuple(ids): out for ids, out in zip(prompt_ids, plain)}

    class Oracle(Proposer):
        name = "window-oracle"

        def propose(self, requests):
            trees = []
            for r in requests:
                out = expected[tuple(r.token_ids[:r.num_prompt_tokens])]
                done = len(r.token_ids) - r.num_prompt_tokens
                chain = out[done:done + 3]
                trees.append(DraftTree([(chain[0] + 1) % 49152, *chain], [-1, -1, 1, 2][:1 + len(chain)])
                             if chain else DraftTree([], []))
            return trees

    name = toy_speculator("window-oracle", Oracle())
    assert generate(engine, prompt_ids, greedy(40, speculator=name, num_speculative_tokens=4)) == plain
    assert engine.stats.num_accepted_tokens > 40


# ---- tokenizer ------------------------------------------------------------------------------

def test_a_gguf_tokenizer_puts_bos_first_as_the_file_says(tmp_path, monkeypatch):
    """The GGUF's tokenizer.ggml.add_bos_token decides, as in llama.cpp (transformers 4 put
    BOS first regardless), freshly converted and from the cache; either way can be forced."""
    from gguf import GGUFReader

    from runtime.models.loader import _set_adds_bos, adds_bos, load_tokenizer, resolve_model
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    source = resolve_model("smollm2-135m")
    flag = bool(GGUFReader(str(source.path)).fields["tokenizer.ggml.add_bos_token"].contents())
    assert flag is False  # SmolLM2's file: raw text starts with its own tokens
    converted, cached = load_tokenizer(source), load_tokenizer(source)
    assert len(list((tmp_path / "heterospec" / "tokenizers").iterdir())) == 1
    for tokenizer in (converted, cached):
        assert not adds_bos(tokenizer)
        assert tokenizer("The capital").input_ids == tokenizer("The capital", add_special_tokens=False).input_ids
    _set_adds_bos(cached, True, source)
    assert cached("The capital").input_ids[0] == cached.bos_token_id


# ---- loader errors -------------------------------------------------------------------------

def test_missing_path_names_the_path(tmp_path):
    from runtime.models.loader import ModelNotFoundError, load_model
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        load_model(str(missing))


def test_directory_without_config_json(tmp_path):
    from runtime.models.loader import ModelNotFoundError, resolve_model
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="config.json") as info:
        resolve_model(str(tmp_path))
    assert str(tmp_path) in str(info.value)


def test_directory_without_weights(tmp_path):
    from runtime.models.loader import ModelNotFoundError, resolve_model
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        resolve_model(str(tmp_path))


def test_non_gguf_file_is_unsupported(tmp_path):
    from runtime.models.config import UnsupportedModelError
    from runtime.models.loader import load_model
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 64)
    with pytest.raises(UnsupportedModelError, match="weights.bin"):
        load_model(str(path))


def test_unsupported_model_type(tmp_path):
    from safetensors.torch import save_file
    from runtime.models.config import UnsupportedModelError
    from runtime.models.loader import load_model
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2}))
    save_file({"wte.weight": torch.zeros(10, 8)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("rope_scaling", [{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
                                          {"rope_type": "dynamic", "factor": 2.0}], ids=["yarn", "dynamic"])
def test_unsupported_rope_scaling_is_refused(engine_f32, tmp_path, rope_scaling):
    from runtime.models.config import UnsupportedModelError
    from runtime.models.loader import load_model
    save_tiny_model("llama_linear", tmp_path, engine_f32.tokenizer)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_scaling"] = rope_scaling
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=rope_scaling["rope_type"]):
        load_model(str(tmp_path))


def test_missing_and_misshapen_weights_are_refused(engine_f32, tmp_path):
    from safetensors.torch import load_file, save_file
    from runtime.models.config import UnsupportedModelError
    from runtime.models.loader import load_model
    save_tiny_model("qwen2", tmp_path, engine_f32.tokenizer)
    [weights_file] = tmp_path.glob("*.safetensors")
    weights = load_file(str(weights_file))
    name = "model.layers.1.self_attn.k_proj.bias"
    saved = weights.pop(name)
    save_file(weights, str(weights_file))
    with pytest.raises(UnsupportedModelError, match="missing weights"):
        load_model(str(tmp_path))
    weights[name] = torch.cat([saved, saved])
    save_file(weights, str(weights_file))
    with pytest.raises(UnsupportedModelError, match="shape"):
        load_model(str(tmp_path))
