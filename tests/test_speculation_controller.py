"""The draft-size controller (runtime.speculation): the step cost fit on synthetic data,
and the draft budgets against an exhaustive search for the best tokens / second, with
probes, caps, and the jump in cost from plain to drafted steps.

Pure Python on the CPU, seeded, and runs in a second."""
from __future__ import annotations

import itertools
import random

import pytest

from runtime.speculation import SpeculationController, StepCostModel


# ---- step cost model and draft budgets -------------------------------------------------------

def test_cost_model_recovers_a_noiseless_line():
    rng = random.Random(10)
    for intercept, slope in ((0.012, 4e-5), (0.030, 1e-3), (0.005, 2e-6)):
        exact = StepCostModel(prior_weight=0.0)
        default = StepCostModel()
        for _ in range(200):
            x = rng.randint(1, 256)
            exact.observe(x, intercept + slope * x)
            default.observe(x, intercept + slope * x)
        assert exact.has_data
        a, b = exact.coefficients()
        assert a == pytest.approx(intercept, rel=1e-6) and b == pytest.approx(slope, rel=1e-6)
        a, b = default.coefficients()  # the ridge prior barely moves a well-spread fit
        assert a == pytest.approx(intercept, rel=0.02) and b == pytest.approx(slope, rel=0.02)


def test_cost_model_forgets_an_old_regime_and_falls_back_to_the_prior():
    rng = random.Random(11)
    model = StepCostModel()
    for intercept, slope in ((0.05, 1e-3), (0.01, 2e-5)):
        for _ in range(400):
            x = rng.randint(1, 128)
            model.observe(x, intercept + slope * x)
    a, b = model.coefficients()
    assert a == pytest.approx(0.01, rel=0.02) and b == pytest.approx(2e-5, rel=0.05)
    # constant token counts carry no slope information: the slope is prior_ratio x the mean step
    flat = StepCostModel()
    for _ in range(50):
        flat.observe(16, 0.02)
    a, b = flat.coefficients()
    assert b == pytest.approx(flat.prior_ratio * 0.02) and a == pytest.approx(0.02 - 16 * b)
    assert not StepCostModel().has_data


def feed_steps(controller: SpeculationController, intercept: float, slope: float, seed: int = 0) -> None:
    rng = random.Random(seed)
    for _ in range(100):
        x = rng.randint(1, 200)
        controller.observe_step(x, intercept + slope * x)


def test_budgets_are_the_caps_when_not_adaptive_or_without_data():
    controller = SpeculationController(adaptive=False)
    feed_steps(controller, 0.01, 0.01)
    for _ in range(20):
        controller.observe_verdict("a", 0, True)
    assert controller.budgets(["a", "b", "c"], [5, 0, 3]) == [5, 0, 3]
    assert SpeculationController().budgets(["a", "b"], [4, 2]) == [4, 2]  # no step measured yet


def test_high_acceptance_and_cheap_tokens_reach_the_cap():
    controller = SpeculationController()
    feed_steps(controller, 0.02, 1e-6)
    for rid in ("a", "b"):
        for _ in range(50):
            controller.observe_verdict(rid, 8, False)
        assert controller.acceptance(rid) > 0.99
    for _ in range(20):
        assert controller.budgets(["a", "b"], [8, 3]) == [8, 3]


def test_low_acceptance_stops_drafting_except_for_probes():
    controller = SpeculationController(probe_interval=5)
    feed_steps(controller, 0.02, 1e-6)
    for _ in range(60):
        controller.observe_verdict("bad", 0, True)
        controller.observe_verdict("good", 6, False)
    assert controller.acceptance("bad") < 1e-4
    bad = []
    for step in range(1, 21):
        budgets = controller.budgets(["good", "bad"], [6, 6])
        assert budgets[0] == 6
        bad.append(budgets[1])
    assert bad == [6 if step % 5 == 0 else 0 for step in range(1, 21)]  # a full-size probe
    # a probe that is answered (however it went) restarts the count
    controller.budgets(["bad"], [6])
    controller.observe_verdict("bad", 0, True)
    assert [controller.budgets(["bad"], [6])[0] for _ in range(5)] == [0, 0, 0, 0, 6]
    # drafts come back once the sequence's drafts start landing again
    for _ in range(30):
        controller.observe_verdict("bad", 4, False)
    assert controller.budgets(["bad"], [6])[0] > 0


def test_budgets_shrink_as_verified_tokens_get_expensive():
    controller = SpeculationController(prior_acceptance=0.8)
    feed_steps(controller, 0.01, 1e-3)  # 10 ms a step plus 1 ms a token: compute-bound soon
    means = []
    for batch in (1, 2, 4, 8, 16, 32, 64):
        ids = [f"s{batch}-{i}" for i in range(batch)]
        budgets = controller.budgets(ids, [8] * batch)
        means.append(sum(budgets) / batch)
    assert means == sorted(means, reverse=True)
    assert means[0] >= 4 and means[-1] == 0
    # the same batch with cheap tokens drafts deeply
    cheap = SpeculationController(prior_acceptance=0.8)
    feed_steps(cheap, 0.01, 1e-6)
    assert sum(cheap.budgets([f"s{i}" for i in range(64)], [8] * 64)) / 64 >= 4


def throughput(budgets, rates, intercept, slope) -> float:
    """Expected tokens per second of a step: each sequence emits 1 + sum_j rate^j tokens."""
    tokens = sum(1 + sum(rate ** j for j in range(1, b + 1)) for rate, b in zip(rates, budgets))
    return tokens / (intercept + slope * (len(budgets) + sum(budgets)))


def test_budgets_maximise_expected_throughput():
    """Against every budget vector within the caps."""
    rng = random.Random(12)
    for trial in range(150):
        controller = SpeculationController(probe_interval=10**9)
        intercept, slope = rng.choice([0.005, 0.02, 0.05]), rng.choice([1e-5, 3e-4, 2e-3, 1e-2])
        feed_steps(controller, intercept, slope, seed=trial)
        n = rng.randint(1, 3)
        ids = [f"q{i}" for i in range(n)]
        for rid in ids:
            for _ in range(rng.randint(0, 12)):
                accepted = rng.randint(0, 4)
                controller.observe_verdict(rid, accepted, rng.random() < 0.5)
        caps = [rng.randint(0, 4) for _ in range(n)]
        rates = [controller.acceptance(r) for r in ids]
        a, b = controller.cost.coefficients()
        budgets = controller.budgets(ids, caps)
        assert all(0 <= x <= cap for x, cap in zip(budgets, caps))
        best = max(throughput(v, rates, a, b) for v in itertools.product(*(range(c + 1) for c in caps)))
        assert throughput(budgets, rates, a, b) == pytest.approx(best, rel=1e-9), (rates, caps, budgets)


def test_budgets_never_exceed_caps():
    rng = random.Random(13)
    controller = SpeculationController(probe_interval=3)
    feed_steps(controller, 0.01, 1e-4)
    ids = [f"z{i}" for i in range(10)]
    for step in range(200):
        caps = [rng.choice([0, 0, 1, 2, 5, 16]) for _ in ids]
        budgets = controller.budgets(ids, caps)
        assert all(0 <= x <= cap for x, cap in zip(budgets, caps)), (caps, budgets)
        assert all(x == 0 for x, cap in zip(budgets, caps) if cap == 0)
        for rid, x in zip(ids, budgets):
            if x and rng.random() < 0.7:
                accepted = rng.randint(0, x)
                controller.observe_verdict(rid, accepted, accepted < x)
        if step % 7 == 0:
            x = rng.randint(1, 200)
            controller.observe_step(x, 0.01 + rng.choice([1e-6, 1e-4, 1e-2]) * x)
    controller.release("z0")
    assert controller.acceptance("z0") == controller.prior_acceptance


def test_first_draft_token_pays_the_jump_from_plain_to_verify_steps():
    """CPU-like costs: a plain step 48 ms, any step with drafts 58 ms + 0.3 ms a token. A
    sequence accepting 10% of its drafts is not worth the jump; one accepting 60% is."""
    def controller_with(rate: float) -> SpeculationController:
        controller = SpeculationController(prior_acceptance=rate, probe_interval=10**9)
        for tokens in (1, 1, 1):
            controller.observe_step(tokens, 0.048, has_drafts=False)
        for tokens in (2, 5, 9, 13):
            controller.observe_step(tokens, 0.058 + 0.0003 * tokens, has_drafts=True)
        return controller

    assert controller_with(0.1).budgets(["s"], [8]) == [0]
    assert controller_with(0.6).budgets(["s"], [8])[0] >= 3
    # one line through both kinds of steps would see a cheap first token and draft anyway
    merged = SpeculationController(prior_acceptance=0.1, probe_interval=10**9)
    for tokens, seconds in ((1, 0.048), (1, 0.048), (1, 0.048), (2, 0.0586), (5, 0.0595), (9, 0.0607)):
        merged.observe_step(tokens, seconds)
    assert merged.budgets(["s"], [8])[0] > 0


def test_probes_refresh_a_stale_cost_estimate_one_sequence_a_step():
    """Drafted steps once measured (in a noisy moment) at 10x their cost switch drafting off;
    full-size probes of one sequence, spaced by their predicted cost but at most
    8 x probe_interval steps apart, measure them again and drafting comes back."""
    controller = SpeculationController(prior_acceptance=0.8, probe_interval=4)
    for _ in range(5):
        controller.observe_step(3, 0.045, has_drafts=False)
        controller.observe_step(12, 0.6, has_drafts=True)
    ids = ["a", "b", "c"]
    totals = []
    for _ in range(100):
        budgets = controller.budgets(ids, [8, 8, 8])
        totals.append(sum(budgets))
        if any(budgets):
            controller.observe_step(3 + sum(budgets), 0.05 + 0.0003 * sum(budgets), has_drafts=True)
        else:
            controller.observe_step(3, 0.045, has_drafts=False)
    first_probe = next(i for i, t in enumerate(totals) if t)
    assert 3 <= first_probe <= 32 and totals[first_probe] == 8  # a full-size probe, one sequence only
    assert all(t >= 6 for t in totals[-10:])  # drafting is back


def test_draft_time_per_depth_shortens_and_stops_drafts():
    """A draft model costs a forward per depth: drafts get as deep as that pays against
    expected tokens (1 - a^(k+1)) / (1 - a), and none when a draft forward costs about as
    much as the target step it saves."""
    def budget(draft_per_depth: float, rate: float) -> int:
        controller = SpeculationController(probe_interval=10**9)
        for _ in range(20):
            controller.observe_step(1, 0.3, has_drafts=False)
            for k in range(1, 9):
                controller.observe_step(1 + k, 0.3 + 1e-3 * k, has_drafts=True)
                controller.observe_drafting(k, k, 0.01 + draft_per_depth * k)
        controller.observe_verdict("r", 0, False)
        controller.requests["r"].rate = rate
        [k] = controller.budgets(["r"], [8])
        return k

    def best_k(draft_per_depth: float, rate: float) -> int:
        def tokens_per_s(k):
            seconds = 0.3 + 1e-3 * k + (0.01 + draft_per_depth * k if k else 0.0)
            return (1 - rate ** (k + 1)) / (1 - rate) / seconds
        return max(range(9), key=tokens_per_s)

    for per_depth, rate in ((0.005, 0.9), (0.07, 0.9), (0.07, 0.6), (0.3, 0.6)):
        assert abs(budget(per_depth, rate) - best_k(per_depth, rate)) <= 1, (per_depth, rate)
    assert budget(0.3, 0.6) == 0  # a draft forward as dear as a target step: no drafts
    assert budget(0.005, 0.9) >= 6


def test_draft_forwards_dearer_with_the_batch_shorten_drafts():
    """A draft forward of n sequences costs 0.02 + 0.01 n seconds: one sequence drafts
    deep, sixteen draft shallower, each close to the best uniform depth found by search."""
    controller = SpeculationController(probe_interval=10**9)
    rng = random.Random(5)
    for _ in range(300):
        n, k = rng.randint(1, 16), rng.randint(1, 8)
        controller.observe_step(n, 0.3 + 1e-3 * n, has_drafts=False)
        controller.observe_step(n * (k + 1), 0.3 + 1e-3 * n * (k + 1), has_drafts=True)
        controller.observe_drafting(k, n * k, k * (0.02 + 0.01 * n))
    rate = 0.8

    def best_uniform_k(n: int) -> int:
        def tokens_per_s(k):
            seconds = 0.3 + 1e-3 * n * (k + 1) + k * (0.02 + 0.01 * n)
            return n * (1 - rate ** (k + 1)) / (1 - rate) / seconds
        return max(range(9), key=tokens_per_s)

    depths = {}
    for n in (1, 16):
        ids = [f"r{i}" for i in range(n)]
        for rid in ids:
            controller.observe_verdict(rid, 0, False)
            controller.requests[rid].rate = rate
        budgets = controller.budgets(ids, [8] * n)
        depths[n] = max(budgets)
        assert abs(depths[n] - best_uniform_k(n)) <= 1, (n, budgets, best_uniform_k(n))
    assert depths[16] < depths[1]
