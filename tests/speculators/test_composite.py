"""Several proposers in one verify tree (speculators/composite.py, `--speculator a+b`).

- The merge is a trie union: a brute-force comparison of root-to-node paths, shared
  prefixes once, the first tree's nodes first, parents before children.
- The budget split, the features-reading part always asked, the merged tree cut to the
  budget.
- Names: distinct known parts only, through EngineConfig, the CLI and the API's
  `speculation.method`.
- Greedy lossless on the default model, float32, batched: `ngram+lookahead` gives the
  output of `--speculator none` and verifies nodes from both parts (`eagle+lookahead`
  with a trained head: test_eagle3.py).
- The parts are the pool's: `draft+lookahead` with a draft model runs one draft worker,
  shared with the requests that ask for `draft` alone, and a batch of both is lossless;
  a part that fails to draft ahead opens its breaker, never fails a request.
"""
from __future__ import annotations

import argparse
import random

import pytest

from runtime.config import EngineConfig, add_engine_args
from runtime.sampling_params import SamplingParams
from speculators.registry import check_name as check_speculator
from speculators.base import ProposalRequest, Proposer
from speculators.composite import CompositeProposer, merge_trees, split_budget
from runtime.draft_tree import DraftTree
from tests.helpers import new_engine, save_tiny_model, toy_speculator

PROMPTS = [
    "Repeat this list exactly, once: apple, banana, cherry, date, elderberry, fig, grape.\nList: apple,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
    "The capital of France is",
]


def paths(tree: DraftTree) -> set[tuple[int, ...]]:
    """Every root-to-node token path of a tree."""
    out = []
    for i in range(len(tree)):
        path, node = [], i
        while node >= 0:
            path.append(tree.token_ids[node])
            node = tree.parents[node]
        out.append(tuple(reversed(path)))
    return set(out)


def random_tree(rng: random.Random, n: int, vocab: int = 3) -> DraftTree:
    tokens, parents, seen = [], [], set()
    while len(tokens) < n:
        parent = rng.randrange(-1, len(tokens))
        token = rng.randrange(vocab)
        if (parent, token) not in seen:  # a proposer never repeats a child
            seen.add((parent, token))
            tokens.append(token)
            parents.append(parent)
    return DraftTree(tokens, parents)


def path_of(tree: DraftTree, node: int) -> tuple[int, ...]:
    path = []
    while node >= 0:
        path.append(tree.token_ids[node])
        node = tree.parents[node]
    return tuple(reversed(path))


def test_merge_is_the_union_of_paths_each_tree_in_order():
    rng = random.Random(0)
    for _ in range(200):
        trees = [random_tree(rng, rng.randrange(0, 9)) for _ in range(rng.randrange(1, 4))]
        merged = merge_trees(trees)  # DraftTree checks parents come first
        union = set().union(*(paths(t) for t in trees))
        assert paths(merged) == union
        assert len(merged) == len(union)  # each path once
        position = {path_of(merged, i): i for i in range(len(merged))}
        for j, tree in enumerate(trees):  # a tree's own nodes (in no other tree) keep their order
            others = set().union(set(), *(paths(t) for i, t in enumerate(trees) if i != j))
            own = [position[path_of(tree, k)] for k in range(len(tree)) if path_of(tree, k) not in others]
            assert own == sorted(own)


def test_merge_interleaves_in_proportion_to_the_sizes():
    big = DraftTree.chain(list(range(100, 116)))  # 16 nodes
    small = DraftTree([200, 201, 202, 203, 204, 205, 206, 207], [-1, 0, -1, 2, -1, 4, 5, -1])  # 8 nodes
    merged = merge_trees([big, small])
    for n in range(1, 25):  # any prefix holds the trees' nodes about 2 : 1
        from_big = sum(1 for t in merged.token_ids[:n] if t < 200)
        assert abs(from_big - n * 2 / 3) < 1, (n, merged.token_ids[:n])
    assert merged.token_ids[:3] == [100, 101, 200]  # the first tree leads on ties
    assert merged.truncated(12).token_ids == [100, 101, 200, 102, 103, 201, 104, 105, 202, 106, 107, 203]


def test_merge_by_hand():
    eagle = DraftTree([5, 6, 7], [-1, 0, -1])  # 5 -> 6, and 7
    lookahead = DraftTree.chain([5, 6, 8, 9])  # shares 5 -> 6, then 8 -> 9
    merged = merge_trees([eagle, lookahead])  # at 1/3, 2/3, 1 and 1/4, 1/2, 3/4, 1
    assert merged.token_ids == [5, 6, 8, 7, 9]
    assert merged.parents == [-1, 0, 1, -1, 2]


def test_budget_split():
    assert split_budget(24, [16, 8]) == [16, 8]
    assert split_budget(10, [16, 8]) == [7, 3]
    assert split_budget(1, [16, 8]) == [1, 0]
    assert split_budget(7, [1, 1, 1]) == [3, 2, 2]


class Recorder(Proposer):
    """Proposes a chain of its own tokens, max_nodes long, and records what it was asked."""

    def __init__(self, name, base_token, needs_features=False):
        self.name, self.base_token, self.needs_features = name, base_token, needs_features
        self.asked: list[tuple[int, int]] = []  # (max_nodes, tree_width)
        self.accepted, self.released = [], []

    def propose(self, requests):
        self.asked += [(r.max_nodes, r.tree_width) for r in requests]
        return [DraftTree.chain([self.base_token + i for i in range(r.max_nodes)]) for r in requests]

    def on_accepted(self, request_id, token_ids, num_accepted):
        self.accepted.append((request_id, num_accepted))

    def release(self, request_id):
        self.released.append(request_id)


def request(max_nodes: int) -> ProposalRequest:
    return ProposalRequest("r", [1, 2, 3], 2, max_nodes, 4, SamplingParams())


def test_composite_splits_the_budget_and_forwards_bookkeeping():
    head, cache = Recorder("eagle", 100, needs_features=True), Recorder("lookahead", 200)
    composite = CompositeProposer([cache, head], [8, 16], [3, 4])  # the features reader second
    assert composite.name == "lookahead+eagle" and composite.needs_features
    trees = composite.propose([request(24), request(2)])
    assert cache.asked == [(8, 3), (1, 3)] and head.asked == [(16, 4), (1, 4)]  # 2 nodes: 1 + 1
    assert trees[0].token_ids == [t for k in range(8) for t in (100 + 2 * k, 200 + k, 101 + 2 * k)]  # 2 : 1
    assert trees[1].token_ids == [200, 100]
    trees = composite.propose([request(1)])  # the reader still asked: the cut keeps the first part
    assert head.asked[-1] == (1, 4) and trees[0].token_ids == [200]
    composite.on_accepted("r", [1, 2, 3, 200], 1)
    composite.release("r")
    assert cache.accepted == head.accepted == [("r", 1)] and cache.released == head.released == ["r"]


@pytest.mark.parametrize("name", ["eagle+lookahead", "ngram+lookahead", "medusa+ngram+lookahead"])
def test_combined_names_are_accepted(name):
    check_speculator(name)
    assert SamplingParams(speculator=name).speculator == name


@pytest.mark.parametrize("name", ["eagle+eagle", "none+lookahead", "eagle+", "eagle+foo", "EAGLE"])
def test_bad_combined_names_fail_clearly(name):
    with pytest.raises(ValueError, match="unknown speculator"):
        check_speculator(name)
    with pytest.raises(ValueError, match="unknown speculator"):
        EngineConfig(speculator=name)


def test_config_and_cli_know_combined_speculators():
    with pytest.raises(ValueError, match="needs a trained head"):  # a model without a shipped EAGLE head
        EngineConfig(model="another-model.gguf", speculator="eagle+lookahead")
    config = EngineConfig(speculator="ngram+lookahead")
    assert config.speculative_tokens("ngram+lookahead") == 4 + 8  # the parts' defaults
    assert config.tree_width("lookahead+ngram") == 3  # the first part's
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args(["--speculator", "eagle+lookahead"]).speculator == "eagle+lookahead"
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculator", "lookahead+lookahead"])


def test_api_rejects_a_bad_combination():
    from runtime.openai_protocol import ApiError, CompletionRequest
    body = CompletionRequest.model_validate({"prompt": "hi", "speculation": {"method": "eagle+eagle"}})
    with pytest.raises(ApiError, match="speculation.method"):
        body.sampling_params(1, 100)
    good = CompletionRequest.model_validate({"prompt": "hi", "speculation": {"method": "ngram+lookahead"}})
    assert good.sampling_params(1, 100)[0].speculator == "ngram+lookahead"


def test_ngram_plus_lookahead_is_greedy_lossless(engine_f32, generate):
    params = [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, speculator=s)
              for s in ("none", "ngram+lookahead")]
    plain = generate(engine_f32, PROMPTS, params[0])
    engine = new_engine(adaptive_speculation=False)
    try:
        assert generate(engine, PROMPTS, params[1]) == plain
        assert engine.stats.num_accepted_tokens > 0 and engine.stats.num_draft_tokens > 0
        composite = engine.pool.get("ngram+lookahead")
        assert composite.parts == [engine.pool.get("ngram"), engine.pool.get("lookahead")]  # the pool's
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        engine.close()


def test_a_combination_shares_its_draft_worker_with_draft_requests(engine_f32, generate, tmp_path, monkeypatch):
    """One draft model, one worker: the combination's draft part is the pool's `draft`
    proposer (two would load the model twice and fight over its cores), and it drafts
    ahead for both names' requests at once."""
    from draft_cpu import worker as worker_module
    from speculators.draft import DraftModelProposer
    save_tiny_model("llama3", tmp_path, engine_f32.tokenizer)
    started, closed = [], []
    init, close = worker_module.DraftWorker.__init__, worker_module.DraftWorker.close
    monkeypatch.setattr(worker_module.DraftWorker, "__init__", lambda self, c: started.append(self) or init(self, c))
    monkeypatch.setattr(worker_module.DraftWorker, "close", lambda self: closed.append(self) or close(self))
    ahead_calls, draft_ahead = [], DraftModelProposer.draft_ahead
    monkeypatch.setattr(DraftModelProposer, "draft_ahead",
                        lambda self, pairs: ahead_calls.append(len(pairs)) or draft_ahead(self, pairs))
    names = ["draft+lookahead", "draft", "draft+lookahead"]
    plain = generate(engine_f32, PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    engine = new_engine(speculator="draft+lookahead", draft_model=str(tmp_path), draft_dtype="float32",
                        adaptive_speculation=False, draft_overlap="on")
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, speculator=s) for s in names]
        assert generate(engine, PROMPTS, params) == plain
        assert engine.pool.get("draft+lookahead").parts[0] is engine.pool.get("draft")
        assert len(started) == 1 and engine.stats.num_draft_tokens > 0
        assert max(ahead_calls) == len(names)  # one call a step, all three requests
    finally:
        engine.close()
    assert closed == started  # closed once, by the pool


class FailsAhead(Recorder):
    def __init__(self, name, base_token):
        super().__init__(name, base_token)
        self.ahead_calls = 0

    def draft_ahead(self, verifying):
        self.ahead_calls += 1
        raise RuntimeError("the draft worker crashed")


def test_a_part_failing_to_draft_ahead_costs_drafts_not_requests(engine_f32, generate):
    """The part's breaker opens and it is no longer asked to draft ahead; the combination
    goes on drafting, and the outputs are plain decoding's."""
    proposer = FailsAhead("failsahead", 100)
    name = toy_speculator("failsahead", proposer, num_speculative_tokens=2)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = generate(engine_f32, PROMPTS, params)
    engine = new_engine(speculator=f"{name}+ngram", adaptive_speculation=False)
    try:
        assert generate(engine, PROMPTS, params) == plain
        breaker = engine.pool.breakers[name]
        assert breaker.is_open and proposer.ahead_calls <= breaker.max_failures + 1  # + a retry after cooling down
        assert not engine.pool.breakers[f"{name}+ngram"].is_open and len(proposer.asked) > breaker.max_failures
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        engine.close()
