"""EAGLE (speculators/eagle.py, training/eagle.py) on the default model.

- Features: a proposer that reads features receives, over a whole speculative run, the
  target's hidden state at every committed position (with EAGLE-3 feature layers, those
  layers' inputs too), equal to HF transformers' hidden states of the final text (prefill
  chunks, verified roots and accepted nodes all delivered, in order).
- Checkpoints in the public EAGLE layout (fc.weight, layers.0.*): the exact public names,
  q/k/v and gate/up split out of our fused matrices, round trip through safetensors and
  pytorch_model.bin, shape errors named.
- EAGLE-2 tree: the kept nodes are the best by cumulative probability and form a tree.
- Greedy lossless, batched, float32: a briefly trained head (many drafts accepted) and a
  random head (mostly rejected) give the output of `--speculator none`; blocks all return.
"""
from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
from safetensors.torch import save_file

from runtime.models.config import ModelConfig
from runtime.sampling_params import SamplingParams
from speculators.base import ProposalRequest
from speculators.eagle import EagleProposer, _best_tree, _Node
from speculators.eagle_heads import EagleHead, load_head, new_eagle3_head, save_head, to_public_names
from training.common import Sample
from training.eagle import eagle_data, train_eagle
from tests.helpers import greedy, new_engine, toy_speculator

PROMPTS = [
    "Repeat this list exactly, once: apple, banana, cherry, date, elderberry, fig, grape.\nList: apple,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):",
    "The capital of France is",
    "Write a short poem about the sea.",
]

PUBLIC_NAMES = {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
                "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight",
                "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
                "layers.0.post_attention_layernorm.weight"}


def tiny_config(**changes) -> ModelConfig:
    base = ModelConfig("llama", vocab_size=50, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=4, max_position_embeddings=64)
    return dataclasses.replace(base, **changes)


def random_head(cfg: ModelConfig, seed: int, std: float = 0.2) -> EagleHead:
    torch.manual_seed(seed)
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    head = EagleHead(cfg, embed, lm_head)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=std)
    return head


# ---- checkpoints ----------------------------------------------------------------------------------

@pytest.mark.parametrize("architecture, bias", [("llama", False), ("qwen2", True)])
def test_public_layout_names_and_round_trip(tmp_path, architecture, bias):
    cfg = tiny_config(architecture=architecture, attention_bias=bias)
    head = random_head(cfg, 0)
    public = to_public_names(head)
    expected = PUBLIC_NAMES | ({f"layers.0.self_attn.{x}_proj.bias" for x in "qkv"} if bias else set())
    assert set(public) == expected
    q = cfg.num_heads * cfg.head_dim
    assert torch.equal(public["layers.0.self_attn.q_proj.weight"], head.layers[0].self_attn.qkv_proj.weight[:q])
    assert public["layers.0.self_attn.k_proj.weight"].shape == (cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size)
    assert public["layers.0.mlp.up_proj.weight"].shape == (cfg.intermediate_size, cfg.hidden_size)
    # a public checkpoint carries the embedding too; it is ignored (the target's is used)
    tensors = {n: t.detach().clone() for n, t in public.items()}
    tensors["embed_tokens.weight"] = torch.randn(cfg.vocab_size, cfg.hidden_size)
    (tmp_path / "st").mkdir()
    save_file(tensors, str(tmp_path / "st" / "model.safetensors"))
    (tmp_path / "st" / "config.json").write_text(json.dumps({"hidden_size": 16, "vocab_size": 50}))
    (tmp_path / "bin").mkdir()
    torch.save(tensors, tmp_path / "bin" / "pytorch_model.bin")
    embed, lm_head = head._shared
    ids, pos = torch.tensor([3, 7, 9]), torch.tensor([0, 1, 2])
    feats = torch.randn(3, cfg.hidden_size)

    def causal(layer, q_, k, v):
        from training.common import dense_causal_attention
        return dense_causal_attention(layer, q_, k, v)

    with torch.no_grad():
        want = head(ids, pos, feats, causal)
        for directory in ("st", "bin"):
            loaded = load_head(tmp_path / directory, cfg, embed, lm_head)
            torch.testing.assert_close(loaded(ids, pos, feats, causal), want)
    wrong = dataclasses.replace(cfg, intermediate_size=32)
    with pytest.raises(ValueError, match="gate_proj.weight' has shape"):
        load_head(tmp_path / "bin", wrong, embed, lm_head)
    with pytest.raises(ValueError, match="hidden_size"):
        load_head(tmp_path / "st", dataclasses.replace(cfg, hidden_size=20, head_dim=5), embed, lm_head)
    del tensors["layers.0.mlp.down_proj.weight"]
    save_file(tensors, str(tmp_path / "st" / "model.safetensors"))
    with pytest.raises(ValueError, match="missing layers.0.mlp.down_proj.weight"):
        load_head(tmp_path / "st", cfg, embed, lm_head)


# ---- the EAGLE-2 tree --------------------------------------------------------------------------

def test_best_tree_keeps_the_top_nodes_by_cumulative_probability_and_is_a_tree():
    rng = random.Random(4)
    for _ in range(200):
        nodes = []
        for k in range(rng.randint(1, 40)):
            parent = rng.randint(-1, k - 1)
            value = rng.random() * (1.0 if parent < 0 else nodes[parent].value)
            nodes.append(_Node(value, 1 if parent < 0 else nodes[parent].depth + 1, rng.randrange(100), parent))
        budget = rng.randint(1, 45)
        tree = _best_tree(nodes, budget)
        assert len(tree) == min(budget, len(nodes))
        best = sorted((n.value for n in nodes), reverse=True)[:len(tree)]
        kept_values = []
        for i in range(len(tree)):  # match each kept node back to a candidate through its path
            path, node = [], i
            while node >= 0:
                path.append(tree.token_ids[node])
                node = tree.parents[node]
            kept_values.append(path)
        assert len(tree.parents) == len(tree) and all(-1 <= p < i for i, p in enumerate(tree.parents))
        # the values of the kept nodes are the best values (a parent never scores below its child)
        chosen = sorted(range(len(nodes)), key=lambda k: (-nodes[k].value, nodes[k].depth, k))[:len(tree)]
        assert sorted((nodes[k].value for k in chosen), reverse=True) == best
        assert all(nodes[k].parent < 0 or nodes[k].parent in chosen for k in chosen)


def test_proposer_drafts_a_valid_tree_within_budget_and_width():
    cfg = tiny_config()
    head = random_head(cfg, 1, std=0.5)
    proposer = EagleProposer(head, torch.device("cpu"), depth=4, num_kv_tokens=512, block_size=4)
    tokens = [1, 5, 9, 12, 3, 7]
    features = [(0, torch.randn(len(tokens) - 1, cfg.hidden_size))]
    params = SamplingParams(temperature=0.0)
    [tree] = proposer.propose([ProposalRequest("r", tokens, 3, 10, 3, params, new_features=features)])
    assert 1 <= len(tree) <= 10 and tree.max_depth <= 4
    assert all(len(c) <= 3 for c in tree.children())
    assert proposer.block_manager.num_free_blocks == proposer.block_manager.num_blocks - 2  # 5 fed inputs, 4 a block
    # the depth-1 nodes are the head's top tokens after feeding the context
    with torch.no_grad():
        from training.common import dense_causal_attention
        out = head(torch.tensor(tokens[1:]), torch.arange(5), features[0][1], dense_causal_attention)
        top = head.draft_logits(out[-1:])[0].topk(3).indices.tolist()
    assert set(tree.token_ids[i] for i, p in enumerate(tree.parents) if p == -1) <= set(top)
    proposer.release("r")
    assert proposer.block_manager.num_free_blocks == proposer.block_manager.num_blocks


def test_requests_that_fit_the_pool_only_alone_are_drafted_in_turn():
    """Two requests that need 2 blocks each, a pool of 3: the first is drafted for, the
    second gets no tree this step (never an out-of-blocks error that costs both)."""
    cfg = tiny_config()
    proposer = EagleProposer(random_head(cfg, 1, std=0.5), torch.device("cpu"), depth=3, num_kv_tokens=12,
                             block_size=4)
    tokens = [1, 5, 9, 12, 3, 7]  # 5 fed inputs: 2 blocks
    params = SamplingParams(temperature=0.0)
    requests = [ProposalRequest(rid, tokens, 3, 6, 2, params,
                                new_features=[(0, torch.randn(len(tokens) - 1, cfg.hidden_size))])
                for rid in ("a", "b")]
    first, second = proposer.propose(requests)
    assert len(first) > 0 and len(second) == 0
    for rid in ("a", "b"):
        proposer.release(rid)
    assert proposer.block_manager.num_free_blocks == proposer.block_manager.num_blocks


# ---- through the engine ---------------------------------------------------------------------------

@pytest.mark.parametrize("feature_layers", [(), (2, 15, 27)], ids=["final", "eagle3-layers"])
def test_features_of_every_committed_token_reach_the_proposer(hf_smollm, generate, feature_layers):
    """Over a speculative run with prefill chunks, a proposer that reads features gets, for
    every committed position, HF transformers' final hidden state (and with EAGLE-3 feature
    layers, the inputs of those layers after it: output_hidden_states[j])."""
    from speculators.ngram import NGramProposer
    seen: dict[str, dict[int, torch.Tensor]] = {}
    final: dict[str, list[int]] = {}

    class Recording(NGramProposer):
        needs_features = True

        def propose(self, requests):
            for r in requests:
                store = seen.setdefault(r.request_id, {})
                for start, rows in r.new_features:
                    for j in range(rows.shape[0]):
                        store[start + j] = rows[j].clone()
                final[r.request_id] = list(r.token_ids)
            return super().propose(requests)

    recording = Recording(1, 3)
    recording.feature_layers = feature_layers
    name = toy_speculator("recording-features", recording)
    engine = new_engine(max_num_batched_tokens=16)  # prompts arrive in prefill chunks
    try:
        generate(engine, PROMPTS[:2], greedy(24, speculator=name))
    finally:
        engine.close()
    assert engine.stats.num_accepted_tokens > 0
    for request_id, token_ids in final.items():
        store = seen[request_id]
        assert sorted(store) == list(range(len(token_ids) - 1))
        got = torch.stack([store[p] for p in range(len(token_ids) - 1)]).float()  # [T-1, (1 + k) H]
        with torch.no_grad():
            hf = hf_smollm(torch.tensor([token_ids]), output_hidden_states=True).hidden_states
        reference = torch.cat([hf[-1][0]] + [hf[j][0] for j in feature_layers], dim=-1)[:-1]
        torch.testing.assert_close(got, reference, atol=5e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def plain_outputs(engine_f32, generate):
    return generate(engine_f32, PROMPTS, greedy(speculator="none"))


@pytest.fixture(scope="module")
def trained_head(engine_f32, plain_outputs, tmp_path_factory):
    """A head trained for a few seconds on the test prompts' own plain outputs."""
    torch.manual_seed(0)
    model = engine_f32.model
    samples = [Sample(engine_f32.tokenize(p) + out, len(engine_f32.tokenize(p)))
               for p, out in zip(PROMPTS, plain_outputs)]
    head = EagleHead(model.config, model.embed_tokens, model.lm_head).float()
    data = eagle_data(model, samples, head, progress=False)
    result = train_eagle(head, data, data, steps=60, lr=2e-3, sequences_per_step=2, noise=0.0, eval_every=60,
                         progress=False)
    assert result["val_accuracy"] > 0.5, result  # it learned the outputs it was shown
    return save_head(head, tmp_path_factory.mktemp("eagle") / "trained")


@pytest.fixture(scope="module")
def random_head_dir(engine_f32, tmp_path_factory):
    model = engine_f32.model
    torch.manual_seed(2)
    head = EagleHead(model.config, model.embed_tokens, model.lm_head)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return save_head(head, tmp_path_factory.mktemp("eagle") / "random")


@pytest.mark.parametrize("width", [1, 4])
def test_trained_head_is_greedy_lossless_and_accepts_drafts(eagle_engine, trained_head, generate, plain_outputs,
                                                            width):
    engine = eagle_engine(trained_head, adaptive=False, num_tokens=12, width=width)
    accepted, steps = engine.stats.num_accepted_tokens, engine.stats.num_verify_steps
    outputs = generate(engine, PROMPTS, greedy(speculator="eagle"))
    for i, (out, ref) in enumerate(zip(outputs, plain_outputs)):
        assert out == ref, f"prompt {i} differs from plain decoding"
    per_step = (engine.stats.num_accepted_tokens - accepted) / (engine.stats.num_verify_steps - steps)
    assert per_step > 1.0, f"a trained head should land drafts ({per_step:.2f} accepted per step)"
    proposer = engine.pool.get("eagle")
    assert proposer.block_manager.num_free_blocks == proposer.block_manager.num_blocks  # released


def test_random_head_is_greedy_lossless(eagle_engine, random_head_dir, generate, plain_outputs):
    engine = eagle_engine(random_head_dir, adaptive=False, num_tokens=8, width=3)
    drafted = engine.stats.num_draft_tokens
    assert generate(engine, PROMPTS, greedy(speculator="eagle")) == plain_outputs
    assert engine.stats.num_draft_tokens > drafted


def test_seeded_sampling_with_eagle_equals_plain_sampling(eagle_engine, trained_head, generate):
    engine = eagle_engine(trained_head)

    def params(speculator, seed):
        return SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=seed, ignore_eos=True,
                              speculator=speculator)

    plain = generate(engine, PROMPTS[:3], [params("none", s) for s in (5, 6, 7)])
    assert generate(engine, PROMPTS[:3], [params("eagle", s) for s in (5, 6, 7)]) == plain


# ---- training-time test --------------------------------------------------------------------------

def unroll_case(kind: str):
    """(head, tokens [T], the target's features [T-1, F]) for the training-time test."""
    gen = torch.Generator().manual_seed(0)
    if kind == "eagle":
        cfg, t = tiny_config(), 14
        head = random_head(cfg, seed=3).float()
        width = cfg.hidden_size
    else:  # EAGLE-3: fc over three layers' inputs, its own LM head over every other token
        cfg, t = tiny_config(num_layers=8), 12
        head = new_eagle3_head(cfg, torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size), torch.arange(0, 50, 2))
        for p in head.parameters():
            torch.nn.init.normal_(p, std=0.3)
        width = 3 * cfg.hidden_size
    tokens = torch.randint(0, cfg.vocab_size, (t,), generator=gen)
    return head, tokens, torch.randn(t - 1, width, generator=gen)


@torch.no_grad()
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_unrolled_steps_are_the_drafts_the_head_makes_when_serving(kind):
    """Unroll step k at position p equals drafting k + 1 deep from the context 0..p-k
    (tokens teacher-forced): a dense causal pass over the states made from the target's
    features at the context (EAGLE-1: the features; EAGLE-3: fc of them), followed by the
    head's own output states along the chain, written here step by step."""
    from training.common import dense_causal_attention
    from training.eagle import unrolled_predictions
    head, tokens, features = unroll_case(kind)
    t, unroll = len(tokens), 3
    steps = unrolled_predictions(head, tokens, features, unroll)
    for context in range(t - unroll):  # the last true entry: (f_c, token c + 1) at position c
        states, ids = list(head.project(features[:context + 1])), list(tokens[1:context + 2])
        for k in range(unroll):
            p = context + k
            if p > t - 2:
                break
            out = head(torch.stack(ids), torch.arange(len(ids)), torch.stack(states), dense_causal_attention)
            torch.testing.assert_close(steps[k][p], out[-1], atol=1e-5, rtol=1e-5)
            states.append(out[-1])  # the next depth reads this output state
            ids.append(tokens[p + 2] if p + 2 < t else tokens[0])
