"""EAGLE-3 (speculators/eagle_heads.py, the target's feature layers, training) against
references nobody here wrote.

- The target's feature layers and greedy tokens: what training records equals HF
  transformers' output_hidden_states[j] and the argmax of its logits (what the engine
  delivers to a proposer: test_eagle.py).
- The head: a checkpoint in the public EAGLE-3 layout (midlayer.*, fc, norm, lm_head,
  d2t, t2d, config.json) loads, and the head's states and draft logits equal the
  published architecture assembled here from HF transformers' own Llama modules
  (LlamaRMSNorm, LlamaAttention with 2H-wide q/k/v, LlamaMLP, LlamaRotaryEmbedding);
  draft ids map to target tokens through d2t. Bad checkpoints are named errors.
- Training: the draft vocabulary is the most written tokens; soft labels are the target's
  top-k probabilities (against HF's softmax) and their loss torch's cross-entropy over
  the draft vocabulary; cached target states read back whole (the unrolled steps of
  either head against step-by-step drafting: test_eagle.py).
- Through the engine, float32, batched: a random and a briefly trained EAGLE-3 head give
  the output of `--speculator none`, the trained one landing drafts, alone and merged
  with the Lookahead Cache's trees (`eagle+lookahead`); blocks all return.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from runtime.models.config import ModelConfig
from speculators.eagle_heads import Eagle3Head, load_head, new_eagle3_head, save_head
from training.common import Sample, dense_causal_attention, draft_vocabulary, target_states
from speculators.draft_vocab import DraftVocabulary
from training.eagle import (eagle_data, evaluate_eagle, greedy_path_length, soft_cross_entropy,
                            train_eagle)
from runtime.draft_tree import DraftTree
from tests.helpers import greedy

PROMPTS = [
    "Repeat this list exactly, once: apple, banana, cherry, date, elderberry, fig, grape.\nList: apple,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):",
    "The capital of France is",
]
SMOLLM_LAYERS = (2, 15, 27)  # the default for a 30-layer target: 2, L // 2, L - 3


def tiny_target(**changes) -> ModelConfig:
    base = ModelConfig("llama", vocab_size=50, hidden_size=16, intermediate_size=24, num_layers=8, num_heads=4,
                       num_kv_heads=2, head_dim=4, max_position_embeddings=64, rms_norm_eps=1e-6)
    return dataclasses.replace(base, **changes)


def public_checkpoint(cfg: ModelConfig, num_features: int, draft_vocab: list[int], seed: int = 0) -> dict:
    """Random tensors under the public EAGLE-3 names and shapes."""
    gen = torch.Generator().manual_seed(seed)
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def rand(*shape, std=0.3):
        return torch.randn(*shape, generator=gen) * std

    vocab = torch.tensor(draft_vocab)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[vocab] = True
    return {"fc.weight": rand(h, num_features * h),
            "midlayer.self_attn.q_proj.weight": rand(q, 2 * h), "midlayer.self_attn.k_proj.weight": rand(kv, 2 * h),
            "midlayer.self_attn.v_proj.weight": rand(kv, 2 * h), "midlayer.self_attn.o_proj.weight": rand(h, q),
            "midlayer.mlp.gate_proj.weight": rand(cfg.intermediate_size, h),
            "midlayer.mlp.up_proj.weight": rand(cfg.intermediate_size, h),
            "midlayer.mlp.down_proj.weight": rand(h, cfg.intermediate_size),
            "midlayer.input_layernorm.weight": 1 + rand(h), "midlayer.hidden_norm.weight": 1 + rand(h),
            "midlayer.post_attention_layernorm.weight": 1 + rand(h), "norm.weight": 1 + rand(h),
            "lm_head.weight": rand(len(draft_vocab), h), "d2t": vocab - torch.arange(len(vocab)), "t2d": t2d}


def public_config(cfg: ModelConfig, draft_vocab_size: int, **extra) -> dict:
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "num_hidden_layers": 1, "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": 10000.0, "max_position_embeddings": 32, "vocab_size": cfg.vocab_size,
            "draft_vocab_size": draft_vocab_size, **extra}


def write_checkpoint(directory, tensors: dict, config: dict):
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@torch.no_grad()
def hf_eagle3_reference(tensors: dict, config: dict, embeds: torch.Tensor, features: torch.Tensor):
    """The published EAGLE-3 head from HF transformers' Llama modules: states [T, H] and
    draft logits [T, Vd] for embeds [T, H] and target features [T, 3H] at positions 0..T-1."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding
    hf_config = LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"})
    hf_config._attn_implementation = "eager"
    h, t = hf_config.hidden_size, embeds.shape[0]

    def norm(name):
        module = LlamaRMSNorm(h, eps=hf_config.rms_norm_eps)
        module.weight.data.copy_(tensors[name])
        return module

    attn = LlamaAttention(hf_config, layer_idx=0)
    for proj in ("q_proj", "k_proj", "v_proj"):  # EAGLE-3 attends from [embed, state]: 2H wide
        weight = tensors[f"midlayer.self_attn.{proj}.weight"]
        setattr(attn, proj, torch.nn.Linear(2 * h, weight.shape[0], bias=False))
        getattr(attn, proj).weight.data.copy_(weight)
    attn.o_proj.weight.data.copy_(tensors["midlayer.self_attn.o_proj.weight"])
    mlp = LlamaMLP(hf_config)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        getattr(mlp, proj).weight.data.copy_(tensors[f"midlayer.mlp.{proj}.weight"])
    position_ids = torch.arange(t)[None]
    cos_sin = LlamaRotaryEmbedding(hf_config)(embeds[None], position_ids)
    causal = torch.full((t, t), float("-inf")).triu(1)[None, None]  # [1, 1, T, T] additive

    state = features @ tensors["fc.weight"].T  # [T, H]
    x = torch.cat([norm("midlayer.input_layernorm.weight")(embeds), norm("midlayer.hidden_norm.weight")(state)], -1)
    x = state + attn(x[None], cos_sin, causal)[0][0]
    x = x + mlp(norm("midlayer.post_attention_layernorm.weight")(x))
    return x, norm("norm.weight")(x) @ tensors["lm_head.weight"].T


@pytest.mark.parametrize("layers_in_config", [True, False])
def test_public_eagle3_checkpoint_equals_the_published_architecture(tmp_path, layers_in_config):
    target = tiny_target()
    draft_vocab = [0, 3, 4, 9, 17, 21, 30, 44, 49]
    tensors = public_checkpoint(target, 3, draft_vocab)
    extra = {"eagle_aux_hidden_state_layer_ids": [1, 3, 6]} if layers_in_config else {}
    config = public_config(target, len(draft_vocab), **extra)
    path = write_checkpoint(tmp_path / "eagle3", tensors, config)
    embed = torch.nn.Embedding(target.vocab_size, target.hidden_size)
    head = load_head(path, target, embed, lm_head=None)
    assert isinstance(head, Eagle3Head)
    assert head.feature_layers == ((1, 3, 6) if layers_in_config else (2, 4, 5))  # default: 2, L // 2, L - 3

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, target.vocab_size, (11,), generator=gen)
    features = torch.randn(11, 3 * target.hidden_size, generator=gen)
    with torch.no_grad():
        states = head(ids, torch.arange(11), head.project(features), dense_causal_attention)
        logits = head.draft_logits(states)
    ref_states, ref_logits = hf_eagle3_reference(tensors, config, embed(ids).detach(), features)
    torch.testing.assert_close(states, ref_states, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    # draft ids are target tokens through d2t, and back
    assert head.target_ids(torch.arange(len(draft_vocab))).tolist() == draft_vocab
    assert head.draft_ids(torch.tensor([3, 44, 5])).tolist() == [1, 7, -100]

    # the same checkpoint under "layers.0." names (vLLM speculators' layout), and our own save round trip
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
    again = load_head(write_checkpoint(tmp_path / "renamed", renamed, config), target, embed, None)
    saved = load_head(save_head(head, tmp_path / "ours"), target, embed, None)
    for other in (again, saved):
        assert other.feature_layers == head.feature_layers
        with torch.no_grad():
            torch.testing.assert_close(other.draft_logits(other(ids, torch.arange(11), other.project(features),
                                                                 dense_causal_attention)), logits)


def test_bad_eagle3_checkpoints_are_named_errors(tmp_path):
    target = tiny_target()
    tensors = public_checkpoint(target, 3, [1, 2, 3])
    embed = torch.nn.Embedding(target.vocab_size, target.hidden_size)

    def load(name, tensors=tensors, **config_changes):
        config = public_config(target, 3, **config_changes)
        return load_head(write_checkpoint(tmp_path / name, tensors, config), target, embed, None)

    with pytest.raises(ValueError, match="feature layers"):
        load("range", eagle_aux_hidden_state_layer_ids=[2, 4, 8])
    with pytest.raises(ValueError, match="hidden_size 32"):
        load("hidden", hidden_size=32)
    with pytest.raises(ValueError, match="missing midlayer.hidden_norm.weight"):
        load("missing", {k: v for k, v in tensors.items() if k != "midlayer.hidden_norm.weight"})
    with pytest.raises(ValueError, match="fc.weight.*shape"):
        load("fc", {**tensors, "fc.weight": torch.zeros(16, 32)})


def test_draft_vocabulary_is_the_most_written_answer_tokens():
    samples = [Sample([7, 7, 7, 1, 1, 2, 5, 5], 3), Sample([7, 9, 9, 9, 5, 2], 1)]  # answers: 1 1 2 5 5 | 9 9 9 5 2
    assert draft_vocabulary(samples, 3).tolist() == [1, 5, 9]  # 5 and 9: 3 each; 1 and 2: 2 each, ties by id
    assert draft_vocabulary(samples, 3, always=[0]).tolist() == [0, 5, 9]


# ---- the default model, through the engine -----------------------------------------------------------

@torch.no_grad()
def test_feature_layers_greedy_tokens_and_soft_labels_equal_hf(engine_f32, hf_smollm):
    samples = [Sample(engine_f32.tokenize(p), 0) for p in PROMPTS[:3]]
    states = list(target_states(engine_f32.model, samples, SMOLLM_LAYERS, top_k=5, progress=False))
    assert [s for s, _, _, _ in states] == samples
    for s, ours, argmax, (top_ids, top_probs) in states:  # [T, 4H], [T], [T, 5] x 2
        out = hf_smollm(torch.tensor([s.token_ids]), output_hidden_states=True)
        reference = torch.cat([out.hidden_states[-1][0]] + [out.hidden_states[j][0] for j in SMOLLM_LAYERS], dim=-1)
        torch.testing.assert_close(ours, reference, atol=2e-4, rtol=1e-4)
        assert argmax.tolist() == out.logits[0].argmax(dim=-1).tolist()
        probs = out.logits[0].float().softmax(dim=-1)  # [T, V]
        torch.testing.assert_close(top_probs.float(), probs.topk(5, dim=-1).values, atol=1e-3, rtol=1e-3)
        # the ids are those probabilities' tokens (where HF's ranking ties, either order is right)
        torch.testing.assert_close(probs.gather(1, top_ids.long()), top_probs.float(), atol=1e-3, rtol=1e-3)
        assert top_ids.dtype == torch.int32 and top_probs.dtype == torch.float16


class _ThreeTokenVocab(DraftVocabulary, torch.nn.Module):
    """Draft ids 0, 1, 2 for target tokens 1, 5, 9 of a 12-token vocabulary."""

    def __init__(self):
        super().__init__()
        self.init_draft_vocab(12, 3)
        self.set_draft_vocab(torch.tensor([1, 5, 9]))


def test_soft_labels_are_the_target_distribution_on_the_draft_vocabulary():
    """soft_cross_entropy against torch's cross-entropy with probability targets, written
    out by hand: the target's top tokens outside the draft vocabulary drop out, the rest is
    renormalised, and a position with none of it in the draft vocabulary is skipped."""
    vocab = _ThreeTokenVocab()
    logits = torch.tensor([[0.3, -1.0, 2.0], [1.0, 0.0, 0.5], [0.0, 0.2, -0.4]], requires_grad=True)  # [3, Vd]
    top_ids = torch.tensor([[5, 2, 9], [2, 3, 4], [1, 9, 5]], dtype=torch.int32)  # row 1: none in the vocabulary
    top_probs = torch.tensor([[0.5, 0.3, 0.1], [0.6, 0.2, 0.1], [0.7, 0.2, 0.05]], dtype=torch.float16)
    ours = soft_cross_entropy(vocab, logits, top_ids, top_probs)
    targets = torch.tensor([[0.0, 0.5 / 0.6, 0.1 / 0.6], [0.7 / 0.95, 0.05 / 0.95, 0.2 / 0.95]])  # rows 0 and 2
    reference = torch.nn.functional.cross_entropy(logits[[0, 2]], targets)
    torch.testing.assert_close(ours, reference, atol=1e-3, rtol=1e-3)
    ours.backward()
    assert logits.grad[1].abs().sum() == 0  # the skipped position takes no part
    none_in_vocab = soft_cross_entropy(vocab, logits, top_ids[1:2], top_probs[1:2])
    assert float(none_in_vocab.detach()) == 0.0 and none_in_vocab.requires_grad


def test_target_states_cache_reads_back_what_was_extracted_and_misses_on_any_change(engine_f32, tmp_path,
                                                                                    monkeypatch):
    import training.eagle as training_eagle
    extracted = []

    def counting_target_states(model, samples, *args, **kwargs):
        extracted.extend(samples)
        return target_states(model, samples, *args, **kwargs)

    monkeypatch.setattr(training_eagle, "target_states", counting_target_states)
    monkeypatch.setattr(training_eagle, "CACHE_CHUNK", 2)
    model = engine_f32.model
    samples = [Sample(engine_f32.tokenize(p), 2) for p in PROMPTS]
    head = smollm_eagle3_head(engine_f32, samples)
    written = eagle_data(model, samples, head, progress=False, top_k=4, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.pt"))) == 2 and extracted == samples  # chunks of 2 and 1
    extracted.clear()
    read = eagle_data(model, samples, head, progress=False, top_k=4, cache_dir=tmp_path)
    assert extracted == []
    for a, b in zip(written, read, strict=True):
        for field in ("token_ids", "features", "greedy", "top_ids", "top_probs"):
            assert torch.equal(getattr(a, field), getattr(b, field)), field
        assert a.num_prompt_tokens == b.num_prompt_tokens
    more = samples + [Sample(engine_f32.tokenize("One more prompt, added later."), 2)]
    eagle_data(model, more, head, progress=False, top_k=4, cache_dir=tmp_path)
    assert extracted == more[2:]  # the first chunk is unchanged and read back
    extracted.clear()
    hard = eagle_data(model, samples, head, progress=False, top_k=0, cache_dir=tmp_path)  # other labels
    assert extracted == samples and hard[0].top_ids is None and torch.equal(hard[0].features, written[0].features)
    extracted.clear()
    eagle_data(model, [Sample(s.token_ids, 3) for s in samples[:2]], head, progress=False, top_k=4,
               cache_dir=tmp_path)  # other prompt lengths
    assert len(extracted) == 2


@pytest.fixture(scope="module")
def plain_outputs(engine_f32, generate):
    return generate(engine_f32, PROMPTS, greedy(speculator="none"))


def smollm_eagle3_head(engine, samples) -> Eagle3Head:
    model = engine.model
    head = new_eagle3_head(model.config, model.embed_tokens, draft_vocabulary(samples, 2048)).float()
    with torch.no_grad():
        head.norm.weight.copy_(model.norm.weight)
        head.lm_head.weight.copy_(model.lm_head.weight[head.target_ids(torch.arange(head.draft_vocab_size))])
    return head


@pytest.fixture(scope="module")
def trained_eagle3_dir(engine_f32, plain_outputs, tmp_path_factory):
    """An EAGLE-3 head trained for a few seconds on the test prompts' own plain outputs."""
    torch.manual_seed(0)
    samples = [Sample(engine_f32.tokenize(p) + out, len(engine_f32.tokenize(p)))
               for p, out in zip(PROMPTS, plain_outputs)]
    head = smollm_eagle3_head(engine_f32, samples)
    data = eagle_data(engine_f32.model, samples, head, progress=False)
    result = train_eagle(head, data, data, steps=60, lr=2e-3, sequences_per_step=2, noise=0.0, eval_every=60,
                         progress=False, unroll=2)
    assert result["val_accuracy"] > 0.5, result  # it learned the outputs it was shown
    return save_head(head, tmp_path_factory.mktemp("eagle3") / "trained")


def test_soft_label_training_learns_the_targets_tokens(engine_f32, plain_outputs):
    """Trained against the target's top-8 distribution (EAGLE-3's soft labels) instead of
    its greedy token, the head still learns the greedy outputs it was shown."""
    torch.manual_seed(0)
    samples = [Sample(engine_f32.tokenize(p) + out, len(engine_f32.tokenize(p)))
               for p, out in zip(PROMPTS, plain_outputs)]
    head = smollm_eagle3_head(engine_f32, samples)
    data = eagle_data(engine_f32.model, samples, head, progress=False, top_k=8)
    before = evaluate_eagle(head, data)["val_accuracy"]
    result = train_eagle(head, data, data, steps=60, lr=2e-3, sequences_per_step=2, noise=0.0, eval_every=60,
                         progress=False, unroll=2)
    assert result["val_accuracy"] > max(0.5, before + 0.2), (before, result)


def test_random_eagle3_head_is_greedy_lossless(eagle_engine, engine_f32, plain_outputs, generate, tmp_path):
    torch.manual_seed(3)
    head = smollm_eagle3_head(engine_f32, [Sample(list(range(4096)), 0)])
    for name, p in head.named_parameters():
        if name not in ("norm.weight", "lm_head.weight"):
            torch.nn.init.normal_(p, std=0.02)
    engine = eagle_engine(save_head(head, tmp_path / "random"), adaptive=False, num_tokens=8, width=3)
    drafted = engine.stats.num_draft_tokens
    assert generate(engine, PROMPTS, greedy(speculator="eagle")) == plain_outputs
    assert engine.stats.num_draft_tokens > drafted
    assert engine.runner.feature_layers == SMOLLM_LAYERS


def test_trained_eagle3_head_is_greedy_lossless_and_accepts_drafts(eagle_engine, trained_eagle3_dir, generate,
                                                                   plain_outputs):
    engine = eagle_engine(trained_eagle3_dir, adaptive=False, num_tokens=12, width=4)
    accepted, steps = engine.stats.num_accepted_tokens, engine.stats.num_verify_steps
    outputs = generate(engine, PROMPTS, greedy(speculator="eagle"))
    for i, (out, ref) in enumerate(zip(outputs, plain_outputs)):
        assert out == ref, f"prompt {i} differs from plain decoding"
    per_step = (engine.stats.num_accepted_tokens - accepted) / (engine.stats.num_verify_steps - steps)
    assert per_step > 1.0, f"a trained head should land drafts ({per_step:.2f} accepted per step)"
    proposer = engine.pool.get("eagle")
    assert proposer.block_manager.num_free_blocks == proposer.block_manager.num_blocks


def test_validation_acceptance_per_step_is_what_the_engine_measures(eagle_engine, trained_eagle3_dir, generate):
    """The training's per-step validation figure (the proposer drafting along greedy
    answers to prompts the head was not trained on, so that some steps accept their whole
    path and some do not) against the engine's own count, decoding those prompts with
    fixed trees of the same size."""
    prompts = ["Name three colours of the rainbow.", "def mul(a, b):", "Once upon a time,"]
    engine = eagle_engine(trained_eagle3_dir, adaptive=False, num_tokens=12, width=4)
    answers = generate(engine, prompts, greedy(speculator="none"))
    model = engine.model
    head = load_head(trained_eagle3_dir, model.config, model.embed_tokens, model.lm_head).float()
    samples = [Sample(engine.tokenize(p) + out, len(engine.tokenize(p))) for p, out in zip(prompts, answers)]
    figures = evaluate_eagle(head, eagle_data(model, samples, head, progress=False),
                             {"depth": engine.config.eagle_depth, "tree_width": 4, "max_nodes": 12})
    accepted, steps = engine.stats.num_accepted_tokens, engine.stats.num_verify_steps
    assert generate(engine, prompts, greedy(speculator="eagle")) == answers
    measured = 1 + (engine.stats.num_accepted_tokens - accepted) / (engine.stats.num_verify_steps - steps)
    # neither every draft rejected (1.0: twice the tolerance below) nor every path accepted
    assert 1.1 < measured < 3.5, measured
    assert figures["val_step_acceptance"] == pytest.approx(measured, abs=0.05)


def test_greedy_path_length_follows_the_tokens_down_the_tree():
    tree = DraftTree([5, 6, 7, 8, 9], [-1, -1, 1, 1, 3])  # root -> 5 | 6 -> (7 | 8 -> 9)
    assert greedy_path_length(tree, [6, 8, 9, 4]) == 3
    assert greedy_path_length(tree, [6, 7, 9]) == 2
    assert greedy_path_length(tree, [5, 5]) == 1
    assert greedy_path_length(tree, [4]) == 0
    assert greedy_path_length(tree, [6, 8]) == 2  # the answer ends first
    assert greedy_path_length(DraftTree([], []), [1]) == 0


def test_eagle3_with_lookahead_is_greedy_lossless(eagle_engine, trained_eagle3_dir, generate, plain_outputs):
    """`eagle+lookahead`: the head's tree and the Lookahead Cache's merged into one verify
    tree (speculators/composite.py), the head fed through the composite; outputs equal
    plain decoding, and both parts' nodes are verified (the budget 12 splits 8 : 4)."""
    engine = eagle_engine(trained_eagle3_dir, adaptive=False, num_tokens=12, width=4)
    sizes = []
    composite = engine.pool.get("eagle+lookahead")
    propose = composite.propose
    composite.propose = lambda requests: [sizes.append(len(t)) or t for t in propose(requests)]
    assert generate(engine, PROMPTS, greedy(speculator="eagle+lookahead")) == plain_outputs
    assert max(sizes) > 8  # beyond the head's 8 nodes: the cache added some of its own
    head = composite.parts[0]
    assert head.block_manager.num_free_blocks == head.block_manager.num_blocks
    assert engine.runner.feature_layers == SMOLLM_LAYERS


@pytest.mark.parametrize("backend,quantization", [("torch", "int8"), ("ipex", "none"), ("ipex", "int8")])
def test_eagle3_head_through_the_draft_backends_is_greedy_lossless(eagle_engine, trained_eagle3_dir, generate,
                                                                   plain_outputs, backend, quantization):
    """On the CPU the head runs through --draft-backend / --draft-quantization; its own
    layers change (the target's embedding is not touched) and the output does not."""
    from draft_cpu.backends import Int8Linear, import_ipex
    if backend == "ipex" and import_ipex() is None:
        pytest.skip("intel_extension_for_pytorch does not import here")
    engine = eagle_engine(trained_eagle3_dir, adaptive=False, num_tokens=12, width=4, backend=backend,
                          quantization=quantization)
    embed_type = type(engine.model.embed_tokens)
    assert generate(engine, PROMPTS, greedy(speculator="eagle")) == plain_outputs
    head = engine.pool.get("eagle").head
    if backend == "torch":
        assert isinstance(head.fc, Int8Linear) and isinstance(head.lm_head, Int8Linear)
    else:
        assert type(head.fc) is not torch.nn.Linear  # IPEX's prepacked or weight-only int8 linear
    assert type(engine.model.embed_tokens) is embed_type and isinstance(engine.model.lm_head, torch.nn.Linear)


def test_proposers_reading_different_target_layers_are_refused():
    """A request asking for a proposer that reads other target layers than one already
    loaded is refused, and the loaded one keeps its layers; without it, the target hands
    out none (and closing keeps them: resetting would recompile the step on the way out)."""
    from speculators.ngram import NGramProposer
    from tests.helpers import new_engine, toy_speculator
    first, second = NGramProposer(1, 3), NGramProposer(1, 3)
    first.feature_layers, second.feature_layers = SMOLLM_LAYERS, (1, 2, 3)
    engine = new_engine(speculator=toy_speculator("reads-layers", first))
    try:
        assert engine.runner.feature_layers == SMOLLM_LAYERS
        with pytest.raises(ValueError, match="different target layers"):
            engine.add_request("hi", greedy(4, speculator=toy_speculator("reads-other-layers", second)))
        assert engine.runner.feature_layers == SMOLLM_LAYERS and not engine.has_unfinished
        engine.update_speculation(speculator="none")
        assert engine.runner.feature_layers == ()
        engine.update_speculation(speculator="reads-layers")
        assert engine.runner.feature_layers == SMOLLM_LAYERS
        compiled = []
        engine.runner._make_graphs = lambda: compiled.append(True)
    finally:
        engine.close()
    assert engine.runner.feature_layers == SMOLLM_LAYERS and not compiled
