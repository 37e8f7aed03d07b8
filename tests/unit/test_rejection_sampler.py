"""Verification of draft trees (runtime.rejection_sampler).

- Exactness: with forced logits (+100 on one token, -100 elsewhere) the target is
  deterministic, so greedy and temperature-1 sampling must both walk the tree to a known
  verdict: chains accepted fully / cut at the first / middle / last node, trees whose
  accepted path goes through a 2nd or 3rd child, empty trees, all in one batch (row
  bookkeeping), with and without draft_probs.
- Distribution (the lossless guarantee): on a small vocabulary with a toy "language model"
  whose target at a node depends on the node's depth and token, 20k verifications per case
  of chains and trees (drafts drawn from q, with and without replacement, or one-hot) must
  emit x1 ~ p_root, (x1, x2) ~ p_root(x1) p_1[x1](x2) and x3 | x2 ~ p_2[x2]; checked by
  Pearson chi-square (p-value > 0.01) and a total-variation bound, also under top-k/top-p
  (filtered references computed here by hand).
- Teeth: the same checks catch a sampler whose residual after a rejection is wrong.
- Reproducibility: a seeded request gets the same verdicts whatever else is in the batch,
  and with one-hot drafts the same tokens as plain decoding with that seed.
"""
from __future__ import annotations

import math

import pytest
import torch

import runtime.rejection_sampler as rejection_sampler
from runtime.rejection_sampler import RejectionSampler
from runtime.sampling_params import SamplingParams
from runtime.draft_tree import DraftTree

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=1.0)
P_VALUE_MIN = 0.01


# ---- statistics (no scipy in the venv) --------------------------------------------------------

def chi2_sf(x: float, dof: int) -> float:
    """P(chi2_dof > x): the regularised upper incomplete gamma Q(dof/2, x/2), by its series
    (small x) or continued fraction (large x), as in Numerical Recipes (gser / gcf)."""
    a, z = dof / 2.0, x / 2.0
    if z <= 0.0:
        return 1.0
    log_prefactor = -z + a * math.log(z) - math.lgamma(a)
    if z < a + 1.0:
        term = total = 1.0 / a
        k = a
        while term > 1e-16 * total:
            k += 1.0
            term *= z / k
            total += term
        return max(0.0, 1.0 - total * math.exp(log_prefactor))
    tiny = 1e-300
    b = z + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return math.exp(log_prefactor) * h


def test_chi2_sf_matches_closed_forms_and_tables():
    for x in (0.3, 2.0, 7.5, 19.0, 60.0):
        assert chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-9, abs=1e-15)
        for m in (1, 2, 5, 20):  # even dof 2m: exp(-x/2) * sum_{j<m} (x/2)^j / j!
            exact = math.exp(-x / 2) * sum((x / 2) ** j / math.factorial(j) for j in range(m))
            assert chi2_sf(x, 2 * m) == pytest.approx(exact, rel=1e-9, abs=1e-15)
    for dof, q99 in ((1, 6.635), (3, 11.345), (7, 18.475), (10, 23.209), (30, 50.892)):  # printed tables
        assert chi2_sf(q99, dof) == pytest.approx(0.01, rel=2e-3)


def pearson(observed: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, int, float]:
    """Pearson chi-square of counts against probabilities, both [G, C]: G groups (each with
    its own total, e.g. conditional laws) of C cells, or [C] for one group. Cells a group
    expects fewer than 5 counts in are pooled. Returns (statistic, dof, p-value)."""
    observed, expected_probs = observed.double().reshape(-1, observed.shape[-1]), expected_probs.double()
    expected_probs = expected_probs.reshape(-1, expected_probs.shape[-1])
    stat, bins, groups = 0.0, 0, 0
    for obs, probs in zip(observed, expected_probs):
        total = float(obs.sum())
        if total == 0:
            continue
        support = probs > 0
        assert obs[~support].sum() == 0, f"tokens outside the target's support were emitted: {obs.tolist()}"
        obs, exp = obs[support], probs[support] / probs[support].sum() * total
        small = exp < 5
        if small.any():
            obs = torch.cat([obs[~small], obs[small].sum().reshape(1)])
            exp = torch.cat([exp[~small], exp[small].sum().reshape(1)])
        stat += float(((obs - exp) ** 2 / exp).sum())
        bins += len(exp)
        groups += 1
    dof = bins - groups
    return stat, dof, (chi2_sf(stat, dof) if dof > 0 else 1.0)


def assert_fits(observed: torch.Tensor, expected_probs: torch.Tensor, label: str) -> None:
    stat, dof, p_value = pearson(observed, expected_probs)
    assert p_value > P_VALUE_MIN, f"{label}: chi-square {stat:.1f} with {dof} dof, p-value {p_value:.2e}"


def assert_close_in_total_variation(observed: torch.Tensor, expected_probs: torch.Tensor, label: str) -> None:
    """TV(empirical, expected) below sum sqrt(p (1 - p) / n), about 2.5 times its typical size."""
    n = float(observed.sum())
    freq, probs = observed.double().flatten() / n, expected_probs.double().flatten()
    tv = 0.5 * float((freq - probs).abs().sum())
    limit = float((probs * (1 - probs) / n).sqrt().sum())
    assert tv < limit, f"{label}: total variation {tv:.4f} >= {limit:.4f}"


# ---- targets computed by hand ---------------------------------------------------------------

def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """softmax(logits / T) kept to the top-k, then to the smallest prefix (by probability)
    whose mass before each kept token is below top_p, renormalised; float64, plain Python."""
    values = [float(x) / params.temperature for x in logits]
    top = max(values)
    weights = [math.exp(v - top) for v in values]
    order = sorted(range(len(values)), key=lambda i: -weights[i])
    if params.top_k > 0:
        order = order[:params.top_k]
    total = sum(weights[i] for i in order)
    kept, mass = [], 0.0
    for i in order:
        if mass >= params.top_p:
            break
        kept.append(i)
        mass += weights[i] / total
    out = torch.zeros(len(values), dtype=torch.float64)
    for i in kept:
        out[i] = weights[i]
    return out / out.sum()


def test_reference_probs_by_hand():
    logits = torch.tensor([0.05, 0.5, 0.15, 0.3]).log()
    assert reference_probs(logits, SamplingParams(top_p=0.75)).tolist() == pytest.approx([0, 0.5 / 0.8, 0, 0.3 / 0.8])
    assert reference_probs(logits, SamplingParams(top_p=0.8)).tolist() == pytest.approx([0, 0.5 / 0.8, 0, 0.3 / 0.8])
    assert reference_probs(logits, SamplingParams(top_k=3, top_p=0.9)).tolist() == pytest.approx(
        [0, 0.5 / 0.95, 0.15 / 0.95, 0.3 / 0.95])
    halved = reference_probs(logits, SamplingParams(temperature=2.0))
    assert halved.tolist() == pytest.approx((torch.tensor([0.05, 0.5, 0.15, 0.3]).double().sqrt() / sum(
        math.sqrt(x) for x in (0.05, 0.5, 0.15, 0.3))).tolist())


# ---- exactness with forced logits -------------------------------------------------------------

EXACT_VOCAB = 10


def forced_logits(argmax_per_row: list[int]) -> torch.Tensor:
    logits = torch.full((len(argmax_per_row), EXACT_VOCAB), -100.0)
    logits[torch.arange(len(argmax_per_row)), torch.tensor(argmax_per_row)] = 100.0
    return logits


CHAIN = ([3, 5, 1], [-1, 0, 1])
THREE_CHILDREN = ([2, 4, 6], [-1, -1, -1])
# root -> node 0 (2) -> node 2 (6); root -> node 1 (4) -> node 3 (1), node 4 (3) -> node 5 (5), node 6 (7)
DEEP = ([2, 4, 6, 1, 3, 5, 7], [-1, -1, 0, 1, 1, 4, 4])

# name: (tree, target argmax for the root and each node, accepted nodes, next token, kind)
EXACT_CASES = {
    "chain_all_accepted": (CHAIN, [3, 5, 1, 7], [0, 1, 2], 7, "bonus"),
    "chain_first_rejected": (CHAIN, [4, 5, 1, 7], [], 4, "recovered"),
    "chain_middle_rejected": (CHAIN, [3, 2, 1, 7], [0], 2, "recovered"),
    "chain_last_rejected": (CHAIN, [3, 5, 0, 7], [0, 1], 0, "recovered"),
    "single_node_accepted": (([8], [-1]), [8, 2], [0], 2, "bonus"),
    "second_child": (THREE_CHILDREN, [4, 1, 7, 3], [1], 7, "bonus"),
    "third_child": (THREE_CHILDREN, [6, 1, 7, 3], [2], 3, "bonus"),
    "no_child_matches": (THREE_CHILDREN, [5, 2, 4, 6], [], 5, "recovered"),
    # decoys off the true path: node 0's target is its child's token, node 3's a cousin's
    "deep_second_child_twice": (DEEP, [4, 6, 3, 9, 5, 7, 0, 8], [1, 4, 6], 8, "bonus"),
    "deep_recovered_below_second_child": (DEEP, [4, 6, 3, 9, 5, 9, 0, 8], [1, 4], 9, "recovered"),
    "deep_first_branch_to_leaf": (DEEP, [2, 6, 3, 0, 5, 7, 1, 8], [0, 2], 0, "bonus"),
    "empty_tree": (([], []), [6], [], 6, "plain"),
}


def exact_batch(names: list[str], with_draft_probs: bool, gen: torch.Generator):
    trees, rows = [], []
    for name in names:
        (token_ids, parents), argmax_rows, *_ = EXACT_CASES[name]
        probs = None
        if with_draft_probs:  # any proposal distribution: it must not matter when the target is one-hot
            probs = torch.softmax(torch.randn(len(token_ids), EXACT_VOCAB, generator=gen) * 2, -1)
        trees.append(DraftTree(list(token_ids), list(parents), probs))
        rows += argmax_rows
    return trees, forced_logits(rows)


@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["one_hot", "draft_probs"])
@pytest.mark.parametrize("mode", ["greedy", "sampled", "mixed"])
def test_forced_logits_give_the_exact_verdict(mode, with_draft_probs):
    """Every case in one batch, in two orders, so each sequence must find its own rows."""
    gen = torch.Generator().manual_seed(0)
    forward = list(EXACT_CASES)
    for names in (forward, forward[::-1]):
        trees, logits = exact_batch(names, with_draft_probs, gen)
        if mode == "mixed":
            params = [GREEDY if i % 2 else SAMPLED for i in range(len(names))]
        else:
            params = [GREEDY if mode == "greedy" else SAMPLED] * len(names)
        for seed in range(3):
            verdicts = RejectionSampler(seed)(logits, trees, params, [None] * len(names))
            assert len(verdicts) == len(names)
            for name, tree, verdict in zip(names, trees, verdicts):
                _, _, nodes, next_token, kind = EXACT_CASES[name]
                tokens = [tree.token_ids[i] for i in nodes]
                assert (verdict.accepted_nodes, verdict.accepted_token_ids, verdict.next_token_id, verdict.kind) == (
                    nodes, tokens, next_token, kind), name
                assert verdict.token_ids == tokens + [next_token], name


def test_seeded_generators_give_the_same_exact_verdicts():
    names = list(EXACT_CASES)
    trees, logits = exact_batch(names, True, torch.Generator().manual_seed(1))
    gens = [torch.Generator().manual_seed(i) for i in range(len(names))]
    verdicts = RejectionSampler(0)(logits, trees, [SAMPLED] * len(names), gens)
    assert [(v.accepted_nodes, v.next_token_id, v.kind) for v in verdicts] == [
        (EXACT_CASES[n][2], EXACT_CASES[n][3], EXACT_CASES[n][4]) for n in names]


# ---- distribution: a toy language model on a small vocabulary ---------------------------------

V = 7
TRIALS = 20_000
_gen = torch.Generator().manual_seed(20240601)
P_ROOT = torch.softmax(torch.randn(V, generator=_gen) * 1.2, -1)  # target at the root
P_DEPTH1 = torch.softmax(torch.randn(V, V, generator=_gen) * 1.2, -1)  # [a]: at a depth-1 node with token a
P_DEPTH2 = torch.softmax(torch.randn(V, V, generator=_gen) * 1.2, -1)  # [a]: at a depth-2 node with token a
Q_ROOT = torch.softmax(torch.randn(V, generator=_gen) * 1.2, -1)  # proposer at the root
Q_DEPTH1 = torch.softmax(torch.randn(V, V, generator=_gen) * 1.2, -1)  # [a]: proposer below token a
ALL_LOGITS = torch.cat([P_ROOT[None], P_DEPTH1, P_DEPTH2]).log()  # rows: root, depth 1 by token, depth 2 by token


def target_logits(trees: list[DraftTree]) -> torch.Tensor:
    """The toy model's logits for every sequence: root row, then one row per node."""
    index = []
    for tree in trees:
        index.append(0)
        index += [1 + token if depth == 1 else 1 + V + token for token, depth in zip(tree.token_ids, tree.depths)]
    return ALL_LOGITS[index]


def draw_without_replacement(q: torch.Tensor, k: int, gen: torch.Generator):
    """k distinct tokens per row of q [n, V], each drawn from q with the earlier ones removed
    and renormalised. Returns tokens [n, k] and what each was drawn from [n, k, V]."""
    remaining = q.clone()
    tokens, probs = [], []
    for _ in range(k):
        dist = remaining / remaining.sum(-1, keepdim=True)
        token = torch.multinomial(dist, 1, generator=gen)
        tokens.append(token.squeeze(1))
        probs.append(dist)
        remaining.scatter_(1, token, 0.0)
    return torch.stack(tokens, 1), torch.stack(probs, 1)


def sampled_chain(length: int):
    def build(n: int, gen: torch.Generator) -> list[DraftTree]:
        first = torch.multinomial(Q_ROOT.expand(n, V), 1, generator=gen).squeeze(1)
        tokens, probs = [first], [Q_ROOT.expand(n, V)]
        if length == 2:
            tokens.append(torch.multinomial(Q_DEPTH1[first], 1, generator=gen).squeeze(1))
            probs.append(Q_DEPTH1[first])
        tokens, probs = torch.stack(tokens, 1).tolist(), torch.stack(probs, 1)
        return [DraftTree.chain(tokens[i], probs[i]) for i in range(n)]
    return build


def sampled_tree(num_children: int):
    """Root with num_children children drawn from Q_ROOT without replacement, each with two
    children drawn from Q_DEPTH1[its token] without replacement; nodes in depth-first order."""
    def build(n: int, gen: torch.Generator) -> list[DraftTree]:
        children, child_probs = draw_without_replacement(Q_ROOT.expand(n, V), num_children, gen)
        tokens, probs, parents = [], [], []
        for j in range(num_children):
            grandchildren, grandchild_probs = draw_without_replacement(Q_DEPTH1[children[:, j]], 2, gen)
            tokens += [children[:, j], grandchildren[:, 0], grandchildren[:, 1]]
            probs += [child_probs[:, j], grandchild_probs[:, 0], grandchild_probs[:, 1]]
            parents += [-1, 3 * j, 3 * j]
        tokens, probs = torch.stack(tokens, 1).tolist(), torch.stack(probs, 1)
        return [DraftTree(tokens[i], parents, probs[i]) for i in range(n)]
    return build


def ranked(probs: torch.Tensor) -> list[int]:
    return probs.argsort(descending=True).tolist()


def one_hot_chain(length: int):
    """Fixed proposals without draft_probs: the root's 2nd likeliest token, then the 1st below it."""
    first = ranked(P_ROOT)[1]
    tree = DraftTree.chain([first, ranked(P_DEPTH1[first])[0]][:length])
    return lambda n, gen: [tree] * n


def one_hot_tree(indicator_rows: bool = False):
    """Root children: the root's 2nd, 1st and 4th likeliest tokens; each with two children,
    the 1st and 3rd likeliest below it. No draft_probs, or (indicator_rows) draft_probs
    rows that are the one-hot proposals written out."""
    tokens, parents = [], []
    for child in [ranked(P_ROOT)[r] for r in (1, 0, 3)]:
        parents += [-1, len(tokens), len(tokens)]
        tokens += [child] + [ranked(P_DEPTH1[child])[r] for r in (0, 2)]
    probs = torch.nn.functional.one_hot(torch.tensor(tokens), V).float() if indicator_rows else None
    tree = DraftTree(tokens, parents, probs)
    return lambda n, gen: [tree] * n


STRUCTURES = {
    "chain1_sampled": sampled_chain(1),
    "chain2_sampled": sampled_chain(2),
    "chain2_one_hot": one_hot_chain(2),
    "tree3_sampled": sampled_tree(3),
    "tree3_one_hot": one_hot_tree(),
    "tree3_indicator_rows": one_hot_tree(indicator_rows=True),
}


def verify(structure: str, params: SamplingParams, seed: int, n: int = TRIALS):
    gen = torch.Generator().manual_seed(seed)
    trees = STRUCTURES[structure](n, gen)
    verdicts = RejectionSampler(seed)(target_logits(trees), trees, [params] * n, [None] * n)
    assert len(verdicts) == n
    return trees, verdicts


def first_token_fit(verdicts, params: SamplingParams) -> tuple[float, int, float]:
    first = torch.tensor([v.token_ids[0] for v in verdicts])
    return pearson(torch.bincount(first, minlength=V), reference_probs(ALL_LOGITS[0], params))


def check_verdict_shapes(trees, verdicts) -> None:
    """Accepted nodes form a root path carrying the emitted tokens; kinds match where it ends."""
    for tree, v in zip(trees, verdicts):
        parent = -1
        for node in v.accepted_nodes:
            assert tree.parents[node] == parent
            parent = node
        assert v.accepted_token_ids == [tree.token_ids[i] for i in v.accepted_nodes]
        assert v.kind == ("recovered" if parent in tree.parents else "bonus")


def check_emitted_tokens(verdicts, params: SamplingParams, seed: int):
    """x1 ~ p_root. (x1, x2) ~ p_root(x1) p_1[x1](x2): where a verdict stops after x1 the next
    step would draw x2 from the target after x1, which is done here. Among verdicts with a
    third token, x3 | x2 ~ p_2[x2]. All targets filtered by params (reference_probs)."""
    ref_root = reference_probs(ALL_LOGITS[0], params)
    ref_depth1 = torch.stack([reference_probs(ALL_LOGITS[1 + a], params) for a in range(V)])
    ref_depth2 = torch.stack([reference_probs(ALL_LOGITS[1 + V + a], params) for a in range(V)])
    gen = torch.Generator().manual_seed(seed + 1)

    first_ids = torch.tensor([v.token_ids[0] for v in verdicts])
    first = torch.bincount(first_ids, minlength=V)
    assert_fits(first, ref_root, "first token")
    assert_close_in_total_variation(first, ref_root, "first token")

    second = torch.tensor([v.token_ids[1] if len(v.token_ids) > 1 else -1 for v in verdicts])
    stopped = second < 0
    second[stopped] = torch.multinomial(ref_depth1[first_ids[stopped]], 1, generator=gen).squeeze(1)
    pairs = torch.bincount(first_ids * V + second, minlength=V * V).reshape(V, V)
    third = torch.zeros(V, V, dtype=torch.long)  # [x2, x3] among verdicts with a third token
    for v in verdicts:
        if len(v.token_ids) > 2:
            third[v.token_ids[1], v.token_ids[2]] += 1
    joint = ref_root[:, None] * ref_depth1
    assert_fits(pairs.flatten(), joint.flatten(), "first two tokens")
    assert_close_in_total_variation(pairs, joint, "first two tokens")
    assert_fits(third, ref_depth2, "third token given the second")
    return first, pairs, third


@pytest.mark.parametrize("structure", list(STRUCTURES))
def test_emitted_tokens_follow_the_target(structure):
    trees, verdicts = verify(structure, SAMPLED, seed=11)
    check_verdict_shapes(trees, verdicts)
    _, _, third = check_emitted_tokens(verdicts, SAMPLED, seed=11)
    max_depth = max(tree.max_depth for tree in trees)
    # the checks must have had something to check: acceptance happens, and not always
    lengths = torch.bincount(torch.tensor([len(v.token_ids) for v in verdicts]), minlength=max_depth + 2)
    assert lengths[1] > 0.05 * TRIALS and lengths[2:].sum() > 0.05 * TRIALS, lengths.tolist()
    if max_depth >= 2:
        assert third.sum() > 0.05 * TRIALS


@pytest.mark.parametrize("structure, params", [
    ("chain1_sampled", SamplingParams(temperature=0.8, top_k=4)),
    ("tree3_sampled", SamplingParams(temperature=1.3, top_p=0.7)),
    ("tree3_one_hot", SamplingParams(temperature=1.0, top_k=5, top_p=0.8)),
], ids=["chain_top_k", "tree_top_p", "one_hot_tree_top_k_top_p"])
def test_emitted_tokens_follow_the_filtered_target(structure, params):
    """Drafts come from the unfiltered q (so they often propose filtered-out tokens): what is
    emitted must still follow the filtered target, and never leave its support."""
    assert (reference_probs(ALL_LOGITS[0], params) == 0).sum() >= 2  # the filter does remove tokens
    _, verdicts = verify(structure, params, seed=12)
    check_emitted_tokens(verdicts, params, seed=12)


# ---- teeth: a wrong sampler must fail the same checks ----------------------------------------

TEETH_TRIALS = 10_000  # half the checks' trials: a wrong sampler must fail even with fewer


def resample_from_target(residual, q, token_id):
    """Wrong: after a rejection, keep drawing from the unmodified residual (biased toward the rejected token)."""
    return residual.clone()


def drop_only_the_token(residual, q, token_id):
    """Wrong for sampled drafts: treat every proposal as one-hot (ignore q, just remove the token)."""
    out = residual.clone()
    out[token_id] = 0.0
    return out / out.sum()


def unnormalised_one_hot_match(tree, kids, p, gen):
    """Wrong: accept one-hot child x_i with probability p(x_i), forgetting to divide by the
    mass left after the earlier rejections; on a miss draw from p without the children."""
    for child in kids:
        token = tree.token_ids[child]
        if float(torch.rand((), generator=gen)) < float(p[token]):
            return child, token
    rest = p.clone()
    rest[[tree.token_ids[c] for c in kids]] = 0.0
    return None, int(torch.multinomial(rest, 1, generator=gen))


def assert_far_from_target(verdicts) -> None:
    stat, dof, p_value = first_token_fit(verdicts, SAMPLED)
    critical = next(x / 10 for x in range(1, 10_000) if chi2_sf(x / 10, dof) < P_VALUE_MIN)
    assert stat > 5 * critical and p_value < 1e-9, (stat, dof, p_value)


@pytest.mark.parametrize("structure, wrong_residual", [
    ("chain1_sampled", resample_from_target),
    ("chain1_sampled", drop_only_the_token),
    ("tree3_sampled", resample_from_target),
    ("tree3_sampled", drop_only_the_token),
    ("tree3_indicator_rows", resample_from_target),
], ids=["chain-resample", "chain-drop_token", "tree-resample", "tree-drop_token", "indicator_tree-resample"])
def test_a_wrong_residual_fails_the_distribution_check(monkeypatch, structure, wrong_residual):
    monkeypatch.setattr(rejection_sampler, "residual_after_rejection", wrong_residual)
    _, verdicts = verify(structure, SAMPLED, seed=11, n=TEETH_TRIALS)
    assert_far_from_target(verdicts)


def test_a_wrong_one_hot_match_fails_the_distribution_check(monkeypatch):
    """Children without draft_probs take their own path (runtime.rejection_sampler._match_one_hot)."""
    monkeypatch.setattr(rejection_sampler, "_match_one_hot", unnormalised_one_hot_match)
    _, verdicts = verify("tree3_one_hot", SAMPLED, seed=11, n=TEETH_TRIALS)
    assert_far_from_target(verdicts)


# ---- reproducibility ---------------------------------------------------------------------------

def test_seeded_request_is_reproducible_whatever_else_is_in_the_batch():
    gen = torch.Generator().manual_seed(3)
    mine = sampled_tree(3)(1, gen)[0]
    chains = sampled_chain(2)(2, gen)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)

    def verdicts_of_mine(seed: int, others: list, sampler_seed: int, steps: int = 30) -> list:
        """`mine` (generator seeded with `seed`) after the (tree, params, seed) in others, over `steps` calls."""
        batch = others + [(mine, params, seed)]
        trees = [tree for tree, _, _ in batch]
        logits = target_logits(trees)
        gens = [None if s is None else torch.Generator().manual_seed(s) for _, _, s in batch]
        sampler = RejectionSampler(sampler_seed)
        return [sampler(logits, trees, [p for _, p, _ in batch], gens)[-1] for _ in range(steps)]

    alone = verdicts_of_mine(1234, [], sampler_seed=0)
    crowded = verdicts_of_mine(1234, [(chains[0], SAMPLED, None), (chains[1], SamplingParams(temperature=0.7), 99),
                                      (DraftTree([], []), SAMPLED, None), (mine, GREEDY, None)], sampler_seed=5)
    assert alone == crowded
    assert len({(tuple(v.accepted_nodes), v.next_token_id) for v in alone}) > 3  # the verdicts do vary
    assert verdicts_of_mine(4321, [], sampler_seed=0) != alone


def test_sampler_seed_reproduces_unseeded_requests():
    trees = sampled_tree(2)(64, torch.Generator().manual_seed(4))
    logits = target_logits(trees)
    runs = [RejectionSampler(seed)(logits, trees, [SAMPLED] * 64, [None] * 64) for seed in (8, 8, 9)]
    assert runs[0] == runs[1] != runs[2]


def test_one_hot_drafts_emit_what_plain_decoding_would_with_the_same_seed():
    """One draw per emitted token for one-hot children (rejection_sampler._match_one_hot): a
    seeded request's tokens do not depend on whether a deterministic proposer was used."""
    tree = one_hot_tree()(1, None)[0]
    empty = DraftTree([], [])
    for seed in range(100):
        [verdict] = RejectionSampler(0)(target_logits([tree]), [tree], [SAMPLED], [torch.Generator().manual_seed(seed)])
        plain_gen, plain, row = torch.Generator().manual_seed(seed), [], 0
        for depth in range(1, len(verdict.token_ids) + 1):
            [step] = RejectionSampler(0)(ALL_LOGITS[row:row + 1], [empty], [SAMPLED], [plain_gen])
            plain.append(step.next_token_id)
            row = (1 if depth == 1 else 1 + V) + step.next_token_id
        assert verdict.token_ids == plain, seed
