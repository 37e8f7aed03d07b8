"""Sampling: top-k/top-p masks against a sorted reference, greedy == argmax, the sampled
distribution against softmax(logits / T) (chi-square on 20k draws), per-request seeds
through the engine, and request validation."""
from __future__ import annotations

import math

import pytest
import torch

from runtime.rejection_sampler import RejectionSampler
from runtime.sampling import apply_top_k_top_p, target_probs
from runtime.sampling_params import SamplingParams
from runtime.draft_tree import DraftTree

EMPTY = DraftTree([], [])


def plain_tokens(logits, params, generators, seed=0) -> list[int]:
    """Plain decoding: every row verifies an empty draft tree."""
    verdicts = RejectionSampler(seed)(logits, [EMPTY] * len(params), params, generators)
    assert all(v.kind == "plain" and not v.accepted_nodes for v in verdicts)
    return [v.next_token_id for v in verdicts]


# chi-square quantiles at p = 0.999, by degrees of freedom (a wrong sampler lands far above)
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def reference_kept(row: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """Tokens top-k then top-p keep, computed the slow, obvious way in float64."""
    order = sorted(range(len(row)), key=lambda i: -float(row[i]))
    if top_k > 0:
        order = order[:top_k]
    weights = [math.exp(float(row[i]) - float(row[order[0]])) for i in order]
    total = sum(weights)
    kept, mass = set(), 0.0
    for i, w in zip(order, weights):
        if mass >= top_p:  # the tokens above already cover top_p
            break
        kept.add(i)
        mass += w / total
    return kept


def test_top_k_top_p_masks_match_a_sorted_reference():
    gen = torch.Generator().manual_seed(0)
    num_rows, vocab = 64, 50
    logits = torch.randn(num_rows, vocab, generator=gen) * 3
    top_k = torch.randint(0, 12, (num_rows,), generator=gen)
    top_p = torch.rand(num_rows, generator=gen) * 0.99 + 0.01
    top_p[::4] = 1.0  # top-k alone
    top_k[1::4] = 0  # top-p alone
    masked = apply_top_k_top_p(logits, top_k, top_p)
    for i in range(num_rows):
        kept = set(torch.nonzero(masked[i] > float("-inf")).flatten().tolist())
        assert kept == reference_kept(logits[i], int(top_k[i]), float(top_p[i])), f"row {i}"
        assert torch.equal(masked[i][list(kept)], logits[i][list(kept)]), "kept logits must be unchanged"


@pytest.mark.parametrize("top_p, num_kept", [(0.4, 1), (0.5, 1), (0.75, 2), (0.85, 3), (0.97, 4), (1.0, 4)])
def test_top_p_keeps_the_smallest_set_covering_p(top_p, num_kept):
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    masked = apply_top_k_top_p(probs.log(), torch.tensor([0]), torch.tensor([top_p]))
    kept = torch.nonzero(masked[0] > float("-inf")).flatten().tolist()
    assert sorted(kept) == sorted([1, 3, 2, 0][:num_kept])


def test_top_k_one_is_argmax_and_large_k_keeps_all():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    masked = apply_top_k_top_p(logits, torch.tensor([1, 1, 30, 100]), torch.ones(4))
    for i in (0, 1):
        assert torch.nonzero(masked[i] > float("-inf")).flatten().tolist() == [int(logits[i].argmax())]
    assert torch.equal(masked[2:], logits[2:])


def test_greedy_is_argmax():
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(2))
    greedy = SamplingParams(temperature=0.0)
    assert plain_tokens(logits, [greedy] * 16, [None] * 16) == logits.argmax(-1).tolist()
    # greedy rows stay argmax when the batch also samples
    params = [greedy if i % 2 else SamplingParams(temperature=1.0) for i in range(16)]
    tokens = plain_tokens(logits, params, [None] * 16)
    assert tokens[1::2] == logits[1::2].argmax(-1).tolist()
    probs = target_probs(logits, params)
    assert torch.equal(probs[1::2], torch.nn.functional.one_hot(logits[1::2].argmax(-1), 1000).float())


def test_target_probs_is_softmax_of_scaled_logits():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(3))
    temps = [0.5, 1.0, 2.0]
    probs = target_probs(logits, [SamplingParams(temperature=t) for t in temps])
    for i, t in enumerate(temps):
        torch.testing.assert_close(probs[i], (logits[i] / t).softmax(-1))


LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 1.5])


def chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, int]:
    support = expected_probs > 0
    assert counts[~support].sum() == 0, "a token outside the distribution's support was sampled"
    expected = expected_probs[support] * counts.sum()
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 0, 1.0), (1.0, 0, 1.0), (1.5, 0, 1.0),
                                                        (1.3, 5, 1.0), (1.0, 0, 0.8), (1.2, 6, 0.9)])
def test_sampled_distribution_matches_the_target(temperature, top_k, top_p):
    """20k draws through the sampler against softmax(logits / T) restricted to what top-k/top-p
    keep (computed here by reference_kept), renormalised."""
    n = 20_000
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)] * n
    tokens = plain_tokens(LOGITS.expand(n, -1).clone(), params, [None] * n, seed=1234)
    counts = torch.bincount(torch.tensor(tokens), minlength=len(LOGITS)).double()
    kept = sorted(reference_kept(LOGITS / temperature, top_k, top_p))
    expected = torch.zeros(len(LOGITS), dtype=torch.float64)
    expected[kept] = (LOGITS[kept].double() / temperature).softmax(-1)
    stat, dof = chi_square(counts, expected)
    if dof == 0:
        return
    assert stat < CHI2_999[dof], f"chi-square {stat:.1f} with {dof} degrees of freedom"
    assert 0.5 * float((counts / n - expected).abs().sum()) < 0.02  # total variation


def test_per_row_generators_are_reproducible_and_independent():
    logits = (LOGITS / 0.8).expand(6, -1).contiguous()
    params = [SamplingParams(temperature=1.0)] * 6

    def draw(seeds):
        gens = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
        sampler = RejectionSampler(seed=99)
        n = len(seeds)
        return [[v.next_token_id for v in sampler(logits[:n], [EMPTY] * n, params[:n], gens)] for _ in range(20)]

    runs = [list(zip(*draw(seeds))) for seeds in ([5, None, 6], [5, 7, 6], [5, None, 6])]
    assert runs[0][0] == runs[1][0] == runs[2][0]  # seed 5, whatever its neighbours
    assert runs[0][2] == runs[1][2]  # seed 6, whatever its neighbours


# ---- through the engine ----------------------------------------------------------------------

def test_seeded_request_reproducible_whatever_else_is_in_the_batch(engine_f32, generate):
    prompt = "Tell me a story about a cat who"
    seeded = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=1234, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    [alone] = generate(engine_f32, [prompt], seeded)
    [again] = generate(engine_f32, [prompt], seeded)
    assert alone == again and len(alone) == 16
    [greedy_alone] = generate(engine_f32, ["The weather today is"], greedy)
    others = ["Write a haiku about autumn leaves falling on", "1 + 1 ="]
    batched = generate(
        engine_f32, [others[0], prompt, "The weather today is", others[1]],
        [SamplingParams(temperature=1.2, max_tokens=20, seed=7), seeded, greedy,
         SamplingParams(temperature=0.8, max_tokens=8)])
    assert batched[1] == alone
    assert batched[2] == greedy_alone
    [other_seed] = generate(engine_f32, [prompt], SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16,
                                                                 seed=4321, ignore_eos=True))
    assert other_seed != alone


def test_prompt_longer_than_the_context_is_refused_before_scheduling(engine_f32):
    engine = engine_f32
    requests_before = dict(engine.requests)
    too_long = [100] * engine.max_model_len
    with pytest.raises(ValueError, match="context"):
        engine.add_request(too_long, SamplingParams(max_tokens=1))
    assert not engine.has_unfinished and engine.requests == requests_before
    for bad in ([], [engine.model_config.vocab_size], [-1]):
        with pytest.raises(ValueError):
            engine.add_request(bad)
        assert not engine.has_unfinished
    rid = engine.add_request(too_long[1:], SamplingParams(max_tokens=1))  # the longest that fits
    assert engine.abort(rid)
    assert not engine.has_unfinished
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_p=-0.2),
                                    dict(max_tokens=0), dict(max_tokens=-3), dict(max_tokens=2.5),
                                    dict(max_tokens=True), dict(top_k=-2), dict(top_k=1.5), dict(seed="1"),
                                    dict(stop=[""]), dict(stop_token_ids=[-1]),
                                    # what the offline CLI's JSON lines can hold: true is not an integer
                                    dict(seed=True), dict(top_k=True), dict(logprobs=True), dict(stop=5),
                                    dict(stop_token_ids=[True]), dict(stop_token_ids=3), dict(ignore_eos="yes"),
                                    dict(num_speculative_tokens=False)])
def test_sampling_params_validation(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_and_normalisation():
    assert SamplingParams(temperature=0).is_greedy
    assert not SamplingParams().is_greedy
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="###").stop == ["###"]
    SamplingParams(temperature=0.0, top_p=1.0, top_k=0, max_tokens=1)  # boundaries are valid
