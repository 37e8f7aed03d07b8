"""Speculative decoding through the engine, on the default model in float32.

- Tree verification: the logits the target returns for every node of a draft tree (a
  ragged batch with plain decodes and trees, short and long) equal HF transformers'
  logits for the context plus that node's root-to-node path; after committing a path
  that goes through later siblings, decoding goes on from HF's logits.
- Greedy lossless: `ngram` and `lookahead` (chain and tree) give token-for-token the
  output of `--speculator none`, batched, with prompts of different lengths, including
  drafts that are mostly rejected (adaptive sizing off, long drafts), and with stop
  strings, EOS and max_tokens falling inside an accepted run.
- KV accounting: blocks held never exceed what the committed tokens need after a step,
  and the pool is whole again once everything finishes.
- Seeded sampling with one-hot proposers gives the plain run's tokens; per-request
  overrides and bad settings fail clearly.
- The speculation controller hears, after every verify step, each tree node's depth and
  which nodes the accepted path went through.
"""
from __future__ import annotations

import json
import random

import pytest
import torch

from runtime.sampling_params import SamplingParams
from runtime.sequence import Sequence
from runtime.draft_tree import DraftTree
from tests.helpers import greedy, new_engine, toy_speculator

ATOL = 1e-4
RTOL = 1e-5  # float32 logits of ~20 in size: reduction order (thread count, kernels) moves them by ~1e-4

COPY_PROMPT = ("Repeat this list exactly, once: apple, banana, cherry, date, elderberry, fig, grape, "
               "honeydew, kiwi, lemon, mango, nectarine.\nList: apple, banana,")
PROMPTS = [
    COPY_PROMPT,
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
    "The capital of France is",
    "Write a short poem about the sea.",
    "Once upon a time, in a land far away, there lived a young girl who loved to read books about "
    "dragons, knights and the old kings of the north. One day she",
]


@pytest.fixture(scope="module")
def module_engine():
    """This module's own engine: its tests change how it speculates (never engine_f32's)."""
    engine = new_engine()
    yield engine
    engine.close()


@pytest.fixture
def spec_engine(module_engine):
    """module_engine with the default speculation settings, fresh proposers and controller;
    every block free again afterwards."""
    module_engine.update_speculation(speculative_tree_width=None, num_speculative_tokens=None,
                                     adaptive_speculation=True)
    yield module_engine
    assert module_engine.block_manager.num_free_blocks == module_engine.block_manager.num_blocks


# ---- tree verification on the target against HF -------------------------------------------------

@torch.no_grad()
def hf_last_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([token_ids])).logits[0, -1].float()


def random_tree(rng: random.Random, num_nodes: int, vocab: int) -> DraftTree:
    parents = [rng.randrange(-1, i) for i in range(num_nodes)]
    return DraftTree([rng.randrange(vocab) for _ in range(num_nodes)], parents)


def path_tokens(tree: DraftTree, node: int) -> list[int]:
    path = []
    while node != -1:
        path.append(tree.token_ids[node])
        node = tree.parents[node]
    return path[::-1]


def prefill(engine, token_ids: list[int], name: str) -> Sequence:
    """A sequence whose prompt is in the cache except its last token (the root of a tree)."""
    seq = Sequence(name, list(token_ids), greedy(40))
    n = len(token_ids) - 1
    engine.block_manager.may_append(seq, n)
    engine.runner.execute([seq], [n], [False])
    seq.num_computed_tokens = n
    return seq


def test_tree_logits_match_hf_for_every_root_to_node_path(spec_engine, hf_smollm):
    engine = spec_engine
    rng = random.Random(0)
    contexts = [engine.tokenize(p) for p in PROMPTS[:3]]
    trees = [random_tree(rng, 6, 2000), DraftTree([], []), random_tree(rng, 20, 2000)]  # 20: the long path
    seqs = [prefill(engine, ids, f"tree-{i}") for i, ids in enumerate(contexts)]
    try:
        for seq, tree in zip(seqs, trees):
            engine.block_manager.may_append(seq, 1 + len(tree))
        logits = engine.runner.execute(seqs, [1] * 3, [True] * 3, trees)  # [sum(1 + n), V]
        assert logits.shape[0] == sum(1 + len(t) for t in trees)
        row = 0
        for ids, tree in zip(contexts, trees):
            torch.testing.assert_close(logits[row], hf_last_logits(hf_smollm, ids), atol=ATOL, rtol=RTOL)
            for node in range(len(tree)):
                ref = hf_last_logits(hf_smollm, ids + path_tokens(tree, node))
                torch.testing.assert_close(logits[row + 1 + node], ref, atol=ATOL, rtol=RTOL,
                                           msg=lambda m: f"node {node} of a {len(tree)}-node tree: {m}")
            row += 1 + len(tree)
    finally:
        for seq in seqs:
            engine.block_manager.free(seq)


def test_committing_a_path_through_later_siblings_moves_its_kv(spec_engine, hf_smollm):
    """Root with children a, b, c; b has children d, e; accept b then e: their KV moves to the
    two slots after the root, and the next decode step matches HF on context + b + e + x."""
    engine = spec_engine
    ids = engine.tokenize(PROMPTS[1])
    tree = DraftTree([101, 202, 303, 404, 505], [-1, -1, -1, 1, 1])
    seq = prefill(engine, ids, "commit")
    try:
        engine.block_manager.may_append(seq, 1 + len(tree))
        engine.runner.execute([seq], [1], [True], [tree])
        root = seq.num_computed_tokens
        accepted = [1, 4]
        src = [engine.block_manager.slot(seq, root + 1 + node) for node in accepted]
        dst = [engine.block_manager.slot(seq, root + 1 + depth) for depth in range(len(accepted))]
        engine.runner.commit_accepted(src, dst)
        seq.num_computed_tokens = root + 1 + len(accepted)
        engine.block_manager.truncate(seq, seq.num_computed_tokens)
        seq.token_ids += [202, 505, 7]
        engine.block_manager.may_append(seq, 1)
        logits = engine.runner.execute([seq], [1], [True])
        ref = hf_last_logits(hf_smollm, ids + [202, 505, 7])
        torch.testing.assert_close(logits[0], ref, atol=ATOL, rtol=RTOL)
    finally:
        engine.block_manager.free(seq)


# ---- greedy lossless through the engine -----------------------------------------------------------

@pytest.fixture(scope="module")
def plain_outputs(engine_f32, generate):
    return generate(engine_f32, PROMPTS, greedy(speculator="none"))


@pytest.mark.parametrize("speculator, width", [("ngram", 1), ("lookahead", 1), ("lookahead", 3)])
def test_greedy_speculation_is_lossless_batched(spec_engine, generate, plain_outputs, speculator, width):
    spec_engine.update_speculation(speculative_tree_width=width)
    draft_before = spec_engine.stats.num_draft_tokens
    outputs = generate(spec_engine, PROMPTS, greedy(speculator=speculator))
    for i, (out, ref) in enumerate(zip(outputs, plain_outputs)):
        assert out == ref, f"prompt {i} differs from plain decoding"
    assert spec_engine.stats.num_draft_tokens > draft_before, "nothing was speculated"


def test_mostly_rejected_drafts_stay_lossless_and_return_every_block(spec_engine, generate, plain_outputs):
    """Fixed long drafts (no adaptive sizing) from single-token matches on open text: most
    drafts miss; the output is still plain decoding's, and the pool is whole afterwards."""
    engine = spec_engine
    engine.update_speculation(adaptive_speculation=False, speculative_tree_width=2)
    stats = engine.stats
    drafted, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
    params = greedy(speculator="lookahead", num_speculative_tokens=12)
    outputs = generate(engine, PROMPTS, params)
    assert outputs == plain_outputs
    num_drafted, num_accepted = stats.num_draft_tokens - drafted, stats.num_accepted_tokens - accepted
    assert num_drafted > 200 and num_accepted < 0.5 * num_drafted, (num_drafted, num_accepted)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_blocks_held_match_committed_tokens_after_every_step(spec_engine):
    engine = spec_engine
    engine.update_speculation(adaptive_speculation=False)
    bm = engine.block_manager
    ids = [engine.add_request(p, greedy(60, speculator="lookahead", num_speculative_tokens=10)) for p in PROMPTS]
    try:
        while engine.has_unfinished:
            engine.step()
            for seq in engine.scheduler.running:
                assert len(seq.block_table) == bm.num_blocks_for(seq.num_computed_tokens), seq.request_id
            held = sum(len(s.block_table) for s in engine.scheduler.running)
            assert bm.num_used_blocks == held
    finally:
        for rid in ids:
            engine.abort(rid)
    assert bm.num_free_blocks == bm.num_blocks


def test_stop_string_eos_and_max_tokens_inside_an_accepted_run(spec_engine, engine_f32):
    """The copy prompt accepts long runs; every stop condition must cut them exactly where
    plain decoding stops, with the same text and finish reason."""
    engine = spec_engine
    cases = [dict(max_tokens=7), dict(max_tokens=23), dict(max_tokens=40, stop=["grape"]),
             dict(max_tokens=40, stop=[", kiwi"], include_stop_str_in_output=True),
             dict(max_tokens=60, ignore_eos=False)]
    for case in cases:
        results = {}
        for speculator in ("none", "lookahead"):
            params = SamplingParams(temperature=0.0, speculator=speculator, **{"ignore_eos": True, **case})
            rid = engine.add_request(COPY_PROMPT, params)
            while engine.has_unfinished:
                for out in engine.step():
                    if out.finished:
                        assert out.request_id == rid
                        results[speculator] = (out.token_ids, out.text, out.finish_reason)
        assert results["lookahead"] == results["none"], case


def test_copying_prompt_accepts_long_runs(spec_engine):
    engine = spec_engine
    rid = engine.add_request(COPY_PROMPT, greedy(30, speculator="lookahead"))
    metrics = None
    while engine.has_unfinished:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                metrics = out.metrics
    assert metrics.num_verify_steps > 0
    assert metrics.mean_acceptance_length > 2.0, metrics.as_dict()
    assert metrics.forwards_per_token < 0.6, metrics.as_dict()
    assert sum(metrics.accepted_per_position[:1]) <= metrics.num_verify_steps
    assert metrics.accepted_per_position == sorted(metrics.accepted_per_position, reverse=True)


# ---- sampling, overrides, settings ------------------------------------------------------------------

def test_seeded_sampling_with_one_hot_speculation_equals_plain_sampling(spec_engine, generate):
    """One-hot proposals are verified in the coupled form (one draw per emitted token), so a
    seeded request samples exactly what it samples without speculation, whatever the drafts."""
    def params(speculator, seed):
        return SamplingParams(temperature=0.8, top_p=0.95, max_tokens=30, seed=seed, ignore_eos=True,
                              speculator=speculator)

    prompts = [COPY_PROMPT, PROMPTS[3], PROMPTS[1]]
    plain = generate(spec_engine, prompts, [params("none", s) for s in (11, 12, 13)])
    drafted = spec_engine.stats.num_draft_tokens
    for speculator in ("lookahead", "ngram"):
        assert generate(spec_engine, prompts, [params(speculator, s) for s in (11, 12, 13)]) == plain
    assert spec_engine.stats.num_accepted_tokens > 0 and spec_engine.stats.num_draft_tokens > drafted
    assert all(len(out) == 30 for out in plain)


def test_request_overrides_and_bad_settings(spec_engine):
    engine = spec_engine
    with pytest.raises(ValueError, match="medusa-heads"):  # medusa: this engine has no Medusa heads
        engine.add_request("hi", SamplingParams(speculator="medusa"))
    with pytest.raises(ValueError, match="without one"):  # draft: this engine has no draft model
        engine.add_request("hi", SamplingParams(speculator="draft"))
    with pytest.raises(ValueError, match="unknown speculator"):  # the engine knows its speculators
        engine.add_request("hi", SamplingParams(speculator="medusa2"))
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SamplingParams(num_speculative_tokens=-1)
    assert not engine.has_unfinished
    from runtime.config import EngineConfig
    with pytest.raises(ValueError, match="unknown speculator"):
        EngineConfig(speculator="bogus")
    with pytest.raises(ValueError, match="prompt_lookup"):
        EngineConfig(prompt_lookup_min=3, prompt_lookup_max=2)


def test_generate_cli_speculates_and_reports(tmp_path, spec_engine, capsys):
    from runtime import generate as cli
    from runtime.llm import LLM

    llm = LLM.__new__(LLM)
    llm.engine, llm.tokenizer, llm.last_summary = spec_engine, spec_engine.tokenizer, None
    lines = [{"prompt": COPY_PROMPT, "max_tokens": 20, "temperature": 0, "speculator": "lookahead"},
             {"prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0, "speculator": "medusa"},
             {"prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0, "num_speculative_tokens": -2}]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    dst = tmp_path / "out.jsonl"
    assert cli.main(["--input", str(src), "--output", str(dst)], llm=llm) == cli.EXIT_SKIPPED
    [record] = [json.loads(line) for line in dst.read_text().splitlines()]
    assert record["metrics"]["num_verify_steps"] > 0 and record["metrics"]["mean_acceptance_length"] > 1
    err = capsys.readouterr().err
    assert "in.jsonl:2: skipped" in err and "medusa-heads" in err
    assert "in.jsonl:3: skipped" in err and "acceptance" in err


def test_generate_cli_refuses_a_speculator_without_its_head(tmp_path, capsys):
    from runtime import generate as cli
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    assert cli.main(["--input", str(src), "--output", str(tmp_path / "o.jsonl"), "--speculator", "medusa"]) == 2
    assert "medusa-heads" in capsys.readouterr().err


def test_proposers_asking_for_them_get_the_targets_logits_and_hidden_state_at_the_last_token(spec_engine, generate):
    """A proposer with needs_logits / needs_hidden_states sees, each step, the target's output
    at the sequence's last token: in greedy decoding its argmax is that token's successor,
    which is exactly the token the sequence ends with; and the hidden state gives those logits."""
    from speculators.ngram import NGramProposer

    engine = spec_engine
    seen = []

    class Recording(NGramProposer):
        needs_logits = True
        needs_hidden_states = True

        def propose(self, requests):
            for r in requests:
                seen.append((list(r.token_ids), r.last_logits, r.last_hidden))
            return super().propose(requests)

    name = toy_speculator("recording-ngram", Recording(1, 3))
    engine.update_speculation(adaptive_speculation=False)  # propose every step
    generate(engine, [COPY_PROMPT, PROMPTS[2]], greedy(24, speculator=name))
    assert len(seen) > 10  # adaptive, a noisy machine once found drafting not worth it (2 calls)
    for token_ids, logits, hidden in seen:
        assert int(logits.argmax()) == token_ids[-1]
        torch.testing.assert_close(engine.model.compute_logits(hidden[None])[0], logits, rtol=RTOL, atol=ATOL)


def test_the_controller_hears_which_tree_nodes_were_accepted(spec_engine, generate):
    """An oracle proposer knows the plain greedy output and drafts [a wrong token, the right
    one, its right successor]: every verify step must report depths [1, 1, 2] and nodes
    1 and 2 accepted to the speculation controller, whose curve then says so."""
    from speculators.base import Proposer

    engine = spec_engine
    [plain] = generate(engine, [PROMPTS[3]], greedy(24))
    expected = plain

    class Oracle(Proposer):
        name = "oracle"

        def propose(self, requests):
            trees = []
            for r in requests:
                done = len(r.token_ids) - r.num_prompt_tokens  # output tokens so far
                right, after = expected[done], expected[done + 1]
                trees.append(DraftTree([(right + 1) % 49152, right, after], [-1, -1, 1]))
            return trees

    heard = []
    engine.update_speculation(adaptive_speculation=False)
    controller = engine.pool.controller
    observe_tree = controller.observe_tree

    def spy(request_id, node_depths, accepted_nodes):
        heard.append((list(node_depths), list(accepted_nodes)))
        observe_tree(request_id, node_depths, accepted_nodes)

    controller.observe_tree = spy  # listens in; the engine's own controller still decides
    name = toy_speculator("oracle", Oracle())
    [out] = generate(engine, [PROMPTS[3]], greedy(22, speculator=name, num_speculative_tokens=3))
    assert out == expected[:22]
    for depths, accepted in heard:  # the last step's tree is cut to what max_tokens leaves
        assert depths == [1, 1, 2][:len(depths)] and accepted == [1, 2][:len(depths) - 1], heard
    assert sum(len(depths) == 3 for depths, _ in heard) >= 5
    # the curve of all requests: from the chain prior (0.6, 0.36, 0.216) toward (0, 1, 1),
    # node k moved once per step that had it
    steps = [sum(len(depths) > k for depths, _ in heard) for k in range(3)]
    keep = [(1 - controller.shared_smoothing) ** n for n in steps]
    assert controller.shared.hits == pytest.approx([0.6 * keep[0], 1 - 0.64 * keep[1], 1 - 0.784 * keep[2]])
    assert controller.shared.depths == pytest.approx([1, 1, 2])
