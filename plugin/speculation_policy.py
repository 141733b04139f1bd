"""Adaptive speculation: how many draft tokens each request gets next step, from what it has accepted
and what a step costs. Pure numpy, no vLLM: the proposer feeds it counts and timings, and asks it for
K per request before drafting.

Vocabulary:
- acceptance a[i, j]: the chance that request i's draft at position j is accepted, given that the drafts
  before it were (the target tests draft j only when drafts 0..j-1 passed).
- gain g[i, j] = a[i, 0] * ... * a[i, j]: the tokens the (j + 1)-th draft adds to the step's expected
  output. With K drafts request i emits E_i(K) = 1 + g[i, 0] + ... + g[i, K - 1] tokens; the gains never
  grow with j, so the best set of drafts for a row is always a prefix.
- step time, for draft lengths K_i over n requests, d = sum(K_i) (the model `StepCosts` holds):
      base + drafting * [d > 0] + verify_extra(d) + per_draft_token * d + per_draft_forward * max(K_i)
  where verify_extra(d) is the target's extra time for d more tokens in its forward (not linear: flat
  while the hardware is bound by weight traffic, then rising), per_draft_token what one more draft
  token costs besides (the target attends over the request's context for it and computes its logits;
  the engine schedules it and processes its outcome), and
  per_draft_forward one more batched draft forward. The draft runs max(K_i) forwards. Where they feed
  only the rows still drafting (the native forward), a row fed is a cost per draft token and a forward's
  fixed cost is per_draft_forward; elsewhere each feeds every row up to the last one still drafting
  (rows before it that have stopped feed scratch, so that the forward reads the cache as a view), so a
  forward is costed as feeding the whole batch, and one long draft in a batch of short ones pays for
  its extra forwards over every row.
- goodput: sum(E_i(K_i)) / step time, in tokens per second. `choose_draft_lengths` maximises it.

Losslessness does not depend on any of this: K is chosen from past acceptance and measured costs only,
before the step, and every draft is verified by the exact test whatever its number.
"""

from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np


@dataclass
class StepCosts:
    """Seconds, for the step-time model above; `base` is the step with no drafts for this batch.
    verify_extra, when given, adds the target's extra time for verifying d more tokens ([d] -> [d]
    seconds, increasing): a forward's time is not linear in its tokens (flat while the hardware is
    bound by weight traffic, then rising)."""

    base: float
    drafting: float = 0.0
    per_draft_token: float = 0.0
    per_draft_forward: float = 0.0
    verify_extra: Callable[[np.ndarray], np.ndarray] | None = field(default=None, repr=False)

    def token_time(self, d: np.ndarray) -> np.ndarray:
        """Extra seconds for d draft tokens in the step, d [m] -> [m]."""
        extra = self.per_draft_token * d
        return extra if self.verify_extra is None else extra + self.verify_extra(d)

    def step_time(self, k: np.ndarray) -> float:
        k = np.asarray(k)
        if not k.size or k.max() == 0:
            return self.base
        return float(self.base + self.drafting + self.token_time(np.array([k.sum()]))[0]
                     + self.per_draft_forward * k.max())


def expected_tokens(acceptance: np.ndarray, k: np.ndarray) -> np.ndarray:
    """E_i(K_i) [n] for acceptance [n, K_max] and draft lengths k [n]."""
    gains = np.cumprod(acceptance, axis=1)  # [n, K_max]
    taken = np.arange(acceptance.shape[1]) < np.asarray(k)[:, None]
    return 1.0 + (gains * taken).sum(axis=1)


def choose_draft_lengths(acceptance: np.ndarray, costs: StepCosts, max_k: int | None = None,
                         speed_floor: float | None = None) -> np.ndarray:
    """K_i [n] in 0..max_k maximising sum(E_i(K_i)) / step time; K = 0 for all when drafting does not pay.

    For a fixed longest draft M, the best set of d draft tokens is the d largest gains among positions
    below M (a prefix of each row, since a row's gains never grow), and the time depends on d alone;
    so trying every M and every d is an exact search, sorted once: O(K_max * n * K_max).

    speed_floor (0 < f <= 1), when given, keeps every request's expected tokens per second at f of its
    rate without drafts or above: E_i(K_i) / step time >= f / base. The step is every request's step, so
    a long one made by others' drafts slows a request the draft predicts badly, which emits little more
    than one token a step; the floor bounds the step by the worst-served request. The search then takes
    the best of the same candidates that keep the floor (exact without it; with it, a set that gave a
    poorly predicted row a draft out of gain order could do better, and is not tried; see
    `_floor_kept`)."""
    n, width = acceptance.shape
    max_k = width if max_k is None else min(max_k, width)
    best_k, best_rate = np.zeros(n, dtype=np.int64), n / costs.base if costs.base > 0 else 0.0
    if n == 0 or max_k == 0:
        return best_k
    gains = _gains(acceptance[:, :max_k])  # [n, max_k]
    position = np.broadcast_to(np.arange(max_k), gains.shape).ravel()
    order = np.lexsort((position, -gains.ravel()))  # largest gain first; earlier position on ties
    rows_sorted, pos_sorted, gain_sorted = order // max_k, position[order], gains.ravel()[order]  # [n * max_k]
    longest = np.arange(1, max_k + 1)[:, None]  # [max_k, 1] candidate M
    within = pos_sorted[None, :] < longest  # [max_k, n * max_k] the gains a draft of at most M may take
    d = np.cumsum(within, axis=1)  # [max_k, n * max_k] draft tokens when taking up to this gain
    taken_gain = np.where(within, gain_sorted[None, :], 0.0)  # [max_k, n * max_k]
    tokens = n + np.cumsum(taken_gain, axis=1)
    time = costs.base + costs.drafting + costs.token_time(d) + costs.per_draft_forward * longest
    rate = np.where(within, tokens / np.maximum(time, 1e-12), -np.inf)  # [max_k, n * max_k]

    def chosen(m: int, pick: int) -> np.ndarray:  # candidate (M = m + 1, p = pick)'s K per row [n]
        return np.bincount(rows_sorted[: pick + 1][within[m, : pick + 1]], minlength=n).astype(np.int64)

    m, pick = np.unravel_index(int(rate.argmax()), rate.shape)
    k = chosen(m, pick)
    # One request: its speed is the step's goodput, whose best is at least its rate without drafts, so
    # the floor cannot bind (and its check is most of the search's time at batch 1). Several: when the
    # best candidate keeps the floor it is also the best (the first, on ties) of those that do, so the
    # check over every candidate runs only when it does not.
    if speed_floor is not None and n > 1:
        by_count, bound = _tokens_by_count(gains), costs.base / speed_floor
        if not _keeps_floor(by_count, k, time[m, pick], bound):
            rank = np.empty(n * max_k, dtype=np.int64)
            rank[order] = np.arange(n * max_k)
            rate = np.where(_floor_kept(by_count, rank.reshape(n, max_k), time, bound), rate, -np.inf)
            m, pick = np.unravel_index(int(rate.argmax()), rate.shape)
            k = chosen(m, pick)
    if rate[m, pick] > best_rate * (1 + 1e-9):
        best_k = k
    return best_k


def _goodput_bound(gains: np.ndarray, costs: StepCosts) -> float:
    """At least the goodput of any draft lengths for rows with gains [n, m]: d drafts emit at most n
    tokens plus the d largest gains, and take at least the time of d draft tokens in ceil(d / n) draft
    forwards (the longest draft is at least the mean); none at all give n / base."""
    n = gains.shape[0]
    top = np.sort(gains.ravel())[::-1]  # [n * m]
    d = np.arange(1, top.size + 1)
    time = costs.base + costs.drafting + costs.token_time(d) + costs.per_draft_forward * np.ceil(d / n)
    return max(n / costs.base, float(((n + np.cumsum(top)) / time).max()))


def _gains(acceptance: np.ndarray) -> np.ndarray:
    """Each row's gain per position, [n, m] for acceptance [n, m]: the product of its acceptances so far."""
    return np.cumprod(np.clip(acceptance, 0.0, 1.0), axis=1)


def _tokens_by_count(gains: np.ndarray) -> np.ndarray:
    """Each row's expected tokens by how many drafts it takes, [n, max_k + 1] for gains [n, max_k]: 1 plus
    its first c gains (a row's drafts are a prefix)."""
    return 1.0 + np.concatenate([np.zeros((gains.shape[0], 1)), np.cumsum(gains, axis=1)], axis=1)


def _keeps_floor(tokens: np.ndarray, k: np.ndarray, time: float, bound_per_token: float) -> bool:
    """Whether one candidate, K per row k [n] taking time seconds, keeps the floor: every row's expected
    tokens (tokens [n, max_k + 1] by drafts taken) times bound_per_token at least its time, the test
    `_floor_kept` makes for all candidates at once."""
    return bool((tokens[np.arange(len(k)), k] * bound_per_token >= time).all())


def _floor_kept(tokens: np.ndarray, rank: np.ndarray, time: np.ndarray, bound_per_token: float) -> np.ndarray:
    """Which candidates keep the speed floor, kept [max_k, N] (N = n * max_k): candidate (M, p) takes the
    gains at sorted places 0..p below position M, and keeps the floor when every row's expected tokens,
    1 plus its taken gains, times bound_per_token (base / floor) is at least the candidate's time.

    tokens [n, max_k + 1], each row's expected tokens by drafts taken (`_tokens_by_count`); rank [n, max_k],
    the sorted place of each row's gains (increasing along a row);
    time [max_k, N], each candidate's step time, never decreasing in p (costs are non-negative).
    A row's tokens are a step function of p: 1 before its first taken place, 1 + g_0 from there to its
    second, and so on up to M gains. Each such stretch fails the floor from the first p whose time
    exceeds its tokens' bound (one search in a sorted row of times) to its end, so the candidates that
    fail are a union of n * (M + 1) intervals, marked with a difference array: O(K_max * n * K_max * log N),
    where testing each row at each candidate would take O(K_max * n * N)."""
    n, max_k = rank.shape
    places = time.shape[1]
    enters = np.concatenate([np.zeros((n, 1), dtype=np.int64), rank], axis=1)  # [n, max_k + 1] where count c starts
    kept = np.empty(time.shape, dtype=bool)
    for m in range(max_k):  # candidate longest draft M = m + 1: counts 0..M
        lo = enters[:, : m + 2]  # [n, M + 1]
        hi = np.concatenate([rank[:, : m + 1], np.full((n, 1), places)], axis=1)  # [n, M + 1]
        fails_from = np.maximum(lo, np.searchsorted(time[m], tokens[:, : m + 2] * bound_per_token, side="right"))
        fails = fails_from < hi
        marks = (np.bincount(fails_from[fails], minlength=places + 1)
                 - np.bincount(hi[fails], minlength=places + 1))  # [N + 1]
        kept[m] = np.cumsum(marks[:places]) == 0
    return kept


@dataclass
class AcceptanceTracker:
    """Acceptance estimates per request (per batch row) and per draft position, from counts.

    Engine-wide, per position j: how often draft j was tested and accepted over recent steps (counts
    decay by `engine_decay` per step, back towards an even Beta(1, 1) prior, so an estimate that stopped
    drafting is retried once its evidence has aged). Per request: its accepted and tested drafts,
    decaying by `request_decay` per step, shrunk towards the engine's rate with the weight of
    `prior_weight` tests. A request's estimate at position j shifts the engine's position-j rate by the
    request's own log-odds against the engine's: a request the draft predicts well is better at every
    position, and the positions keep their engine-wide shape."""

    max_k: int
    rows: int
    request_decay: float = 0.95
    engine_decay: float = 0.998
    prior_weight: float = 8.0
    engine_tested: np.ndarray = field(init=False)
    engine_accepted: np.ndarray = field(init=False)
    tested: np.ndarray = field(init=False)
    accepted: np.ndarray = field(init=False)

    def __post_init__(self):
        self.engine_tested = np.zeros(self.max_k)
        self.engine_accepted = np.zeros(self.max_k)
        self.tested = np.zeros(self.rows)
        self.accepted = np.zeros(self.rows)

    def engine_rates(self) -> np.ndarray:
        """Engine-wide conditional acceptance per position [max_k] (Beta(1, 1) prior)."""
        return (self.engine_accepted + 1.0) / (self.engine_tested + 2.0)

    def estimate(self, rows: int) -> np.ndarray:
        """Acceptance [rows, max_k] for batch rows 0..rows-1: in odds, the engine's odds at each position
        times the request's odds over the engine's overall odds (a shift in log-odds). Every rate here is
        strictly between 0 and 1 (the priors see to it), so no odds is 0 or infinite. Computed every step
        just after the target's forward has evicted the caches, where each numpy call costs several
        microseconds: hence odds (a few products) and not logits (logs, clips and an exp)."""
        accepted, tested = float(self.engine_accepted.sum()), float(self.engine_tested.sum())
        overall = (accepted + 1.0) / (tested + 2.0)
        overall_odds = (accepted + 1.0) / (tested - accepted + 1.0)
        position_odds = (self.engine_accepted + 1.0) / (self.engine_tested - self.engine_accepted + 1.0)  # [max_k]
        own_accepted = self.accepted[:rows] + self.prior_weight * overall  # [rows]
        own_odds = own_accepted / (self.tested[:rows] + self.prior_weight - own_accepted)  # [rows]
        odds = np.multiply.outer(own_odds / overall_odds, position_odds)  # [rows, max_k]
        return odds / (1.0 + odds)

    def record(self, drafted: np.ndarray, accepted: np.ndarray) -> None:
        """One verification step: for rows 0..len-1, drafts verified [rows] and how many of them the
        target accepted [rows]. Draft j was tested when j <= accepted and j < drafted."""
        rows = len(drafted)
        self.tested[: self.rows] *= self.request_decay
        self.accepted[: self.rows] *= self.request_decay
        self.engine_tested *= self.engine_decay
        self.engine_accepted *= self.engine_decay
        if rows == 0:
            return
        drafted, accepted = np.minimum(drafted, self.max_k), np.minimum(accepted, drafted)
        tested = np.minimum(accepted + 1, drafted)  # [rows]
        self.tested[:rows] += tested
        self.accepted[:rows] += accepted
        j = np.arange(self.max_k)
        self.engine_tested += (j[None, :] < tested[:, None]).sum(axis=0)
        self.engine_accepted += (j[None, :] < accepted[:, None]).sum(axis=0)

    def move(self, src: list[int], dst: list[int]) -> None:
        self.tested[dst], self.accepted[dst] = self.tested[src], self.accepted[src]

    def forget(self, rows) -> None:
        self.tested[rows] = 0.0
        self.accepted[rows] = 0.0

    def summary(self) -> dict:
        return {"engine_acceptance_per_position": [round(float(r), 4) for r in self.engine_rates()]}


class OnlineLinearCost:
    """Seconds as a linear function of a step's features, fitted online: least squares over
    exponentially decaying sums (forgetting `decay` per observation), regularised towards a prior
    with the weight of `prior_weight` observations at the features' `scale`. The prior is fixed (the
    start-up calibration, `set_prior`) or, given a `parent` fit, the parent's coefficients: a fit of
    part of the steps that falls back on the fit of them all where its own steps say little."""

    RESOLVE_EVERY = 8

    def __init__(self, names: tuple[str, ...], prior: np.ndarray, scale: np.ndarray,
                 decay: float = 0.99, prior_weight: float = 3.0, parent: "OnlineLinearCost | None" = None):
        self.names = names
        self.prior = np.asarray(prior, dtype=float)
        self.scale = np.asarray(scale, dtype=float)  # a band's is its parent's array: calibration rescales both
        self.prior_weight = prior_weight
        self.decay = decay
        self.parent = parent
        self.xtx = np.zeros((len(names), len(names)))
        self.xty = np.zeros(len(names))
        self.observations = 0
        self._solved: tuple[int, object, np.ndarray] | None = None  # (observations, parent's solve, coefficients)
        # Decaying sums of each observation's squared error, as the fit predicted it just before, and of its
        # squared seconds: `relative_error`.
        self.squared_error = self.squared_seconds = 0.0

    def observe(self, features: np.ndarray, seconds: float) -> None:
        x = np.asarray(features, dtype=float)
        if self.observations:
            error = seconds - float(x @ self.coefficients())
            self.squared_error = self.decay * self.squared_error + error * error
            self.squared_seconds = self.decay * self.squared_seconds + seconds * seconds
        self.xtx = self.decay * self.xtx + np.outer(x, x)
        self.xty = self.decay * self.xty + x * seconds
        self.observations += 1

    def relative_error(self) -> float:
        """The fit's recent error on the next observation, as a share of its seconds (root mean square; 0
        before any was predicted)."""
        return float(np.sqrt(self.squared_error / self.squared_seconds)) if self.squared_seconds > 0 else 0.0

    def age(self, steps: int) -> None:
        """Forget as if this many steps had passed unseen (a part's fit, for the steps other parts saw)."""
        if steps > 0:
            self.xtx *= self.decay ** steps
            self.xty *= self.decay ** steps
            self._solved = None

    def set_prior(self, prior: np.ndarray) -> None:
        self.prior = np.asarray(prior, dtype=float)
        self._solved = None

    def coefficients(self) -> np.ndarray:
        """Non-negative coefficients (no feature makes a step faster), solved again every RESOLVE_EVERY
        observations or when the parent's were: costs drift slowly, and the step should not pay for a
        solve it does not need."""
        prior, parent_solve = self.prior, None
        if self.parent is not None:
            prior = self.parent.coefficients()
            parent_solve = self.parent._solved
        if (self._solved is None or self.observations - self._solved[0] >= self.RESOLVE_EVERY
                or self._solved[1] is not parent_solve):
            ridge = self.prior_weight * np.diag(self.scale ** 2)
            theta = np.linalg.solve(self.xtx + ridge, self.xty + ridge @ prior)
            self._solved = (self.observations, parent_solve, np.maximum(theta, 0.0))
        return self._solved[2]

    def summary(self) -> dict:
        """Coefficients (milliseconds, or a plain factor for a `*_scale` feature) and the observations seen."""
        return {name: round(float(c) * (1 if name.endswith("scale") else 1e3), 4)
                for name, c in zip(self.names, self.coefficients())} | {
                    "observations": self.observations, "relative_error": round(self.relative_error(), 4)}


def batch_band(requests: int) -> int:
    """Band of batch sizes: 0 for 1 request, 1 for 2, 2 for 3-4, 3 for 5-8, ... (doubling)."""
    return max(int(requests) - 1, 0).bit_length()


def band_label(band: int) -> str:
    low, high = (1 << (band - 1)) + 1 if band else 1, 1 << band
    return str(high) if low == high else f"{low}-{high}"


class BandedCost:
    """An `OnlineLinearCost` of every step, and one per band of batch sizes (`batch_band`) shrunk
    towards it: what a feature costs is not the same at every batch size (the target's forward is bound
    by its weights' traffic at batch 1 and by arithmetic at 16; the proposer's fixed costs are spread over
    more rows), and one fit of all steps is pulled towards the batch sizes the engine ran most (after a
    batch-1 run, a draft token looked 1 ms dear at batch 4, where it cost 0.3-0.5). A band with few recent
    steps falls back on the fit of all; every band ages with the engine's steps, not only its own."""

    def __init__(self, names: tuple[str, ...], prior, scale, decay: float = 0.99, prior_weight: float = 3.0):
        self.all = OnlineLinearCost(names, prior, scale, decay, prior_weight)
        self.bands: dict[int, OnlineLinearCost] = {}
        self._seen: dict[int, int] = {}  # band -> the all-steps count at its last observation

    @property
    def scale(self) -> np.ndarray:
        return self.all.scale

    def set_prior(self, prior) -> None:
        self.all.set_prior(prior)

    def observe(self, requests: int, features: np.ndarray, seconds: float) -> None:
        band = batch_band(requests)
        if band not in self.bands:
            self.bands[band] = OnlineLinearCost(self.all.names, self.all.prior, self.all.scale, self.all.decay,
                                                self.all.prior_weight, parent=self.all)
            self._seen[band] = self.all.observations
        self._catch_up(band)
        self.all.observe(features, seconds)
        self.bands[band].observe(features, seconds)
        self._seen[band] = self.all.observations

    def _catch_up(self, band: int) -> None:
        """Age a band's fit by the steps of other bands since its last."""
        self.bands[band].age(self.all.observations - self._seen[band])
        self._seen[band] = self.all.observations

    def coefficients(self, requests: int | None = None) -> np.ndarray:
        """For a batch of this many requests (its band's fit, aged by the steps it missed), or over all
        steps when None."""
        band = None if requests is None else batch_band(requests)
        if band not in self.bands:
            return self.all.coefficients()
        if self.all.observations - self._seen[band] >= OnlineLinearCost.RESOLVE_EVERY:  # a band left behind fades
            self._catch_up(band)
        return self.bands[band].coefficients()

    def relative_error(self, requests: int) -> float:
        """`OnlineLinearCost.relative_error` of the fit that costs a batch of this many requests."""
        fit = self.bands.get(batch_band(requests), self.all)
        return fit.relative_error() if fit.observations > 1 else self.all.relative_error()

    def summary(self) -> dict:
        """The fit of all steps, and each band's (keyed by its batch sizes)."""
        return self.all.summary() | {"by_batch": {band_label(b): fit.summary() for b, fit in sorted(self.bands.items())}}


POLICIES = ("adaptive", "fixed", "off")
# The engine's default request speed floor (`speculative_engine_kwargs`; None turns it off): no request's
# expected tokens per second below 0.8 of its speed without drafts. Load tests here at concurrency 1 to
# 32 (docs/measurements.md, ninth session) found it cut the slowest requests without costing throughput, where a floor
# of 1 cost throughput whenever one badly predicted request shared the batch.
DEFAULT_SPEED_FLOOR = 0.8


def check_speed_floor(speed_floor: float | None) -> None:
    if speed_floor is not None and (isinstance(speed_floor, bool) or not (isinstance(speed_floor, (int, float)) and 0 < speed_floor <= 1)):
        raise ValueError(f"request_speed_floor must be a share of a request's plain speed in (0, 1] or None, not {speed_floor!r}")


class SpeculationPolicy:
    """K per request for the next step, in one of three modes: "adaptive" (goodput-maximising, above),
    "fixed" (K_max for every request that can draft) or "off" (no drafting: the engine runs as a plain
    one, for measuring what speculation's plumbing costs).

    It learns the step-time model from three online fits: the target's step as the worker times it
    (features: 1, requests, the target forward's time for one token per request and the extra time for
    the step's draft tokens, both from the forward's cost curve calibrated at start-up, whether anything
    drafted, and the draft tokens themselves), the draft's step as the proposer times it (1, whether it
    drafted, draft forwards, rows fed), and the engine's time between two worker steps (1, requests,
    draft tokens): the scheduler and the output processing run once per step and handle every draft
    token, so a step that drafts more also costs more outside the worker, and a step's fixed engine cost
    is what drafting saves on. Each fit is kept per band of batch sizes as well (`BandedCost`), and a
    batch is costed by its band's.
    The two forward features get coefficients of their own, so that what a step costs without drafts
    (sampling, scheduling, per-request work) does not leak into what verifying one more token costs.
    Both start from a calibration (`calibrate_target`, `calibrate_draft`) so that the first steps are
    sensible; `force_costs` pins coefficients (tests, and an operator who wants speculation off above
    some cost)."""

    # "per_draft_token": what verifying one draft token costs beyond the calibrated forward. The
    # calibration runs vLLM's dummy forward, which has no attention and no logits; a real one attends over
    # the request's whole context for each draft token and computes its logits and probabilities. At batch
    # 1 the calibrated curve is flat over 1..7 tokens while a step verifying 6 drafts took 2.5 ms more than
    # one without: without this term the model saw drafts as nearly free and put the best K one or two
    # positions too high (`specserve k-curve`, temperature 0.7).
    TARGET_FEATURES = ("step", "per_request", "plain_forward_scale", "verify_scale", "drafting", "per_draft_token")
    TARGET_PRIOR = (0.0, 0.0, 1.0, 1.0, 0.0, 0.0)
    # Once this many steps in a row chose no drafts, the next drafts one token for every request: the
    # estimates that stopped speculation are only re-measured by speculating (a probe costs a small
    # share of one step in PROBE_INTERVAL). Not while costs are pinned.
    PROBE_INTERVAL = 64
    # "overhead": the proposer's time every step (following the batch, the choice of K), drafts or not;
    # "drafting": what a step that drafts adds once (planning the catch-up, sampling set-up, the commit),
    # which a step without drafts saves. Charged to every step, that 1 ms made K = 0 look dearer than it is.
    DRAFT_FEATURES = ("overhead", "drafting", "per_forward", "per_row_forward")
    ENGINE_FEATURES = ("step", "per_request", "per_draft_token")

    def __init__(self, mode: str, max_k: int, rows: int, speed_floor: float | None = None,
                 k_max_unless_sure: bool = False):
        if mode not in POLICIES:
            raise ValueError(f"k_policy must be one of {POLICIES}, not {mode!r}")
        check_speed_floor(speed_floor)
        self.mode, self.max_k, self.speed_floor = mode, max_k, speed_floor
        self.k_max_unless_sure = k_max_unless_sure  # `_max_unless_sure`
        self.acceptance = AcceptanceTracker(max_k, rows)
        # The target forward's seconds by tokens, piecewise linear between calibrated points; before any
        # calibration, 1 ms per token with a free scale.
        self.curve_tokens, self.curve_seconds = np.array([0.0, 1.0]), np.array([0.0, 1e-3])
        self._tabulate_forward()
        # "drafting" is held to its prior (0) more firmly than the step's constant: under load nearly every
        # step drafts, the two are all but collinear, and an even ridge split the step's fixed time between
        # them (18.8 and 18.1 ms at concurrency 32 in serving), so a step without drafts looked 18 ms cheaper
        # than it was. Where steps with and without drafts both occur, the data still moves it.
        self.target = BandedCost(self.TARGET_FEATURES, prior=self.TARGET_PRIOR, scale=[1, 8, 0.03, 0.03, 3, 2])
        self.draft = BandedCost(self.DRAFT_FEATURES, prior=[0.0, 0.0, 0.001, 0.0], scale=[1, 0.3, 4, 16])
        self.engine = BandedCost(self.ENGINE_FEATURES, prior=[0.0, 0.0, 0.0], scale=[1, 8, 16])
        self.forced: dict[str, float] = {}
        self.calibration: dict[str, dict] = {}
        self.histogram = np.zeros(max_k + 1, dtype=np.int64)  # chosen K per request-step
        self.steps_without_drafts = 0
        self.probes = 0
        self.forced_k: int | None = None  # every request drafts this many, whatever the mode (`force_k`)
        self.feeds_drafting_rows = False  # whether draft forwards feed only the rows still drafting (the proposer's)

    def calibrate_target(self, forward_seconds: dict[int, float]) -> None:
        """Target forward times by scheduled tokens ({1: s, 32: s, ...}): the shape of the forward's cost."""
        self.calibration["target_forward_ms"] = {n: round(t * 1e3, 3) for n, t in forward_seconds.items()}
        tokens = np.array(sorted(forward_seconds), dtype=float)
        seconds = np.array([forward_seconds[n] for n in sorted(forward_seconds)])
        # Never decreasing in tokens: a point above a later one is timing noise, so it takes the later value.
        self.curve_tokens, self.curve_seconds = tokens, np.minimum.accumulate(seconds[::-1])[::-1]
        self._tabulate_forward()
        self.target.scale[2:4] = self._forward_at(32)
        self.target.set_prior(self.TARGET_PRIOR)

    def _tabulate_forward(self) -> None:
        """The curve at every whole token count a decode step can schedule (each row one token and K_max
        drafts): every step reads it several times (the choice, its K_max check, the target's fit), and
        one table read costs a few microseconds where interpolating costs about fifteen."""
        counts = np.arange(self.acceptance.rows * (self.max_k + 1) + 1)
        self._forward_table = self._interpolated_forward_time(counts.astype(float))

    def forward_time(self, tokens: np.ndarray) -> np.ndarray:
        """Calibrated target forward seconds for [m] token counts, extrapolated along the last segment."""
        tokens = np.asarray(tokens)
        if (tokens.dtype.kind in "iu" and tokens.size and tokens.min() >= 0
                and tokens.max() < len(self._forward_table)):
            return self._forward_table[tokens]
        return self._interpolated_forward_time(tokens)

    def _forward_at(self, tokens: int) -> float:
        """`forward_time` of one whole token count, as a float (the table's, without an array round trip)."""
        table = self._forward_table
        return float(table[tokens]) if 0 <= tokens < len(table) else float(self._interpolated_forward_time(np.array([float(tokens)]))[0])

    def _interpolated_forward_time(self, tokens: np.ndarray) -> np.ndarray:
        t, y = self.curve_tokens, self.curve_seconds
        slope = (y[-1] - y[-2]) / max(t[-1] - t[-2], 1e-9)
        return np.where(tokens > t[-1], y[-1] + slope * (tokens - t[-1]), np.interp(tokens, t, y))

    def calibrate_draft(self, forward_seconds: dict[int, float]) -> None:
        """Draft forward times by rows fed ({1: s, 16: s}): the per-forward and per-row prior."""
        self.calibration["draft_forward_ms"] = {n: round(t * 1e3, 3) for n, t in forward_seconds.items()}
        (r0, t0), (r1, t1) = min(forward_seconds.items()), max(forward_seconds.items())
        per_row = max(t1 - t0, 0.0) / max(r1 - r0, 1)
        self.draft.set_prior([0.0, 0.0, max(t0 - per_row * r0, 0.0), per_row])

    def observe_target(self, requests: int, tokens: int, drafted: bool, seconds: float) -> None:
        """One decode step of the target: requests in the batch, tokens scheduled (one per request plus
        the drafts), whether any drafted. Steps that prefill are left out by the caller: a prompt's
        attention cost is not what the policy decides about."""
        plain, forward = self._forward_at(requests), self._forward_at(max(tokens, requests))
        drafts = float(max(tokens - requests, 0))
        self.target.observe(requests, np.array([1.0, requests, plain, forward - plain, float(drafted), drafts]), seconds)

    def observe_draft(self, requests: int, forwards: int, row_forwards: int, seconds: float) -> None:
        """One step of the proposer for a batch of this many requests: draft forwards run, rows they fed."""
        self.draft.observe(requests, np.array([1.0, float(forwards > 0), forwards, row_forwards]), seconds)

    def observe_engine(self, requests: int, draft_tokens: int, seconds: float) -> None:
        """The engine's time between two decode steps of the worker (scheduling this step, processing
        the last one's output), against this step's requests and the draft tokens it verifies."""
        self.engine.observe(requests, np.array([1.0, requests, draft_tokens]), seconds)

    def force_costs(self, overrides: dict[str, float] | None) -> None:
        """Pin StepCosts fields (seconds) whatever the fits say; None lifts the pin."""
        known = ("base", "drafting", "per_draft_token", "per_draft_forward")
        unknown = set(overrides or {}) - set(known)
        if unknown:
            raise ValueError(f"unknown step-cost fields {sorted(unknown)}; known: {list(known)}")
        # Non-negative, as the fits are: a step's time must never fall as it takes more drafts (the floor's
        # check, `_floor_kept`, searches the candidates' times as a sorted row).
        negative = {name: value for name, value in (overrides or {}).items() if not value >= 0}
        if negative:
            raise ValueError(f"step costs are seconds, at least 0: {negative}")
        self.forced = dict(overrides or {})

    def force_k(self, k: int | None) -> None:
        """Draft k tokens for every request that can, whatever the mode, until forced to None; the costs
        are still measured. For comparing the choice with each fixed K on one engine (`specserve
        k-curve`), and for an operator who wants speculation fixed or off without a restart."""
        if k is not None and not (isinstance(k, int) and 0 <= k <= self.max_k):
            raise ValueError(f"a forced K must be in 0..{self.max_k} (K_max), not {k}")
        self.forced_k = k

    def model_curve(self, requests: int) -> list[dict]:
        """What the model expects of a batch of this many requests with the engine's acceptance, each
        drafting K = 0..K_max: step milliseconds and tokens per second."""
        costs = self.costs(requests)
        acceptance = np.broadcast_to(self.acceptance.engine_rates(), (requests, self.max_k))
        curve = []
        for k in range(self.max_k + 1):
            lengths = np.full(requests, k)
            seconds = costs.step_time(lengths)
            curve.append({"k": k, "step_ms": float(seconds) * 1e3,  # plain floats: it travels by RPC
                          "tokens_per_s": float(expected_tokens(acceptance, lengths).sum() / seconds)})
        return curve

    def costs(self, requests: int) -> StepCosts:
        """The step-time model for a batch of this many decoding requests (one token each unless drafted)."""
        step, per_request, plain_scale, verify_scale, drafting, target_per_draft_token = self.target.coefficients(requests)
        overhead, draft_drafting, per_forward, per_row_forward = self.draft.coefficients(requests)
        engine_step, engine_per_request, engine_per_draft_token = self.engine.coefficients(requests)
        plain_forward = self._forward_at(requests)
        if self.feeds_drafting_rows:  # a row fed per draft token (see above)
            per_draft_forward, per_row_token = per_forward, per_row_forward
        else:  # each draft forward feeds the batch's rows
            per_draft_forward, per_row_token = per_forward + per_row_forward * min(requests, self.acceptance.rows), 0.0

        def verify_extra(d: np.ndarray) -> np.ndarray:
            return verify_scale * (self.forward_time(requests + np.asarray(d)) - plain_forward)

        costs = StepCosts(base=step + per_request * requests + plain_scale * plain_forward + overhead
                          + engine_step + engine_per_request * requests,
                          drafting=drafting + draft_drafting,
                          per_draft_token=engine_per_draft_token + target_per_draft_token + per_row_token,
                          per_draft_forward=per_draft_forward, verify_extra=verify_extra)
        return replace(costs, **self.forced) if self.forced else costs

    def choose(self, candidates: np.ndarray, requests: int, pinned: np.ndarray | None = None) -> np.ndarray:
        """K [rows] for batch rows 0..rows-1, 0 where candidates [rows] is False (a row that cannot draft:
        mid-prefill, or too near its length limit); requests counts the whole batch. Pinned rows [rows]
        draft K_max whatever the mode but "off", and unless K is forced (`force_k`, as uniform as K_max):
        a seeded request must reproduce its output, and which random numbers it draws depends on how many
        drafts it gets, which the adaptive choice makes depend on live timings (pinned costs included:
        the choice still rests on the live acceptance of other requests)."""
        k = np.zeros(len(candidates), dtype=np.int64)
        eligible = np.nonzero(candidates)[0]
        if self.forced_k is not None:
            k[eligible] = self.forced_k
        elif self.mode == "fixed":
            k[eligible] = self.max_k
        elif self.mode == "adaptive" and len(eligible):
            acceptance, costs = self.acceptance.estimate(len(candidates))[eligible], self.costs(requests)
            k[eligible] = self._adaptive_choice(acceptance, costs, requests)
            if k.any():
                self.steps_without_drafts = 0
            elif self.steps_without_drafts >= self.PROBE_INTERVAL and not self.forced:
                k[eligible], self.steps_without_drafts = 1, 0
                self.probes += 1
            else:
                self.steps_without_drafts += 1
        if pinned is not None and self.mode != "off" and self.forced_k is None:
            k[candidates & pinned] = self.max_k
        self.histogram += np.bincount(k[eligible], minlength=self.max_k + 1)
        return k

    def _adaptive_choice(self, acceptance: np.ndarray, costs: StepCosts, requests: int) -> np.ndarray:
        """K [n] for acceptance [n, K_max]: `choose_draft_lengths`'s choice, or K_max for every row unless
        the model expects the choice to beat it by more than the model's own recent error on a step's time
        (the target fit's, most of a step and most of its variance): a gain smaller than that error is not
        one the model can see, and on this machine the drafts it cut for such gains bought no measurable
        step time (docs/measurements.md, seventeenth session). Not while costs are pinned (the model is then
        exact by decree), nor where K_max for all breaks the speed floor.

        Most steps under load keep K_max, so that is tested first against a bound on any choice's goodput
        (`_goodput_bound`): when K_max is within the margin of the bound it is within the margin of the
        choice, and the search, most of this function's time, is not run. The result is the same."""
        margin = self.target.relative_error(requests) if self.k_max_unless_sure and not self.forced else 0.0
        if margin <= 0:
            return choose_draft_lengths(acceptance, costs, self.max_k, self.speed_floor)
        n = len(acceptance)
        gains = _gains(acceptance)  # [n, K_max]
        by_count = _tokens_by_count(gains)  # [n, K_max + 1]
        full = np.full(n, self.max_k)
        full_time = costs.step_time(full)
        if self.speed_floor is not None and n > 1 and not _keeps_floor(by_count, full, full_time, costs.base / self.speed_floor):
            return choose_draft_lengths(acceptance, costs, self.max_k, self.speed_floor)
        full_rate = by_count[:, -1].sum() / full_time * (1 + margin)
        if full_rate >= _goodput_bound(gains, costs):
            return full
        chosen = choose_draft_lengths(acceptance, costs, self.max_k, self.speed_floor)
        chosen_rate = by_count[np.arange(n), chosen].sum() / costs.step_time(chosen)
        return full if full_rate >= chosen_rate else chosen

    def cost_ratio(self) -> float | None:
        """The seeds' c at batch 1: the target's decode step (the step without drafts, less the draft's
        own per-step overhead) over one draft forward of one row. None unless adaptive (only the
        adaptive policy measures costs)."""
        if self.mode != "adaptive":
            return None
        overhead = self.draft.coefficients(1)[0]
        costs = self.costs(1)
        draft_forward = costs.per_draft_forward + costs.per_draft_token
        return float((costs.base - overhead) / draft_forward) if draft_forward > 0 else None

    def summary(self) -> dict:
        costs = self.costs(1)
        return {
            "k_policy": self.mode,
            "request_speed_floor": self.speed_floor,
            "k_max_unless_sure": self.k_max_unless_sure,
            "chosen_k_histogram": self.histogram.tolist(),
            "probes": self.probes,
            "forced_k": self.forced_k,
            "target_cost_ms": self.target.summary(),
            "draft_cost_ms": self.draft.summary(),
            "engine_cost_ms": self.engine.summary(),
            "forced_costs": dict(self.forced),
            "calibration": self.calibration,
            "batch1_step_costs_ms": {name: round(float(getattr(costs, name)) * 1e3, 4)
                                     for name in ("base", "drafting", "per_draft_token", "per_draft_forward")},
            **self.acceptance.summary(),
        }
