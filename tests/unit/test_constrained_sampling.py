"""Grammar constraints under speculation (runtime.structured_output), on a toy vocabulary
("0".."9", "a", "b", "ab", EOS) with xgrammar as the grammar's reference:

- pruning keeps exactly the draft nodes whose path the grammar allows (checked against the
  grammar itself, node by node), with their draft probabilities, parents before children;
- masks: each tree node's row allows exactly what the grammar allows after the node's
  path, filled inline or on the grammar thread, and the matcher is left at the committed
  state;
- the lossless law: a toy "language model" whose logits depend on the path, decoded under
  the regex [0-9][0-9] with chain and tree drafts drawn from a proposal that often
  proposes forbidden tokens (pruned, as the engine does), with and without draft
  probabilities: the emitted pair must follow masked target sampling, p(d1) p(d2 | d1)
  with each factor renormalised over the digits (Pearson chi-square and total variation).
  It caught verification against the draft's unmasked law, which biases the output;
- forced text: after each leaf the grammar's forced text is drafted in the tokenizer's
  split (one-hot draft law, counted as forced), within the depth and count limits; under
  [0-9](ab)[0-9], where "ab" may come as one token or as "a", "b", the emitted token
  sequences still follow masked target sampling with the forced drafts added;
- GuidedSpec's checks, and a spec that does not compile is a ValueError naming the problem.
"""
from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from runtime.draft_tree import DraftTree
from runtime.rejection_sampler import RejectionSampler
from runtime.sampling_params import GuidedSpec, SamplingParams
from runtime.structured_output import Constraint, StepMasks
from runtime.verify_layout import VerifyLayout, root_rows
from tests.unit.test_rejection_sampler import assert_close_in_total_variation, assert_fits

VOCAB = [str(d) for d in range(10)] + ["a", "b", "ab", "</s>"]
EOS, V = 13, 14
DIGITS = torch.arange(10)


@pytest.fixture(scope="module")
def compiler():
    info = xgr.TokenizerInfo(VOCAB, vocab_type=xgr.VocabType.RAW, vocab_size=V, stop_token_ids=[EOS])
    return xgr.GrammarCompiler(info)


def encode(text: str) -> list[int]:
    """The toy tokenizer: longest vocabulary match first ("ab" is one token)."""
    tokens = []
    while text:
        piece = max((v for v in VOCAB[:EOS] if text.startswith(v)), key=len)
        tokens.append(VOCAB.index(piece))
        text = text[len(piece):]
    return tokens


def constraint(compiler, regex: str, forcing: bool = False) -> Constraint:
    return Constraint(xgr.GrammarMatcher(compiler.compile_regex(regex)), V, encode if forcing else None)


def allowed_after(compiler, regex: str, path: list[int]) -> set[int] | None:
    """What the grammar allows after path, from a fresh matcher (None: the path is forbidden)."""
    matcher = xgr.GrammarMatcher(compiler.compile_regex(regex))
    if not all(matcher.accept_token(t) for t in path):
        return None
    bitmask = xgr.allocate_token_bitmask(1, V)
    matcher.fill_next_token_bitmask(bitmask)
    logits = torch.zeros(1, V)
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


def path_of(tree: DraftTree, node: int) -> list[int]:
    path = []
    while node != -1:
        path.append(tree.token_ids[node])
        node = tree.parents[node]
    return path[::-1]


REGEX = "(ab|[0-9])[0-9]b?"
# root -> 3 -> 4 -> b: allowed; root -> a: allowed (a prefix of "ab"); root -> ab -> 7: allowed, -> 1 below it:
# not ("ab71"); root -> b: not, and 2 below it goes with it
TREE = DraftTree([3, 4, 11, 10, 12, 7, 1, 11, 2], [-1, 0, 1, -1, -1, 4, 5, -1, 7])


def test_pruning_keeps_exactly_the_allowed_paths(compiler):
    c = constraint(compiler, REGEX)
    probs = torch.softmax(torch.randn(len(TREE), V), -1)
    tree = DraftTree(TREE.token_ids, TREE.parents, probs)
    pruned = c.prune(tree)
    expected = [n for n in range(len(tree)) if allowed_after(compiler, REGEX, path_of(tree, n)) is not None]
    assert expected == [0, 1, 2, 3, 4, 5]  # the comment above TREE, by hand
    assert [path_of(pruned, n) for n in range(len(pruned))] == [path_of(tree, n) for n in expected]
    assert torch.equal(pruned.draft_probs, probs[expected])
    assert c.prune(pruned) is pruned  # nothing left to prune: the same tree
    assert c.matcher.accept_token(3) and c.matcher.accept_token(4)  # left at the start


@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "grammar_thread"])
def test_each_rows_mask_is_what_the_grammar_allows_after_its_path(compiler, overlap):
    c = constraint(compiler, REGEX)
    c.accept(12)  # committed: "ab"
    tree = DraftTree([3, 11, 4, 13], [-1, 0, -1, 2])  # "ab3", "ab3b", "ab4", "ab4" + EOS (complete)
    logits = torch.zeros(2 + len(tree), V)
    seq, free = type("Seq", (), {"constraint": c})(), type("Seq", (), {"constraint": None})()
    # another sequence's row first; filled on the grammar thread (as for a GPU target) or here
    masks = StepMasks([free, seq], [DraftTree([], []), tree], [0, 1], len(logits), overlap=overlap)
    masks.apply(logits)
    assert torch.equal(logits[0], torch.zeros(V))  # not constrained: untouched
    for row, path in enumerate([[], [3], [3, 11], [4], [4, 13]], start=1):
        seen = set(torch.nonzero(logits[row] == 0).flatten().tolist())
        if path == [4, 13]:  # after the stop token nothing follows: the row stays as it was
            assert seen == set(range(V))
        else:
            assert seen == allowed_after(compiler, REGEX, [12] + path), path
    assert c.matcher.accept_token(9) and not c.matcher.accept_token(9)  # still right after "ab"


FORCING = "[0-9]ab[0-9]ab"


def test_forced_text_is_drafted_after_each_leaf(compiler):
    c = constraint(compiler, FORCING, forcing=True)
    assert len(c.extend(DraftTree([], []), 5, 5)) == 0  # a digit comes first: nothing forced
    tree = DraftTree([3, 4, 10], [-1, -1, 1], torch.full((3, V), 1.0 / V))  # "3", "4", "4a"
    extended = c.extend(tree, max_depth=4, max_new=4)
    # "3" + "ab" (one token: the tokenizer's split), "4a" + "b"; then a digit: free
    assert extended.token_ids == [3, 4, 10, 12, 11] and extended.parents == [-1, -1, 1, 0, 2]
    assert extended.num_forced == 2 and extended.num_proposed == 3
    assert torch.equal(extended.draft_probs[:3], tree.draft_probs)
    assert torch.equal(extended.draft_probs[3:], torch.eye(V)[[12, 11]])  # their law: one-hot
    assert c.extend(tree, max_depth=4, max_new=1).token_ids == [3, 4, 10, 12]  # the count
    assert c.extend(tree, max_depth=1, max_new=4) is tree  # the depth: every leaf is deep enough
    c.accept(5)
    chain = c.extend(DraftTree([], []), max_depth=3, max_new=3)
    assert chain.token_ids == [12] and chain.parents == [-1] and chain.num_forced == 1
    assert chain.truncated(0).num_forced == 0
    assert c.matcher.accept_token(10) and not c.matcher.accept_token(3)  # left right after "5"


# ---- the output law under a constraint ---------------------------------------------------------

def toy_logits(path: list[int]) -> torch.Tensor:
    """The toy target's logits [V] after path: letters likely, so the mask matters."""
    gen = torch.Generator().manual_seed(1000 + 17 * len(path) + (path[-1] if path else 0))
    logits = torch.randn(V, generator=gen) * 1.5
    logits[10:13] += 1.0
    return logits


def masked_probs(path: list[int]) -> torch.Tensor:
    """Masked target sampling under [0-9][0-9] after path (len 0 or 1): digits only, renormalised."""
    p = torch.zeros(V, dtype=torch.float64)
    p[DIGITS] = torch.softmax(toy_logits(path)[DIGITS].double(), -1)
    return p


def proposal(path: list[int]) -> torch.Tensor:
    """The toy draft's distribution: near the target, but half its mass on forbidden tokens."""
    q = torch.softmax(toy_logits(path) * 0.7, -1)
    q[10:] += 0.5 * q[10:].sum() / 4 + 0.05
    return q / q.sum()


def draw_tree(committed: list[int], shape: str, with_probs: bool, gen: torch.Generator) -> DraftTree:
    """chain: 3 draws, each from the proposal after its path; tree: 2 root children drawn
    without replacement, each with one child."""
    tokens, parents, rows = [], [], []

    def add(parent: int, exclude: list[int]) -> int:
        path = committed + (path_of(DraftTree(tokens, parents), parent) if parent >= 0 else [])
        q = proposal(path)
        q[exclude] = 0
        q = q / q.sum()
        tokens.append(int(torch.multinomial(q, 1, generator=gen)))
        parents.append(parent)
        rows.append(q)
        return len(tokens) - 1

    if shape == "chain":
        node = add(-1, [])
        for _ in range(2):
            node = add(node, [])
    else:
        first = add(-1, [])
        second = add(-1, [tokens[first]])
        add(first, [])
        add(second, [])
    return DraftTree(tokens, parents, torch.stack(rows).float() if with_probs else None)


def emit(compiler, sampler, regex: str, shape: str, with_probs: bool, gen: torch.Generator) -> tuple:
    """Decode under regex as the engine does (propose, prune, extend by forced text, mask,
    verify, commit) until the grammar is complete; the tokens out."""
    c = constraint(compiler, regex, forcing=True)
    seq = type("Seq", (), {"constraint": c, "params": SamplingParams(temperature=1.0), "generator": gen})()
    out: list[int] = []
    while not c.matcher.is_completed():
        tree = c.extend(c.prune(draw_tree(out, shape, with_probs, gen)), max_depth=4, max_new=4)
        logits = torch.stack([toy_logits(out)] + [toy_logits(out + path_of(tree, n)) for n in range(len(tree))])
        layout = VerifyLayout([seq], [1], [tree], [True], [0], [0], root_rows([tree]))
        verdict = sampler.verify(logits, layout)[0]
        for token in verdict.token_ids:
            if not c.matcher.is_completed():
                c.accept(token)
                out.append(token)
    return tuple(out)


@pytest.mark.parametrize("with_probs", [True, False], ids=["draft_probs", "one_hot"])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_constrained_speculation_samples_the_masked_target(compiler, shape, with_probs):
    gen, sampler = torch.Generator().manual_seed(7), RejectionSampler(0)
    counts = torch.zeros(V, V)
    for _ in range(6000):
        counts[emit(compiler, sampler, "[0-9][0-9]", shape, with_probs, gen)] += 1
    expected = masked_probs([])[:, None] * torch.stack([masked_probs([d]) for d in range(V)])  # [V, V]
    label = f"{shape} {'with' if with_probs else 'without'} draft probabilities"
    assert_fits(counts.sum(1), masked_probs([]), f"{label}: first token")
    assert_fits(counts[:10], torch.stack([masked_probs([d]) for d in range(10)]), f"{label}: second given first")
    assert_close_in_total_variation(counts, expected, f"{label}: pairs")


def split_law() -> torch.Tensor:
    """Masked target sampling under [0-9](ab)[0-9]: [10, 2, 10] over (first digit, "ab" as
    one token or as "a" "b", last digit)."""
    law = torch.zeros(10, 2, 10, dtype=torch.float64)
    for d1, p1 in enumerate(masked_probs([]).tolist()[:10]):
        split = torch.softmax(toy_logits([d1])[[12, 10]].double(), -1)  # after d1: "ab" or "a" (then "b", forced)
        for s, path in enumerate(([d1, 12], [d1, 10, 11])):
            law[d1, s] = p1 * split[s] * masked_probs(path)[:10]
    return law


@pytest.mark.parametrize("with_probs", [True, False], ids=["draft_probs", "one_hot"])
def test_forced_drafts_keep_the_masked_target_law(compiler, with_probs):
    gen, sampler = torch.Generator().manual_seed(8), RejectionSampler(0)
    counts = torch.zeros(10, 2, 10)
    for _ in range(6000):
        out = emit(compiler, sampler, "[0-9](ab)[0-9]", "chain", with_probs, gen)
        counts[out[0], int(out[1] == 10), out[-1]] += 1
    law, label = split_law(), f"forced drafts {'with' if with_probs else 'without'} draft probabilities"
    assert_fits(counts.sum((1, 2)), law.sum((1, 2)), f"{label}: first digit")
    assert_fits(counts.sum((0, 2)), law.sum((0, 2)), f"{label}: the split of ab")
    assert_fits(counts.sum((0, 1)), law.sum((0, 1)), f"{label}: last digit")
    assert_close_in_total_variation(counts, law, f"{label}: sequences")


# ---- specs ---------------------------------------------------------------------------------------

def test_guided_specs_are_checked():
    for kind, value in [("regex", ""), ("choice", []), ("choice", ["a", 3]), ("json", 5), ("json_object", {}),
                        ("grammar", None), ("xml", "x")]:
        with pytest.raises(ValueError, match="guided"):
            GuidedSpec(kind, value)
    with pytest.raises(ValueError, match="guided must be"):
        SamplingParams(guided={"type": "json_object"})


def test_a_spec_that_does_not_compile_names_the_problem(engine_f32):
    for spec, message in [(GuidedSpec("json", {"type": "nonsense"}), r"JSON schema does not compile: .*nonsense"),
                          (GuidedSpec("regex", "(abc"), r"regex does not compile: .*parenthesis"),
                          (GuidedSpec("grammar", 'root ::= "a" |'), "grammar does not compile: .*EBNF")]:
        with pytest.raises(ValueError, match=message):
            engine_f32.add_request("Hi", SamplingParams(guided=spec))
    assert not engine_f32.has_unfinished
