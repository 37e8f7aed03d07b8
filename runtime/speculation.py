"""How many draft tokens each sequence gets this step: measured acceptance against
measured cost.

Two things are measured as the engine runs:
  - per request, how much each draft node is worth: `hits[j]`, the chance that the j-th
    node of its tree lies on the accepted path, and how deep the tree is once it holds
    nodes 0..j (exponential moving averages over the verify steps that had a j-th node),
    and the conditional acceptance rate a (the chance that a draft token is accepted
    given that its parent was), used past the nodes measured; a new request starts from
    the curves of all requests so far;
  - the step time as a + b * tokens (StepCostModel), fitted online on steps without
    prefill, forgetting old steps, so b is the marginal cost of one more verified token
    in the current regime (nearly free when memory-bound, a full token's compute when
    the batch is large). Steps with and without drafts get separate fits: on a CPU the
    first extra token of a step costs far more than the next ones (oneDNN leaves its
    matrix-vector kernel), which one line through both would hide.

A third measure is the proposers' own drafting time (a draft model runs one forward per
depth, for all its sequences at once; n-gram lookups cost about nothing), fitted like
the steps: one draft forward takes a + b * sequences in it. A step's predicted time is
verifying all its tokens plus drafting: a per depth to the deepest tree, and b per
sequence per depth (the sum of the trees' depths; a chain of n tokens is n deep, a tree
of n nodes far less), so drafts shrink when a large batch makes the draft's forwards
dear.

A sequence's j-th draft node adds hits[j] expected tokens. Proposers order their nodes
so that the first n of them are the tree they would draft for a budget of n (a chain's
first n tokens; an EAGLE-2 tree's n likeliest nodes), so hits[j] is what the j-th node
of the budget is worth, whatever the tree's shape: a chain's curve falls as a^j, a wide
tree's far slower (its 10th node is a sibling as likely as the 3rd), which a chain
model would undervalue. The measured curve is fitted non-increasing (isotonic
regression), and past the measured nodes it goes on falling by a per node. All draft
nodes of the step are ordered by that gain, and the step takes the prefix of that order
that maximises expected tokens per predicted second (none at all when plain decoding is
faster). So drafts are long when acceptance is high and verification is cheap, shrink
as the batch grows, and stop for a sequence whose drafts keep missing. A sequence held
below its cap for `probe_interval` steps (no drafts at all, or a small tree) gets a
probe, a full-size draft: only verified nodes are measured, so without probes a stale
estimate (of its acceptance, of the worth of the nodes past its usual budget, or of the
cost of drafted steps, measured in a noisy moment) could switch speculation off, or keep
trees small, for good; a full-size probe measures them all where the engine would
operate. Probes are spaced so that they
cost at most `probe_budget` of the time (one sequence per probe, and with a draft model
a probe's draft forwards count), and at most 8 x probe_interval steps apart, so when
speculation does not pay, probing costs a few percent.
The other way round, with `plain_probe` (the engine sets it where plain steps run another
path than drafted ones: the CPU's compiled decode step, while verify steps run eagerly),
a step without drafts is taken as soon as drafted steps have been measured and plain ones
not, and again every probe_interval steps until one is measured (a step with prefill is
not): the drafted steps' fit says nothing of a plain step there. Without it, a CPU
engine whose drafts did not pay drafted on every step anyway, its only estimate of a
plain step the eager one.
"""
from __future__ import annotations

from dataclasses import dataclass


class StepCostModel:
    """Least-squares fit of step seconds = intercept + slope * tokens with exponential
    forgetting; the slope is pulled toward `prior_ratio` x the mean step time while the
    token counts seen barely vary (ridge with weight `prior_weight`, in tokens^2)."""

    def __init__(self, decay: float = 0.9, prior_ratio: float = 0.02, prior_weight: float = 1.0):
        self.decay = decay
        self.prior_ratio = prior_ratio
        self.prior_weight = prior_weight
        self.s0 = self.sx = self.sy = self.sxx = self.sxy = 0.0

    @property
    def has_data(self) -> bool:
        return self.s0 > 0

    def observe(self, num_tokens: int, seconds: float) -> None:
        d = self.decay
        x, y = float(num_tokens), float(seconds)
        self.s0 = d * self.s0 + 1.0
        self.sx = d * self.sx + x
        self.sy = d * self.sy + y
        self.sxx = d * self.sxx + x * x
        self.sxy = d * self.sxy + x * y

    def coefficients(self) -> tuple[float, float]:
        """(intercept, slope) in seconds and seconds per token."""
        mean_x, mean_y = self.sx / self.s0, self.sy / self.s0
        var_x = max(self.sxx / self.s0 - mean_x * mean_x, 0.0)
        cov = self.sxy / self.s0 - mean_x * mean_y
        prior_slope = self.prior_ratio * mean_y
        slope = (cov + self.prior_weight * prior_slope) / (var_x + self.prior_weight)
        slope = max(slope, 1e-3 * prior_slope, 1e-9)
        return max(mean_y - slope * mean_x, 0.0), slope


@dataclass(slots=True)
class _Acceptance:
    rate: float  # a draft token's chance of acceptance given its parent's
    hits: list[float]  # hits[j]: the j-th node's chance of being on the accepted path, where measured
    depths: list[float]  # depths[j]: the tree's depth once it holds nodes 0..j, where measured
    steps_below_cap: int = 0  # steps since its last full-size draft


def _non_increasing(values: list[float]) -> list[float]:
    """The closest non-increasing sequence in squared error (pool adjacent violators):
    noisy estimates of a falling curve, without the downward bias of a running minimum."""
    blocks: list[list[float]] = []  # [mean, count]
    for value in values:
        blocks.append([value, 1.0])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            mean, count = blocks.pop()
            blocks[-1] = [(blocks[-1][0] * blocks[-1][1] + mean * count) / (blocks[-1][1] + count),
                          blocks[-1][1] + count]
    return [mean for mean, count in blocks for _ in range(int(count))]


def _smooth(average: list[float], values: list[float], weight: float) -> None:
    """average[j] moves toward values[j] by weight (average at least as long as values)."""
    for j, value in enumerate(values):
        average[j] += weight * (value - average[j])


class SpeculationController:
    def __init__(self, adaptive: bool = True, prior_acceptance: float = 0.6, smoothing: float = 0.2,
                 probe_interval: int = 8, probe_budget: float = 0.05, draft_decay: float = 0.8,
                 node_smoothing: float = 0.1, shared_smoothing: float = 0.02, plain_probe: bool = False):
        self.adaptive = adaptive
        self.plain_probe = plain_probe  # plain steps run another path: measure one (the module docstring)
        self.steps_since_plain_probe = probe_interval  # (so that the first chance takes one)
        self.prior_acceptance = prior_acceptance
        self.smoothing = smoothing  # of a request's acceptance rate, per verdict
        self.node_smoothing = node_smoothing  # of a request's node curve, per verify step
        self.shared_smoothing = shared_smoothing  # of the curve of all requests
        self.shared = _Acceptance(prior_acceptance, [], [])  # the curves over all requests: where new ones start
        self.probe_interval = probe_interval
        self.probe_budget = probe_budget
        self.draft_decay = draft_decay
        self.steps_since_probe = 0
        self._probing = False  # the step being planned drafts only for a probe
        self.cost = StepCostModel()  # steps that verified drafts
        self.plain_cost = StepCostModel()  # steps without drafts
        self.draft_cost = StepCostModel(decay=draft_decay)  # one draft forward: seconds against its sequences
        self.requests: dict[str, _Acceptance] = {}

    def acceptance(self, request_id: str) -> float:
        state = self.requests.get(request_id)
        return self.prior_acceptance if state is None else state.rate

    def _state(self, request_id: str) -> _Acceptance:
        state = self.requests.get(request_id)
        if state is None:
            state = self.requests[request_id] = _Acceptance(self.prior_acceptance, list(self.shared.hits),
                                                            list(self.shared.depths))
        return state

    def node_plan(self, request_id: str, cap: int) -> list[tuple[float, float]]:
        """For each of the sequence's first `cap` draft nodes: (the expected tokens it adds,
        the tree's depth with it). Gains are non-increasing, depths non-decreasing."""
        state = self.requests.get(request_id) or self.shared  # (whose rate is the prior)
        measured = _non_increasing(state.hits[:cap])
        plan, gain, depth = [], 1.0, 0.0
        for j in range(cap):
            gain = measured[j] if j < len(measured) else gain * state.rate
            depth = max(depth, state.depths[j]) if j < len(state.depths) else depth + 1.0
            plan.append((gain, depth))
        return plan

    def _step_coefficients(self, has_drafts: bool) -> tuple[float, float]:
        model = self.plain_cost if not has_drafts and self.plain_cost.has_data else self.cost
        return (model if model.has_data else self.plain_cost).coefficients()

    def _draft_coefficients(self) -> tuple[float, float]:
        return self.draft_cost.coefficients() if self.draft_cost.has_data else (0.0, 0.0)

    def step_seconds(self, num_tokens: int, num_draft_tokens: int) -> float:
        """Predicted time of a step running num_tokens tokens, num_draft_tokens of them drafts."""
        intercept, per_token = self._step_coefficients(num_draft_tokens > 0)
        return intercept + per_token * num_tokens

    def draft_seconds(self, depth: float, sequence_depths: float) -> float:
        """Predicted time to propose trees at most `depth` deep whose depths sum to
        sequence_depths (0 when nothing is drafted)."""
        per_forward, per_sequence = self._draft_coefficients()
        return per_forward * depth + per_sequence * sequence_depths

    def budgets(self, request_ids: list[str], caps: list[int]) -> list[int]:
        """Draft nodes per sequence this step, each at most its cap."""
        if not self.adaptive or not (self.cost.has_data or self.plain_cost.has_data):
            return list(caps)
        if self.plain_probe and not self.plain_cost.has_data:
            self.steps_since_plain_probe += 1
            if self.steps_since_plain_probe > self.probe_interval:
                self.steps_since_plain_probe = 0
                return [0] * len(caps)
        plans = [self.node_plan(request_id, cap) for request_id, cap in zip(request_ids, caps)]
        # every draft node in the order of its gain (each sequence's gains are non-increasing,
        # and the sort is stable, so a sequence's nodes stay in order)
        order = sorted(((gain, i) for i, plan in enumerate(plans) for gain, _ in plan), key=lambda item: -item[0])
        # the best prefix of that order by expected tokens per second
        base = len(caps)  # every sequence emits at least one token
        best_k, best_rate, expected = 0, base / self.step_seconds(base, 0), float(base)
        intercept, per_token = self._step_coefficients(True)
        per_forward, per_sequence = self._draft_coefficients()
        taken = [0] * len(caps)
        depth = sequence_depths = 0.0
        for k, (gain, i) in enumerate(order, start=1):
            expected += gain
            before = plans[i][taken[i] - 1][1] if taken[i] else 0.0
            after = plans[i][taken[i]][1]
            taken[i] += 1
            depth, sequence_depths = max(depth, after), sequence_depths + after - before
            # step_seconds(base + k, k) + draft_seconds(depth, sequence_depths), inlined
            seconds = intercept + per_token * (base + k) + per_forward * depth + per_sequence * sequence_depths
            rate = expected / seconds
            if rate > best_rate:
                best_k, best_rate = k, rate
        budgets = [0] * len(caps)
        for _, i in order[:best_k]:
            budgets[i] += 1
        self.steps_since_probe += 1
        waiting = []  # sequences due for a probe
        for i, request_id in enumerate(request_ids):
            state = self._state(request_id)
            if budgets[i] >= caps[i]:  # a full-size draft (or none allowed): nothing left unmeasured
                state.steps_below_cap = 0
                continue
            state.steps_below_cap += 1
            if state.steps_below_cap >= self.probe_interval:
                waiting.append(i)
        self._probing = False
        if waiting and self.steps_since_probe >= self._probe_spacing(
                base, max(caps[i] for i in waiting), max(plans[i][-1][1] for i in waiting)):
            i = max(waiting, key=lambda j: self.requests[request_ids[j]].steps_below_cap)
            self._probing = not any(budgets)
            budgets[i] = caps[i]
            self.requests[request_ids[i]].steps_below_cap = 0
            self.steps_since_probe = 0
        return budgets

    def _probe_spacing(self, num_tokens: int, cap: int, depth: float) -> int:
        """Steps between probes so that a probe's extra time stays within probe_budget, at
        most 8 x probe_interval. The extra time is the proposer's drafting (a tree `depth`
        deep) plus the verify tokens at the plain steps' marginal cost: the drafted steps'
        fit may be the stale estimate the probe is there to refresh."""
        plain = self.step_seconds(num_tokens, 0)
        if plain <= 0:
            return self.probe_interval
        per_token = (self.plain_cost if self.plain_cost.has_data else self.cost).coefficients()[1]
        extra = per_token * cap + self.draft_seconds(depth, depth)
        spacing = int(extra / (self.probe_budget * plain)) + 1
        return min(max(self.probe_interval, spacing), 8 * self.probe_interval)

    def observe_verdict(self, request_id: str, num_accepted: int, rejected: bool) -> None:
        """A verify step accepted num_accepted draft tokens, then (if rejected) missed one."""
        state = self._state(request_id)
        for outcome in [1.0] * num_accepted + ([0.0] if rejected else []):
            state.rate += self.smoothing * (outcome - state.rate)

    def observe_tree(self, request_id: str, node_depths: list[int], accepted_nodes: list[int]) -> None:
        """The verified tree's nodes had these depths (in the proposer's order, parents
        first) and the accepted path went through accepted_nodes (indices)."""
        accepted = set(accepted_nodes)
        hits = [1.0 if j in accepted else 0.0 for j in range(len(node_depths))]
        depths, deepest = [], 0
        for d in node_depths:
            deepest = max(deepest, d)
            depths.append(float(deepest))
        for state, weight in ((self._state(request_id), self.node_smoothing), (self.shared, self.shared_smoothing)):
            while len(state.hits) < len(hits):  # a node measured for the first time starts at its estimate
                state.hits.append((state.hits[-1] if state.hits else 1.0) * state.rate)
            state.depths += depths[len(state.depths):]
            _smooth(state.hits, hits, weight)
            _smooth(state.depths, depths, weight)

    def observe_step(self, num_tokens: int, seconds: float, has_drafts: bool = True) -> None:
        """A decode step (proposing excluded) ran num_tokens tokens in `seconds`."""
        if has_drafts and self._probing and self.cost.has_data:
            predicted = self.step_seconds(num_tokens, 1)
            if not 0.5 * predicted <= seconds <= 2 * predicted:  # the probe finds the fit stale: start over
                self.cost = StepCostModel()
        self._probing = False
        (self.cost if has_drafts else self.plain_cost).observe(num_tokens, seconds)

    def observe_drafting(self, depth: int, sequence_depths: int, seconds: float) -> None:
        """Proposers took `seconds` to draft trees at most `depth` deep, whose depths sum
        to sequence_depths: `depth` forwards of sequence_depths / depth sequences on average."""
        self.draft_cost.observe(sequence_depths / depth, seconds / depth)

    def release(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
