"""Proposers, against brute-force references written here:
DraftTree structure (depths, children, attention mask) on random trees; prompt lookup
against a naive backwards scan; the Lookahead trie's counts against n-gram counting, its
chains and trees against continuations found by scanning the text, incremental indexing,
the global trie (sharing, node cap, LRU eviction). The draft-size controller is tested in
test_speculation_controller.py.

Everything here is pure Python on the CPU, seeded, and runs in a few seconds."""
from __future__ import annotations

import random
from collections import Counter
from fractions import Fraction

import pytest
import torch

from runtime.sampling_params import SamplingParams
from speculators.base import ProposalRequest
from speculators.lookahead import LookaheadProposer, NGramTrie
from speculators.ngram import NGramProposer
from runtime.draft_tree import DraftTree

GREEDY = SamplingParams(temperature=0.0)


def request(token_ids, max_nodes: int = 8, tree_width: int = 1, request_id: str = "r") -> ProposalRequest:
    return ProposalRequest(request_id, list(token_ids), len(token_ids), max_nodes, tree_width, GREEDY)


def random_parents(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(-1, i - 1) for i in range(n)]


# ---- DraftTree -------------------------------------------------------------------------------

def ancestors(parents: list[int], i: int) -> list[int]:
    """Node i's ancestors (nodes only, not the root), nearest first, by walking up."""
    out = []
    while parents[i] != -1:
        i = parents[i]
        out.append(i)
    return out


def test_tree_depths_children_and_mask_match_brute_force_on_random_trees():
    rng = random.Random(0)
    for trial in range(300):
        n = rng.randint(0, 14)
        parents = random_parents(rng, n)
        tokens = [rng.randrange(100) for _ in range(n)]
        tree = DraftTree(tokens, parents)
        assert len(tree) == n
        assert tree.depths == [len(ancestors(parents, i)) + 1 for i in range(n)], parents
        assert tree.max_depth == max(tree.depths, default=0)
        assert tree.is_chain == (parents == list(range(-1, n - 1)))
        assert tree.children() == [[j for j in range(n) if parents[j] == i - 1] for i in range(n + 1)]
        mask = tree.attention_mask()
        assert mask.dtype == torch.bool and mask.shape == (n + 1, n + 1)
        expected = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        expected[0, 0] = True
        for i in range(n):
            expected[i + 1, 0] = True  # the root
            expected[i + 1, i + 1] = True  # itself
            for a in ancestors(parents, i):
                expected[i + 1, a + 1] = True
        assert torch.equal(mask, expected), parents


def test_truncated_keeps_a_valid_prefix_tree():
    rng = random.Random(1)
    for _ in range(100):
        n = rng.randint(1, 12)
        parents = random_parents(rng, n)
        tokens = [rng.randrange(50) for _ in range(n)]
        probs = torch.rand(n, 7, generator=torch.Generator().manual_seed(n))
        tree = DraftTree(tokens, parents, probs)
        for k in range(n + 2):
            cut = tree.truncated(k)
            m = min(k, n)
            assert cut.token_ids == tokens[:m] and cut.parents == parents[:m]
            assert cut.depths == tree.depths[:m]
            assert all(-1 <= p < i for i, p in enumerate(cut.parents))
            assert torch.equal(cut.draft_probs, probs[:m])
            assert torch.equal(cut.attention_mask(), tree.attention_mask()[:m + 1, :m + 1])
        assert tree.truncated(n) is tree and tree.truncated(n + 5) is tree
        assert DraftTree(tokens, parents).truncated(1).draft_probs is None


def test_chain_helper():
    chain = DraftTree.chain([5, 6, 7])
    assert chain.parents == [-1, 0, 1] and chain.depths == [1, 2, 3]
    assert chain.is_chain and chain.max_depth == 3 and chain.draft_probs is None
    assert chain.children() == [[0], [1], [2], []]
    assert torch.equal(chain.attention_mask(), torch.ones(4, 4, dtype=torch.bool).tril())
    probs = torch.full((2, 4), 0.25)
    assert torch.equal(DraftTree.chain([1, 2], probs).draft_probs, probs)
    empty = DraftTree.chain([])
    assert len(empty) == 0 and empty.is_chain and empty.max_depth == 0 and empty.children() == [[]]
    assert torch.equal(empty.attention_mask(), torch.ones(1, 1, dtype=torch.bool))
    assert not DraftTree([1, 2], [-1, -1]).is_chain


@pytest.mark.parametrize("tokens, parents, probs", [
    ([1], [0], None),  # parent == i
    ([1, 2], [-1, 2], None),  # parent after the child
    ([1, 2], [-1, 1], None),
    ([1], [-2], None),
    ([1, 2], [-1], None),  # length mismatch
    ([1], [-1, 0], None),
    ([1, 2], [-1, 0], torch.zeros(3, 5)),  # draft_probs rows mismatch
    ([1, 2], [-1, 0], torch.zeros(1, 5)),
])
def test_tree_validation(tokens, parents, probs):
    with pytest.raises(ValueError):
        DraftTree(tokens, parents, probs)
    if probs is not None:  # the chain helper validates the same way
        with pytest.raises(ValueError):
            DraftTree.chain(tokens, probs)


# ---- prompt lookup ---------------------------------------------------------------------------

def reference_lookup(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """For n = hi .. lo: scan backwards for the latest earlier occurrence of the last n
    tokens that is followed by at least one token; return up to k tokens after it."""
    length = len(tokens)
    for n in range(hi, lo - 1, -1):
        suffix = tokens[length - n:] if n <= length else None
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_ngram_matches_brute_force_prompt_lookup():
    rng = random.Random(2)
    for trial in range(1500):
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        proposer = NGramProposer(lo, hi)
        tokens = [rng.randrange(rng.choice([2, 3, 4])) for _ in range(rng.randint(0, 30))]
        k = rng.randint(1, 10)
        expected = reference_lookup(tokens, k, lo, hi)
        assert proposer.lookup(tokens, k) == expected, (tokens, k, lo, hi)
        [tree] = proposer.propose([request(tokens, max_nodes=k)])
        assert tree.token_ids == expected and tree.is_chain and len(tree) <= k


def test_ngram_respects_min_and_max():
    # only a 2-token suffix occurs earlier
    tokens = [1, 2, 9, 8, 7, 3, 1, 2]
    assert NGramProposer(2, 4).lookup(tokens, 3) == [9, 8, 7]
    assert NGramProposer(3, 4).lookup(tokens, 3) == []
    # the 1-token suffix occurs later than the 2-token one: max wins over recency
    tokens = [5, 6, 1, 0, 6, 4, 4, 5, 6]
    assert NGramProposer(1, 2).lookup(tokens, 2) == [1, 0]
    assert NGramProposer(1, 1).lookup(tokens, 2) == [4, 4]
    # a 3-token suffix occurs, but max = 2 ignores it; the latest 2-token occurrence wins
    tokens = [1, 2, 3, 7, 0, 2, 3, 8, 1, 2, 3]
    assert NGramProposer(2, 2).lookup(tokens, 1) == [8]
    assert NGramProposer(2, 3).lookup(tokens, 1) == [7]


def test_ngram_no_match_gives_an_empty_tree():
    proposer = NGramProposer(1, 3)
    trees = proposer.propose([request([1, 2, 3, 4]), request([]), request([7]), request([7, 7], max_nodes=4)])
    assert [t.token_ids for t in trees] == [[], [], [], [7]]
    assert all(t.is_chain for t in trees)


@pytest.mark.parametrize("lo, hi", [(0, 2), (3, 2), (-1, 1), (0, 0)])
def test_ngram_invalid_settings(lo, hi):
    with pytest.raises(ValueError):
        NGramProposer(lo, hi)


# ---- Lookahead: brute-force text statistics --------------------------------------------------

def occurrences(tokens: list[int], seq: list[int]) -> list[int]:
    n = len(seq)
    return [p for p in range(len(tokens) - n + 1) if tokens[p:p + n] == seq]


def continuations(tokens: list[int], seq: list[int]) -> Counter:
    """How often each token directly followed seq in the text."""
    n = len(seq)
    return Counter(tokens[p + n] for p in occurrences(tokens, seq) if p + n < len(tokens))


def reference_suffix(tokens: list[int], lo: int, hi: int) -> list[int] | None:
    """The longest suffix (lo..hi tokens) that occurred earlier with a following token."""
    for m in range(min(hi, len(tokens)), lo - 1, -1):
        if continuations(tokens, tokens[-m:]):
            return tokens[-m:]
    return None


def ngram_counts(tokens: list[int], window: int, start: int = 0) -> dict[tuple[int, ...], int]:
    counts: Counter = Counter()
    for p in range(start, len(tokens)):
        for n in range(1, min(window, len(tokens) - p) + 1):
            counts[tuple(tokens[p:p + n])] += 1
    return dict(counts)


def trie_counts(trie: NGramTrie, first_tokens=None) -> dict[tuple[int, ...], int]:
    """Every path in the trie with its node's count."""
    out = {}
    stack = [((token,), node) for token, node in trie.root_children.items()
             if first_tokens is None or token in first_tokens]
    while stack:
        path, node = stack.pop()
        out[path] = node.count
        for token, child in (node.children or {}).items():
            stack.append((path + (token,), child))
    return out


def paths(tree: DraftTree) -> list[list[int]]:
    out = []
    for i in range(len(tree)):
        out.append((out[tree.parents[i]] if tree.parents[i] >= 0 else []) + [tree.token_ids[i]])
    return out


def check_chain(tokens, chain, max_nodes, max_depth, lo, hi):
    """chain must follow a most frequent continuation (any of tied ones) of the longest
    matching suffix, and stop only at the budget, the depth, or where the text has no more."""
    suffix = reference_suffix(tokens, lo, hi)
    if suffix is None:
        assert chain == [], (tokens, chain)
        return
    path: list[int] = []
    for token in chain:
        nexts = continuations(tokens, suffix + path)
        assert nexts and nexts[token] == max(nexts.values()), (tokens, suffix, path, chain)
        path.append(token)
    limit = min(max_nodes, max_depth)
    assert len(chain) <= limit
    if len(chain) < limit:
        assert not continuations(tokens, suffix + path), (tokens, suffix, chain)


def path_probability(tokens, suffix, path) -> Fraction:
    prob = Fraction(1)
    for j in range(len(path)):
        nexts = continuations(tokens, suffix + path[:j])
        prob *= Fraction(nexts[path[j]], sum(nexts.values()))
    return prob


def check_tree(tokens, tree: DraftTree, max_nodes, tree_width, max_depth, lo, hi):
    suffix = reference_suffix(tokens, lo, hi)
    if suffix is None:
        assert len(tree) == 0
        return
    assert 1 <= len(tree) <= max_nodes
    assert all(-1 <= p < i for i, p in enumerate(tree.parents))  # parents first
    assert tree.max_depth <= max_depth
    node_paths = paths(tree)
    children = tree.children()
    probs = [path_probability(tokens, suffix, path) for path in node_paths]
    for i, path in enumerate(node_paths):
        assert continuations(tokens, suffix + path[:-1])[path[-1]] > 0, "path never occurred after the suffix"
    for parent in range(-1, len(tree)):
        kids = children[parent + 1]
        prefix = suffix + (node_paths[parent] if parent >= 0 else [])
        nexts = continuations(tokens, prefix)
        kid_tokens = [tree.token_ids[k] for k in kids]
        assert len(kids) <= tree_width and len(set(kid_tokens)) == len(kid_tokens)
        counts = [nexts[t] for t in kid_tokens]
        assert counts == sorted(counts, reverse=True), "siblings must come likeliest first"
        depth = 0 if parent < 0 else tree.depths[parent]
        if len(kids) < tree_width and depth < max_depth:
            # best-first: whatever was left out below this node is no likelier than any node taken
            left_out = [t for t in nexts if t not in kid_tokens]
            if len(tree) < max_nodes:
                assert not left_out, "a tree under budget must hold every allowed continuation"
            parent_prob = probs[parent] if parent >= 0 else Fraction(1)
            for t in left_out:
                assert parent_prob * Fraction(nexts[t], sum(nexts.values())) <= min(probs) + Fraction(1, 10**9)
    for a, b in zip(probs, probs[1:]):  # taken in order of path probability
        assert b <= a + Fraction(1, 10**9)


# ---- Lookahead -------------------------------------------------------------------------------

def test_trie_counts_equal_ngram_occurrences():
    rng = random.Random(3)
    for trial in range(200):
        window = rng.randint(2, 6)
        tokens = [rng.randrange(rng.choice([2, 3, 5])) for _ in range(rng.randint(0, 40))]
        trie = NGramTrie(window)
        cursors = []
        for token in tokens:
            cursors = trie.push(cursors, token)
        counts = trie_counts(trie)
        assert counts == ngram_counts(tokens, window), (tokens, window)
        assert trie.num_nodes == len(counts)
        # and through the proposer's per-request trie (window = max_match + max_depth)
        proposer = LookaheadProposer(max_depth=window - 1, min_match=1, max_match=1)
        proposer.propose([request(tokens)])
        assert trie_counts(proposer.requests["r"].trie) == counts


def test_lookahead_chain_follows_the_most_frequent_continuation():
    rng = random.Random(4)
    for trial in range(800):
        lo = rng.randint(1, 2)
        hi = rng.randint(lo, 4)
        max_depth = rng.randint(1, 6)
        proposer = LookaheadProposer(max_depth=max_depth, min_match=lo, max_match=hi)
        tokens = [rng.randrange(rng.choice([2, 3, 4])) for _ in range(rng.randint(0, 30))]
        max_nodes = rng.randint(1, 8)
        [tree] = proposer.propose([request(tokens, max_nodes=max_nodes, tree_width=1)])
        assert tree.is_chain
        check_chain(tokens, tree.token_ids, max_nodes, max_depth, lo, hi)


def test_lookahead_chain_on_a_sequence_without_ties():
    # after [1, 2]: 3 twice, 4 once; then 5 and 6 always follow [1, 2, 3]
    tokens = [1, 2, 3, 5, 6, 0, 1, 2, 4, 0, 1, 2, 3, 5, 6, 9, 1, 2]
    proposer = LookaheadProposer(max_depth=3, min_match=1, max_match=2)
    [tree] = proposer.propose([request(tokens, max_nodes=8)])
    assert tree.token_ids == [3, 5, 6] and tree.is_chain
    [tree] = proposer.propose([request(tokens, max_nodes=2)])
    assert tree.token_ids == [3, 5]
    # tree mode, best-first: 3 (p 2/3), 5 and 6 below it (2/3 each), then 4 (1/3), 0 and 1 below it
    [tree] = proposer.propose([request(tokens, max_nodes=8, tree_width=2)])
    assert (tree.token_ids, tree.parents) == ([3, 5, 6, 4, 0, 1], [-1, 0, 1, -1, 3, 4])
    [tree] = proposer.propose([request(tokens, max_nodes=4, tree_width=2)])
    assert (tree.token_ids, tree.parents) == ([3, 5, 6, 4], [-1, 0, 1, -1])


def test_lookahead_tree_mode_properties():
    rng = random.Random(5)
    for trial in range(600):
        lo = rng.randint(1, 2)
        hi = rng.randint(lo, 3)
        max_depth = rng.randint(1, 5)
        proposer = LookaheadProposer(max_depth=max_depth, min_match=lo, max_match=hi)
        tokens = [rng.randrange(rng.choice([3, 4, 5])) for _ in range(rng.randint(0, 40))]
        max_nodes = rng.randint(1, 12)
        tree_width = rng.randint(1, 4)
        [tree] = proposer.propose([request(tokens, max_nodes=max_nodes, tree_width=tree_width)])
        check_tree(tokens, tree, max_nodes, tree_width, max_depth, lo, hi)


def test_incremental_indexing_equals_indexing_at_once():
    rng = random.Random(6)
    for trial in range(150):
        max_depth, max_match = rng.randint(1, 4), rng.randint(1, 3)
        tokens = [rng.randrange(rng.choice([2, 3, 4])) for _ in range(rng.randint(1, 50))]
        stepwise = LookaheadProposer(max_depth=max_depth, max_match=max_match)
        length = 0
        while length < len(tokens):
            length = min(len(tokens), length + rng.randint(1, 4))
            if rng.random() < 0.5:
                stepwise.propose([request(tokens[:length], max_nodes=4, tree_width=2, request_id="a")])
            else:
                stepwise.on_accepted("a", tokens[:length], rng.randint(0, 3))
        at_once = LookaheadProposer(max_depth=max_depth, max_match=max_match)
        at_once.propose([request(tokens, request_id="a")])
        expected = ngram_counts(tokens, max_depth + max_match)
        assert trie_counts(stepwise.requests["a"].trie) == trie_counts(at_once.requests["a"].trie) == expected
        for width in (1, 3):
            [a] = stepwise.propose([request(tokens, max_nodes=6, tree_width=width, request_id="a")])
            [b] = at_once.propose([request(tokens, max_nodes=6, tree_width=width, request_id="a")])
            assert (a.token_ids, a.parents) == (b.token_ids, b.parents)


def test_copying_the_prompt_is_drafted_exactly():
    rng = random.Random(7)
    for trial in range(40):
        prompt = rng.sample(range(1000), 60)  # distinct tokens: every continuation is unambiguous
        start = rng.randrange(0, 30)
        span = rng.randint(1, 20)
        max_depth, max_nodes = rng.randint(1, 8), rng.randint(1, 8)
        k = min(max_depth, max_nodes)
        lookahead = LookaheadProposer(max_depth=max_depth, min_match=1, max_match=4)
        ngram = NGramProposer(1, 4)
        # decode the copy token by token, asking both proposers at every step
        for j in range(1, span + 1):
            tokens = prompt + prompt[start:start + j]
            truth = prompt[start + j:start + j + k]
            [tree] = lookahead.propose([request(tokens, max_nodes=max_nodes, request_id="copy")])
            assert tree.token_ids == truth and tree.is_chain
            [tree] = ngram.propose([request(tokens, max_nodes=max_nodes)])
            assert tree.token_ids == prompt[start + j:start + j + max_nodes]  # no depth limit here


def test_global_trie_shares_text_between_requests():
    a = [11, 12, 13, 14, 15, 16, 17]
    b = [40, 41, 13, 14]  # B has seen 13, 14 only at its end; A saw what follows them
    for global_nodes, expected in ((10_000, [15, 16, 17]), (0, [])):
        proposer = LookaheadProposer(max_depth=3, min_match=1, max_match=2, global_max_nodes=global_nodes)
        [tree_a] = proposer.propose([request(a, request_id="A")])
        assert tree_a.token_ids == []
        [tree_b] = proposer.propose([request(b, max_nodes=8, request_id="B")])
        assert tree_b.token_ids == expected, global_nodes
    # the longer match wins, whichever trie it is in
    proposer = LookaheadProposer(max_depth=3, min_match=1, max_match=3, global_max_nodes=10_000)
    proposer.propose([request(a, request_id="A")])
    [tree] = proposer.propose([request([14, 99, 12, 13, 14], request_id="C")])  # own: [14] -> 99; global: [12,13,14]
    assert tree.token_ids == [15, 16, 17]
    # on equal match lengths the request's own trie is used
    [tree] = proposer.propose([request([13, 14, 50, 51, 13, 14], request_id="D")])
    assert tree.token_ids == [50, 51, 13]


def test_release_drops_the_request_state():
    proposer = LookaheadProposer(max_depth=3, max_match=2)
    proposer.propose([request([1, 2, 3, 1, 2], request_id="x"), request([4, 5, 4], request_id="y")])
    assert set(proposer.requests) == {"x", "y"}
    proposer.release("x")
    proposer.release("never-seen")  # harmless
    assert set(proposer.requests) == {"y"}
    # the id can be reused for a new text, indexed from scratch
    [tree] = proposer.propose([request([7, 8, 9, 7], request_id="x")])
    assert tree.token_ids == [8, 9, 7]
    assert trie_counts(proposer.requests["x"].trie) == ngram_counts([7, 8, 9, 7], proposer.window)


def test_trie_node_cap_and_lru_eviction_on_a_random_stream():
    """After every push: at most the cap; num_nodes matches the nodes reachable; the
    surviving first tokens are exactly the most recently pushed ones; and a surviving
    first token's subtree holds the exact counts of the windows since it was (re)created."""
    rng = random.Random(8)
    for window, cap, alphabet in ((3, 40, 20), (4, 60, 40), (5, 150, 30)):
        trie = NGramTrie(window, max_nodes=cap)
        tokens: list[int] = []
        created: dict[int, int] = {}  # first token -> position it was last (re)created at
        cursors = []
        evictions = 0
        for position in range(1500):
            token = rng.randrange(alphabet)
            if token not in trie.root_children:
                created[token] = position
            before = set(trie.root_children)
            tokens.append(token)
            cursors = trie.push(cursors, token)
            evictions += len(before - set(trie.root_children))
            counts = trie_counts(trie)
            assert trie.num_nodes == len(counts) <= cap
            last_push = {t: p for p, t in enumerate(tokens)}
            alive = set(trie.root_children)
            assert token in alive
            gone = set(last_push) - alive
            if gone:
                assert min(last_push[t] for t in alive) > max(last_push[t] for t in gone)
            if position % 50 == 0:
                for first in alive:
                    expected = {g: c for g, c in ngram_counts(tokens, window, created[first]).items() if g[0] == first}
                    assert trie_counts(trie, {first}) == expected
        assert evictions > 100


def test_global_trie_cap_holds_across_requests():
    rng = random.Random(9)
    cap = 300
    proposer = LookaheadProposer(max_depth=3, min_match=1, max_match=3, global_max_nodes=cap)
    texts = {f"r{i}": [rng.randrange(30) for _ in range(rng.randint(5, 15))] for i in range(12)}
    for step in range(60):
        for rid, text in texts.items():
            text.append(rng.randrange(30))
            if step % 2:
                proposer.on_accepted(rid, list(text), 1)
            else:
                proposer.propose([request(text, max_nodes=4, tree_width=2, request_id=rid)])
            assert proposer.global_trie.num_nodes == len(trie_counts(proposer.global_trie)) <= cap
        if step == 30:
            for rid in list(texts)[:6]:
                proposer.release(rid)
                del texts[rid]
    # the per-request tries are uncapped and exact
    for rid, text in texts.items():
        assert trie_counts(proposer.requests[rid].trie) == ngram_counts(text, proposer.window)


@pytest.mark.parametrize("use", ["none", "push", "match"])
def test_global_trie_evicts_least_recently_used_first_tokens(use):
    """A's first tokens 7, 8, 9, 10 are the oldest. C = [5, 7] then uses 7 after two filler
    streams, by indexing it (push) or by proposing again with nothing new to index (match:
    the lookup alone counts as use). More filler then evicts everything older than the
    second filler stream: 8, 9, 10 always, 7 only when it was not used."""
    proposer = LookaheadProposer(max_depth=3, min_match=1, max_match=2, global_max_nodes=60)
    trie = proposer.global_trie
    proposer.propose([request([7, 8, 9, 10], request_id="A")])
    if use != "push":
        proposer.on_accepted("C", [5, 7], 0)
    first_filler = list(range(1000, 1006))
    proposer.on_accepted("F1", first_filler, 0)
    proposer.on_accepted("F2", list(range(1100, 1106)), 0)  # a buffer newer than F1, older than the use
    assert {7, 8, 9, 10} <= set(trie.root_children)
    if use != "none":
        [tree] = proposer.propose([request([5, 7], request_id="C")])
        assert tree.token_ids == [8, 9, 10]
    more = []
    while set(first_filler) & set(trie.root_children):
        more.append(2000 + len(more))
        proposer.on_accepted("F3", list(more), 0)
        assert len(more) < 100
    assert not {8, 9, 10} & set(trie.root_children)
    assert (7 in trie.root_children) == (use != "none")
    [tree] = proposer.propose([request([3, 7], request_id="D")])
    assert tree.token_ids == ([] if use == "none" else [8, 9, 10])


def test_lookahead_invalid_settings():
    for kwargs in (dict(min_match=0), dict(min_match=3, max_match=2), dict(max_depth=0)):
        with pytest.raises(ValueError):
            LookaheadProposer(**kwargs)
    with pytest.raises(ValueError):
        NGramTrie(1)
