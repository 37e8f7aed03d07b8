"""Medusa heads (speculators/medusa.py, training/medusa.py) on the default model.

- Tree compile: a choices list gives the expected parents, depths, ranks and attention
  mask; bad lists fail clearly.
- Loading a checkpoint written in the public Medusa layout (built here with the public
  names and shapes): the heads compute x + SiLU(W x + b) then the projection, by hand.
- Heads that read the root token: x + SiLU(W x + U e + b) by hand, the same as Medusa's
  heads while U is fresh (zero), checkpoints keep it, the proposer feeds the sequence's
  last token.
- A draft vocabulary: the heads' logits are the full heads' logits of those tokens, and
  proposals are target ids; checkpoints keep it.
- Labels: the target's greedy tokens along the written path, cut where it leaves it.
- Greedy lossless, batched, float32: heads that read the root token trained briefly on the test prompts' own plain
  outputs (so many drafts are accepted) and random heads (mostly rejected) both give the
  output of `--speculator none`; every KV block comes back.
- Seeded sampling with Medusa's one-hot proposals equals plain sampling.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from runtime.sampling_params import SamplingParams
from speculators.base import ProposalRequest
from speculators.medusa import (CompiledTree, MedusaHeads, MedusaProposer, default_choices, load_choices,
                                load_heads, save_heads)
from speculators.base import IGNORE
from training.common import Sample, dense_causal_attention, draft_vocabulary
from training.medusa import (evaluate_medusa, medusa_data, medusa_labels, step_acceptance, train_medusa,
                             tree_acceptance)
from runtime.draft_tree import DraftTree
from tests.helpers import greedy, save_random_medusa_heads

PROMPTS = [
    "Repeat this list exactly, once: apple, banana, cherry, date, elderberry, fig, grape.\nList: apple,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):",
    "The capital of France is",
    "Write a short poem about the sea.",
]


# ---- the tree -------------------------------------------------------------------------------------

def test_choices_compile_to_parents_depths_ranks_and_mask():
    choices = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    tree = CompiledTree(list(reversed(choices)))  # any order in; (depth, path) order out
    assert tree.paths == choices
    assert tree.parents == [-1, -1, 0, 0, 1, 2]
    assert tree.depths == [1, 1, 2, 2, 2, 3]
    assert tree.ranks == [0, 1, 0, 1, 0, 0]
    assert tree.max_depth == 3 and tree.top_k == 2
    mask = DraftTree(list(range(6)), tree.parents).attention_mask()
    expected = torch.zeros(7, 7, dtype=torch.bool)  # row r sees the root, itself and its ancestors
    ancestors = {1: [], 2: [], 3: [1], 4: [1], 5: [2], 6: [3, 1]}
    for row, up in ancestors.items():
        expected[row, [0, row, *up]] = True
    expected[0, 0] = True
    assert torch.equal(mask, expected)


def test_bad_choices_fail_clearly(tmp_path):
    with pytest.raises(ValueError, match="no parent path"):
        CompiledTree([(0,), (1, 0)])
    with pytest.raises(ValueError, match="twice"):
        CompiledTree([(0,), (0,)])
    bad = tmp_path / "tree.json"
    bad.write_text('{"not": "a list"}')
    with pytest.raises(ValueError, match="JSON list of lists"):
        load_choices(bad)
    good = tmp_path / "good.json"
    good.write_text("[[0], [0, 0], [1]]")
    assert load_choices(good) == [(0,), (0, 0), (1,)]


def test_default_tree_is_every_path_with_a_bounded_rank_sum():
    assert len(default_choices(4, 2)) == 3 + 6 + 10 + 15
    choices = default_choices(4)
    assert len(choices) == 9 + 45 + 165 + 495  # ranks summing to at most 8, 1 to 4 deep
    assert all(sum(c) <= 8 and 1 <= len(c) <= 4 for c in choices)
    tree = CompiledTree(choices)  # every parent is present
    assert tree.top_k == 9  # the default Medusa tree width keeps all of it


# ---- checkpoints in the public layout ---------------------------------------------------------------

def test_loads_a_checkpoint_in_the_public_medusa_layout(tmp_path):
    torch.manual_seed(0)
    hidden, vocab, num_heads = 16, 40, 3
    public = {}
    for k in range(num_heads):
        public[f"medusa_head.{k}.0.linear.weight"] = torch.randn(hidden, hidden) * 0.3
        public[f"medusa_head.{k}.0.linear.bias"] = torch.randn(hidden) * 0.1
        public[f"medusa_head.{k}.1.weight"] = torch.randn(vocab, hidden)
    save_file(public, str(tmp_path / "medusa_lm_head.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": num_heads, "medusa_num_layers": 1,
                                                      "base_model_name_or_path": "some/base"}))
    heads = load_heads(tmp_path, hidden, vocab, lm_head=torch.nn.Linear(hidden, vocab, bias=False))
    assert heads.num_heads == num_heads and not heads.shares_lm_head
    x = torch.randn(5, hidden)
    for k in range(num_heads):
        w, b, proj = (public[f"medusa_head.{k}.0.linear.weight"], public[f"medusa_head.{k}.0.linear.bias"],
                      public[f"medusa_head.{k}.1.weight"])
        expected = (x + torch.nn.functional.silu(x @ w.T + b)) @ proj.T
        torch.testing.assert_close(heads(x)[:, k], expected)
    # our own checkpoints round-trip, shared LM head included
    shared = torch.nn.Linear(hidden, vocab, bias=False)
    ours = MedusaHeads(hidden, vocab, 2, 2, shared)
    for p in ours.parameters():
        torch.nn.init.normal_(p, std=0.2)
    save_heads(ours, tmp_path / "ours")
    again = load_heads(tmp_path / "ours", hidden, vocab, shared)
    assert again.shares_lm_head and again.num_layers == 2
    torch.testing.assert_close(again(x), ours(x))
    with pytest.raises(ValueError, match="hidden_size"):
        load_heads(tmp_path / "ours", hidden + 1, vocab, shared)
    with pytest.raises(ValueError, match="shape"):
        load_heads(tmp_path, hidden, vocab + 1, shared)


def test_heads_that_read_the_root_token(tmp_path):
    torch.manual_seed(4)
    hidden, vocab, num_heads = 16, 40, 3
    embedding, lm_head = torch.nn.Embedding(vocab, hidden), torch.nn.Linear(hidden, vocab, bias=False)
    plain = MedusaHeads(hidden, vocab, num_heads, 1, None)
    for p in plain.parameters():
        torch.nn.init.normal_(p, std=0.3)
    reading = MedusaHeads(hidden, vocab, num_heads, 1, None, reads_token=True, embedding=embedding)
    missing = reading.load_state_dict(plain.state_dict(), strict=False).missing_keys
    assert sorted(missing) == [f"blocks.{k}.0.token_linear.weight" for k in range(num_heads)]
    x, roots = torch.randn(5, hidden), torch.tensor([0, 7, 7, 39, 12])
    with torch.no_grad():
        torch.testing.assert_close(reading(x, roots), plain(x))  # U starts at zero: Medusa's heads
        for block in reading.blocks:
            torch.nn.init.normal_(block[0].token_linear.weight, std=0.3)
        for k in range(num_heads):
            res, proj = reading.blocks[k][0], reading.lm_heads[k].weight
            pre = x @ res.linear.weight.T + embedding(roots) @ res.token_linear.weight.T + res.linear.bias
            torch.testing.assert_close(reading(x, roots)[:, k], (x + torch.nn.functional.silu(pre)) @ proj.T)
        assert not torch.allclose(reading(x, roots), reading(x, roots.flip(0)))
        with pytest.raises(ValueError, match="root token"):
            reading(x)
    with pytest.raises(ValueError, match="num_layers >= 1"):
        MedusaHeads(hidden, vocab, num_heads, 0, None, reads_token=True, embedding=embedding)
    save_heads(reading, tmp_path / "reading")
    again = load_heads(tmp_path / "reading", hidden, vocab, lm_head, embedding)
    assert again.reads_token and json.loads((tmp_path / "reading" / "config.json").read_text())["reads_token"]
    with torch.no_grad():
        torch.testing.assert_close(again(x, roots), reading(x, roots))
    with pytest.raises(ValueError, match="embedding"):
        load_heads(tmp_path / "reading", hidden, vocab, lm_head)
    # the proposer's root is the sequence's last token (the target's bonus or recovered one)
    proposer = MedusaProposer(again, CompiledTree([(0,), (0, 0)]), torch.device("cpu"))
    for last in (7, 39):
        [tree] = proposer.propose([ProposalRequest("r", [3, 5, last], 1, 100, 3, SamplingParams(temperature=0.0),
                                                   last_hidden=x[0])])
        with torch.no_grad():
            assert tree.token_ids == again(x[:1], torch.tensor([last]))[0, :2].argmax(-1).tolist()


def test_draft_vocabulary_heads_score_their_tokens_and_round_trip(tmp_path):
    torch.manual_seed(2)
    hidden, vocab = 8, 40
    draft_vocab = torch.tensor([0, 3, 4, 9, 17, 21, 33, 39])  # [Vd] target ids
    shared = torch.nn.Linear(hidden, vocab, bias=False)
    full = MedusaHeads(hidden, vocab, 3, 1, shared)
    for p in full.parameters():
        torch.nn.init.normal_(p, std=0.5)
    small = MedusaHeads(hidden, vocab, 3, 1, shared, len(draft_vocab))
    small.load_state_dict(full.state_dict() | {"d2t": torch.zeros(len(draft_vocab), dtype=torch.long)})
    small.set_draft_vocab(draft_vocab)
    x = torch.randn(5, hidden)
    with torch.no_grad():
        torch.testing.assert_close(small(x), full(x)[:, :, draft_vocab])
    assert small.draft_ids(torch.tensor([9, 10, IGNORE])).tolist() == [3, IGNORE, IGNORE]
    save_heads(small, tmp_path / "small")
    again = load_heads(tmp_path / "small", hidden, vocab, shared)
    assert again.draft_vocab_size == len(draft_vocab) and again.shares_lm_head
    with torch.no_grad():
        torch.testing.assert_close(again(x), small(x))
    proposer = MedusaProposer(again, CompiledTree(default_choices(3)), torch.device("cpu"))  # 9 wide, 8 tokens
    [tree, wide] = proposer.propose(
        [ProposalRequest("r", [1, 2], 1, 1000, width, SamplingParams(temperature=0.0), last_hidden=x[0])
         for width in (3, 9)])
    assert set(tree.token_ids) <= set(draft_vocab.tolist())
    assert len(wide) == sum(max(c) < len(draft_vocab) for c in default_choices(3))  # ranks the vocabulary has
    siblings = [(parent, token) for parent, token in zip(wide.parents, wide.token_ids)]
    assert len(set(siblings)) == len(siblings)  # no token twice below one node
    with torch.no_grad():
        assert tree.token_ids[0] == int(draft_vocab[small(x[:1])[0, 0].argmax()])  # head 0's best, as a target id


def test_medusa_labels_are_the_greedy_path_along_the_written_one():
    # the target wrote 10 11 12 13 14 15; its greedy token after each position is below
    # (after position 2 it would have written 20, not 13: a sampled token)
    tokens = torch.tensor([10, 11, 12, 13, 14, 15])
    greedy = torch.tensor([11, 12, 20, 14, 15, 16])
    labels = medusa_labels(tokens, greedy, torch.arange(0, 4), num_heads=3)
    assert labels.tolist() == [
        [12, 20, IGNORE],  # p = 0: 11 and 12 are greedy, then 13 was a draw where greedy says 20
        [20, IGNORE, IGNORE],  # p = 1: root 12 is greedy; a greedy request verifies 20 next, not 13
        [IGNORE, IGNORE, IGNORE],  # p = 2: the root 13 itself was not greedy
        [15, IGNORE, IGNORE],  # p = 3: 14 greedy -> 15; token 6 was never written
    ]
    # heads that read the root token are given the written p + 1, greedy or not
    assert medusa_labels(tokens, greedy, torch.arange(0, 4), num_heads=3, reads_token=True).tolist() == [
        [12, 20, IGNORE], [20, IGNORE, IGNORE],
        [14, 15, IGNORE],  # p = 2: root 13 was a draw, but the heads see it; 14 and 15 follow greedily
        [15, IGNORE, IGNORE]]
    # a greedy corpus: the labels are the written tokens
    written = torch.tensor([10, 11, 12, 20, 14, 15])
    labels = medusa_labels(written, torch.tensor([11, 12, 20, 14, 15, 16]), torch.arange(0, 3), num_heads=2)
    assert labels.tolist() == [[12, 20], [20, 14], [14, 15]]


def test_proposer_keeps_the_best_nodes_within_budget_and_width():
    torch.manual_seed(1)
    hidden, vocab = 8, 30
    heads = MedusaHeads(hidden, vocab, 3, 1, None)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=1.0)
    choices = default_choices(3, 2)
    proposer = MedusaProposer(heads, CompiledTree(choices), torch.device("cpu"))
    h = torch.randn(hidden)
    params = SamplingParams(temperature=0.0)
    with torch.no_grad():
        probs = heads(h[None])[0].softmax(-1)  # [K, V]

    def request(max_nodes, width):
        return ProposalRequest("r", [1, 2, 3], 2, max_nodes, width, params, last_hidden=h)

    [full] = proposer.propose([request(100, 3)])
    assert len(full) == len(choices)
    [chain] = proposer.propose([request(100, 1)])
    assert chain.is_chain and chain.token_ids == probs.argmax(-1).tolist()
    [small] = proposer.propose([request(5, 3)])
    assert len(small) == 5
    [narrow] = proposer.propose([request(100, 2)])  # ranks 0 and 1 only
    assert len(narrow) == sum(max(c) < 2 for c in choices)
    for tree in (full, small, narrow):
        assert all(tree.parents[i] < i for i in range(len(tree)))  # parents first: a tree in any prefix
    # batched, with a budget and width each, as one at a time
    assert proposer.propose([request(5, 3), request(100, 2), request(100, 1)]) == [small, narrow, chain]
    # the 5 kept are the 5 best paths by product of head probabilities
    def value(tree, i):
        v, node = 1.0, i
        while node >= 0:
            v *= float(probs[tree.depths[node] - 1, tree.token_ids[node]])
            node = tree.parents[node]
        return v
    full_values = sorted((value(full, i) for i in range(len(full))), reverse=True)
    assert sorted((value(small, i) for i in range(5)), reverse=True) == pytest.approx(full_values[:5])
    assert proposer.propose([ProposalRequest("r", [1], 1, 4, 3, params)]) == [DraftTree([], [])]  # no hidden yet


def test_validation_tree_acceptance_is_what_verifying_the_proposers_tree_accepts():
    # the proposer's trees for random heads, walked as greedy verification walks them
    # (at each depth the child holding the target's token, if any), against labels drawn
    # from each head's top candidates so that paths often match
    torch.manual_seed(2)
    hidden, vocab, num_heads, max_nodes, n = 8, 12, 3, 7, 200
    heads = MedusaHeads(hidden, vocab, num_heads, 1, None)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=1.0)
    tree = CompiledTree(default_choices(num_heads))
    proposer = MedusaProposer(heads, tree, torch.device("cpu"))
    states = torch.randn(n, hidden)
    with torch.no_grad():
        logits = heads(states)  # [n, K, V]
    top3 = logits.topk(3, dim=-1).indices  # [n, K, 3]
    labels = top3.gather(2, torch.randint(0, 3, (n, num_heads, 1))).squeeze(2)  # [n, K]
    labels[::5, 1] = IGNORE  # a missing label ends the accepted path there
    params = SamplingParams(temperature=0.0)
    accepted = []
    for row in range(n):
        [draft] = proposer.propose([ProposalRequest("r", [1, 2], 1, max_nodes, tree.top_k, params,
                                                    last_hidden=states[row])])
        node, depth = -1, 0
        while depth < num_heads:
            children = [i for i in range(len(draft)) if draft.parents[i] == node
                        and draft.token_ids[i] == int(labels[row, depth])]
            if not children:
                break
            node, depth = children[0], depth + 1
        accepted.append(1 + depth)
    assert 1.3 < sum(accepted) / n  # the labels match often enough for the check to mean something
    assert tree_acceptance(logits, labels, tree, max_nodes) == pytest.approx(sum(accepted) / n)
    assert tree_acceptance(logits, labels, CompiledTree([(0,), (0, 0), (0, 0, 0)]), 3) == pytest.approx(
        1 + (logits.argmax(-1) == labels).int().cumprod(dim=1).sum(dim=1).float().mean())  # a chain: chain acceptance

def test_step_acceptance_walks_each_sample_as_a_decode_does():
    # per-position accepted lengths of two samples (6 and 2 positions): the first is walked
    # at positions 0, 2, 5 (2 + 3 + 1 tokens: the sample ends after 1 more), the second,
    # from its own start, at 0, 1 (1 + 1)
    accepted = torch.tensor([2, 1, 3, 1, 1, 2, 1, 2])
    assert step_acceptance(accepted, [6, 2]) == pytest.approx((2 + 3 + 1 + 1 + 1) / 5)
    assert step_acceptance(accepted, [8]) == pytest.approx((2 + 3 + 2 + 1) / 4)  # one sample: 0, 2, 5, 7


# ---- through the engine ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain_outputs(engine_f32, generate):
    return generate(engine_f32, PROMPTS, greedy(speculator="none"))


@pytest.fixture(scope="module")
def trained_heads(engine_f32, plain_outputs, tmp_path_factory):
    """Heads trained for a few seconds on the test prompts' own plain outputs (overfit on
    purpose, so that many drafts are accepted)."""
    torch.manual_seed(0)
    model = engine_f32.model
    samples = [Sample(engine_f32.tokenize(p) + out, len(engine_f32.tokenize(p)))
               for p, out in zip(PROMPTS, plain_outputs)]
    data = medusa_data(model, samples, num_heads=3, reads_token=True, progress=False)
    cfg = model.config
    draft_vocab = draft_vocabulary(samples, 4096, cfg.eos_token_ids)  # every token the outputs wrote
    heads = MedusaHeads(cfg.hidden_size, cfg.vocab_size, 3, 1, model.lm_head, len(draft_vocab), True,
                        model.embed_tokens)
    heads.set_draft_vocab(draft_vocab)
    result = train_medusa(heads, data, data, steps=120, lr=3e-3, batch_size=64, eval_every=120,
                          progress=False)
    assert result["val_chain_acceptance"] > 1.5, result  # it learned the outputs it was shown
    return save_heads(heads, tmp_path_factory.mktemp("medusa") / "trained")


@pytest.fixture(scope="module")
def random_heads(engine_f32, tmp_path_factory):
    return save_random_medusa_heads(engine_f32.model, tmp_path_factory.mktemp("medusa") / "random")


@pytest.fixture
def medusa_engine(head_engine_f32):
    """head_engine_f32 with Medusa heads set per test (LLMEngine.update_speculation: fresh
    proposers and controller); every block free again afterwards."""
    engine = head_engine_f32

    def use(heads_dir, adaptive=True, num_tokens=None):
        engine.update_speculation(medusa_heads=str(heads_dir), adaptive_speculation=adaptive,
                                  num_speculative_tokens=num_tokens)
        return engine

    yield use
    engine.update_speculation(medusa_heads=None, adaptive_speculation=True, num_speculative_tokens=None)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_trained_heads_are_greedy_lossless_and_accept_drafts(medusa_engine, trained_heads, generate, plain_outputs):
    engine = medusa_engine(trained_heads, adaptive=False, num_tokens=12)
    drafted, accepted = engine.stats.num_draft_tokens, engine.stats.num_accepted_tokens
    steps = engine.stats.num_verify_steps
    outputs = generate(engine, PROMPTS, greedy(speculator="medusa"))
    for i, (out, ref) in enumerate(zip(outputs, plain_outputs)):
        assert out == ref, f"prompt {i} differs from plain decoding"
    assert engine.stats.num_draft_tokens > drafted
    new_accepted = engine.stats.num_accepted_tokens - accepted
    assert new_accepted / (engine.stats.num_verify_steps - steps) > 0.5, "trained heads should land drafts"


def test_validation_acceptance_per_step_is_what_the_engine_measures(medusa_engine, trained_heads, generate):
    """The training's validation figure on greedy answers to prompts the heads were not
    trained on (so that some steps accept their whole path and some do not) against the
    engine's own count, decoding those prompts with a fixed tree of the same size."""
    prompts = ["Name three colours of the rainbow.", "def mul(a, b):", "Once upon a time,"]
    engine = medusa_engine(trained_heads, adaptive=False, num_tokens=12)
    answers = generate(engine, prompts, greedy(speculator="none"))
    model, cfg = engine.model, engine.model.config
    heads = load_heads(trained_heads, cfg.hidden_size, cfg.vocab_size, model.lm_head, model.embed_tokens)
    samples = [Sample(engine.tokenize(p) + out, len(engine.tokenize(p))) for p, out in zip(prompts, answers)]
    figures = evaluate_medusa(heads, medusa_data(model, samples, heads.num_heads, True, progress=False),
                              max_nodes=12)
    accepted, steps = engine.stats.num_accepted_tokens, engine.stats.num_verify_steps
    assert generate(engine, prompts, greedy(speculator="medusa")) == answers
    measured = 1 + (engine.stats.num_accepted_tokens - accepted) / (engine.stats.num_verify_steps - steps)
    # neither every draft rejected (1.0: twice the tolerance below) nor every path accepted
    assert 1.1 < measured < 3.5, measured
    assert figures["val_tree_acceptance"] == pytest.approx(measured, abs=0.05)


def test_random_heads_are_greedy_lossless(medusa_engine, random_heads, generate, plain_outputs):
    engine = medusa_engine(random_heads, adaptive=False, num_tokens=8)
    drafted = engine.stats.num_draft_tokens
    outputs = generate(engine, PROMPTS, greedy(speculator="medusa"))
    assert outputs == plain_outputs
    assert engine.stats.num_draft_tokens > drafted


def test_seeded_sampling_with_medusa_equals_plain_sampling(medusa_engine, trained_heads, generate):
    engine = medusa_engine(trained_heads)

    def params(speculator, seed):
        return SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=seed, ignore_eos=True,
                              speculator=speculator)

    plain = generate(engine, PROMPTS[:3], [params("none", s) for s in (5, 6, 7)])
    assert generate(engine, PROMPTS[:3], [params("medusa", s) for s in (5, 6, 7)]) == plain


def test_medusa_needs_heads(engine_f32):
    from runtime.config import EngineConfig
    with pytest.raises(ValueError, match="medusa-heads"):
        EngineConfig(speculator="medusa")
    assert engine_f32.config.medusa_heads is None
    with pytest.raises(ValueError, match="medusa-heads"):
        engine_f32.add_request("hi", SamplingParams(speculator="medusa"))
    assert not engine_f32.has_unfinished


def test_training_script_starts_from_a_checkpoint(engine_f32, trained_heads, plain_outputs, tmp_path):
    """scripts/train_medusa.py --init-heads trains the checkpoint's heads (3 of them, not
    the default 4): with a learning rate of 0 it writes them back unchanged."""
    from scripts import train_medusa
    from training.common import save_corpus
    samples = [Sample(engine_f32.tokenize(p) + out, len(engine_f32.tokenize(p)))
               for p, out in zip(PROMPTS, plain_outputs)]
    save_corpus(samples, tmp_path / "corpus.jsonl.gz", "smollm2-135m")  # compressed, as shipped corpora are
    out = tmp_path / "resumed"
    assert train_medusa.main(["--enforce-eager", "--out", str(out), "--corpus", str(tmp_path / "corpus.jsonl.gz"), "--init-heads",
                              str(trained_heads), "--steps", "2", "--lr", "0", "--device", "cpu",
                              "--dtype", "float32", "--val-fraction", "0.25"]) == 0
    lm_head = engine_f32.model.lm_head
    cfg = engine_f32.model.config
    embedding = engine_f32.model.embed_tokens
    before = load_heads(trained_heads, cfg.hidden_size, cfg.vocab_size, lm_head, embedding)
    after = load_heads(out, cfg.hidden_size, cfg.vocab_size, lm_head, embedding)
    assert after.num_heads == 3 and after.reads_token
    for (name, a), b in zip(after.state_dict().items(), before.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
    assert json.loads((out / "config.json").read_text())["training"]["init_heads"] == str(trained_heads)


def test_more_corpora_add_sampled_answers_and_keep_the_validation_prompts_out(plain_outputs, tmp_path):
    """The training scripts' corpora (training.common.self_distillation_corpus): a
    missing corpus is written by the target, the first greedily and a second one sampled;
    validation answers come from the first, and the second's answers to their prompts are
    not trained on."""
    import argparse
    from training.common import add_self_distillation_args, load_corpus, self_distillation_corpus
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:4]))
    parser = argparse.ArgumentParser()
    add_self_distillation_args(parser)
    first, second = tmp_path / "greedy.jsonl", tmp_path / "sampled.jsonl"
    args = parser.parse_args(["--enforce-eager", "--out", str(tmp_path / "out"), "--data", str(prompts), "--corpus", str(first),
                              "--corpus", str(second), "--max-tokens", "8", "--val-fraction", "0.25",
                              "--device", "cpu", "--dtype", "float32"])
    engine, train, val = self_distillation_corpus(args)
    engine.close()
    greedy, sampled = load_corpus(first, "smollm2-135m"), load_corpus(second, "smollm2-135m")
    prompt_of = [s.token_ids[:s.num_prompt_tokens] for s in greedy]
    assert [s.token_ids[:s.num_prompt_tokens] for s in sampled] == prompt_of
    answers = [s.token_ids[s.num_prompt_tokens:] for s in greedy]
    assert all(answers) and answers == [out[:len(a)] for out, a in zip(plain_outputs, answers)]
    assert [s.token_ids for s in greedy] != [s.token_ids for s in sampled]  # sampled, not greedy again
    assert [s.token_ids for s in val] == [greedy[0].token_ids]
    assert sorted(s.token_ids for s in train) == sorted(s.token_ids for s in greedy[1:] + sampled[1:])


def test_corpus_only_writes_the_answers_and_trains_nothing(plain_outputs, tmp_path):
    from scripts import train_medusa
    from training.common import load_corpus
    prompts, corpus, out = tmp_path / "prompts.jsonl", tmp_path / "corpus.jsonl", tmp_path / "out"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:2]))
    assert train_medusa.main(["--enforce-eager", "--out", str(out), "--data", str(prompts), "--corpus", str(corpus), "--max-tokens", "4",
                              "--corpus-only", "--device", "cpu", "--dtype", "float32"]) == 0
    answers = [s.token_ids[s.num_prompt_tokens:] for s in load_corpus(corpus, "smollm2-135m")]
    assert all(answers) and answers == [out[:len(a)] for out, a in zip(plain_outputs, answers)]
    assert not (out / "config.json").exists()


def test_validation_on_other_prompts_keeps_them_out_of_training(plain_outputs, tmp_path):
    """--val-prompts: validation answers are the target's greedy answers to those prompts
    (written once to OUT/val-corpus.jsonl, then read back), every corpus answer is trained
    on except those to a validation prompt."""
    import argparse
    from training.common import add_self_distillation_args, self_distillation_corpus
    train_prompts, val_prompts = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train_prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:3]))
    val_prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in (PROMPTS[3], PROMPTS[0])))
    parser = argparse.ArgumentParser()
    add_self_distillation_args(parser)
    argv = ["--enforce-eager", "--out", str(tmp_path / "out"), "--data", str(train_prompts), "--corpus", str(tmp_path / "c.jsonl"),
            "--val-prompts", str(val_prompts), "--max-tokens", "8", "--device", "cpu", "--dtype", "float32"]
    engine, train, val = self_distillation_corpus(parser.parse_args(argv))
    prompt_ids = [engine.tokenize(p) for p in PROMPTS]
    engine.close()
    for samples, picks in ((val, (3, 0)), (train, (1, 2))):
        assert [s.token_ids[:s.num_prompt_tokens] for s in samples] == [prompt_ids[i] for i in picks]
        answers = [s.token_ids[s.num_prompt_tokens:] for s in samples]
        assert all(answers) and answers == [plain_outputs[i][:len(a)] for i, a in zip(picks, answers)]
    written = (tmp_path / "out" / "val-corpus.jsonl").stat().st_mtime_ns
    engine, _, again = self_distillation_corpus(parser.parse_args(argv))
    engine.close()
    assert [s.token_ids for s in again] == [s.token_ids for s in val]
    assert (tmp_path / "out" / "val-corpus.jsonl").stat().st_mtime_ns == written  # read, not written again


def test_the_shipped_corpora_are_the_default_models_answers(engine_f32, generate):
    """training/data's corpora (what training reads for the default model by default):
    one answer per 'train_large' prompt each, in order, then one per 'train_varied' prompt.
    The float32 greedy one's answers are what our engine writes greedily for those prompts
    (three of them, across the file, checked here). The sampled one (T = 0.8) is this
    model's own text but not its greedy text: the target's greedy token is the written one
    most of the time, not nearly always. The varied one was written greedily in bf16: float32
    greedy agrees with nearly every token."""
    from training.common import default_prompt_file, load_corpus, load_prompts, shipped_corpora
    paths = shipped_corpora("smollm2-135m")
    assert len(paths) == 3 and shipped_corpora("some-other-model") == []
    greedy_samples, sampled, varied = (load_corpus(path, "smollm2-135m") for path in paths)
    prompts = load_prompts(default_prompt_file("train_large"))
    assert len(greedy_samples) == len(sampled) == len(prompts)
    picks = [0, len(prompts) // 2, len(prompts) - 1]
    prompt_ids = [greedy_samples[i].token_ids[:greedy_samples[i].num_prompt_tokens] for i in picks]
    assert prompt_ids == [engine_f32.tokenize(prompts[i]) for i in picks]
    assert [sampled[i].token_ids[:sampled[i].num_prompt_tokens] for i in picks] == prompt_ids
    varied_prompts = load_prompts(default_prompt_file("train_varied"))
    assert len(varied) == len(varied_prompts)
    assert all(varied[i].token_ids[:varied[i].num_prompt_tokens] == engine_f32.tokenize(varied_prompts[i])
               for i in (0, len(varied) // 2, len(varied) - 1))
    outputs = generate(engine_f32, prompt_ids, greedy(max_tokens=24))
    for i, out in zip(picks, outputs):
        answer = greedy_samples[i].token_ids[greedy_samples[i].num_prompt_tokens:]
        assert answer and out[:len(answer)] == answer[:24]

    def agreement(samples):  # how often the target's greedy next token is the written one, over answers
        hits = total = 0
        for s in samples:
            ids = torch.tensor(s.token_ids)
            with torch.no_grad():
                greedy_next = engine_f32.model.compute_logits(
                    engine_f32.model(ids, torch.arange(len(ids)), dense_causal_attention)).argmax(-1)
            written = ids[s.num_prompt_tokens:]
            hits += int((greedy_next[s.num_prompt_tokens - 1:-1] == written).sum())
            total += len(written)
        return hits / total

    step = len(sampled) // 8
    picked_sampled, picked_greedy = sampled[::step][:8], greedy_samples[::step][:8]
    assert sum(a.token_ids != b.token_ids for a, b in zip(picked_sampled, picked_greedy)) >= 6
    assert agreement(picked_greedy) > 0.97  # float32 here as there
    assert 0.45 < agreement(picked_sampled) < 0.92
    assert agreement(varied[::len(varied) // 8][:8]) > 0.95
