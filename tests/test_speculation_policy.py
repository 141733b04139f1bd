"""The speculation policy as pure functions, against a synthetic step-cost model."""

import itertools
import json

import numpy as np
import pytest

from plugin.speculation_policy import (
    AcceptanceTracker,
    OnlineLinearCost,
    SpeculationPolicy,
    StepCosts,
    choose_draft_lengths,
    expected_tokens,
)

# A CPU-like step: 10 ms plain, 1 ms more once anything drafts, 0.2 ms per draft token verified and
# fed, 0.5 ms per batched draft forward.
CHEAP = StepCosts(base=0.010, drafting=0.001, per_draft_token=0.0002, per_draft_forward=0.0005)


def goodput(acceptance, costs, k) -> float:
    return float(expected_tokens(acceptance, np.asarray(k)).sum()) / costs.step_time(np.asarray(k))


def brute_force(acceptance, costs, max_k) -> float:
    return max(goodput(acceptance, costs, k) for k in itertools.product(range(max_k + 1), repeat=len(acceptance)))


def test_expensive_verification_drives_k_to_zero():
    acceptance = np.full((4, 6), 0.8)
    expensive = StepCosts(base=0.010, drafting=0.001, per_draft_token=0.02, per_draft_forward=0.005)
    assert choose_draft_lengths(acceptance, expensive).tolist() == [0, 0, 0, 0]
    assert choose_draft_lengths(acceptance, CHEAP).min() > 0


def test_high_acceptance_raises_k():
    lengths = [int(choose_draft_lengths(np.full((1, 8), a), CHEAP)[0]) for a in (0.3, 0.6, 0.8, 0.95)]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1], lengths
    assert lengths[-1] == 8


def test_requests_the_draft_predicts_well_get_more_drafts():
    acceptance = np.array([[0.9] * 6, [0.35] * 6])
    k = choose_draft_lengths(acceptance, CHEAP)
    assert k[0] > k[1], k


@pytest.mark.parametrize("seed", range(40))
def test_matches_brute_force_on_small_cases(seed):
    rng = np.random.default_rng(seed)
    n, max_k = int(rng.integers(1, 4)), int(rng.integers(1, 5))
    acceptance = rng.uniform(0.0, 1.0, (n, max_k)) ** rng.uniform(0.2, 2.0)
    flat_then_rising = rng.uniform(0, 0.004), rng.integers(0, 4)  # a forward's time is not linear in tokens
    costs = StepCosts(base=rng.uniform(0.001, 0.02), drafting=rng.uniform(0, 0.005),
                      per_draft_token=rng.uniform(0, 0.004), per_draft_forward=rng.uniform(0, 0.004),
                      verify_extra=None if seed % 2 else lambda d: flat_then_rising[0] * np.maximum(d - flat_then_rising[1], 0))
    k = choose_draft_lengths(acceptance, costs, max_k)
    assert goodput(acceptance, costs, k) == pytest.approx(brute_force(acceptance, costs, max_k), rel=1e-9)


def slowest_share(acceptance, costs, k) -> float:
    """The worst-served request's expected tokens per second over its rate without drafts."""
    return float(expected_tokens(acceptance, np.asarray(k)).min() * costs.base / costs.step_time(np.asarray(k)))


def test_a_speed_floor_keeps_a_poorly_predicted_request_from_paying_for_the_others_drafts():
    """Three requests the draft predicts well and one it predicts less well, on a batch-4 CPU step (about
    1 ms per draft token): goodput alone drafts 5 for the three and none for the fourth, which then runs
    at 0.44 of its plain speed; a floor of 1 gives every request a draft and keeps the fourth at its plain
    speed or above, for less goodput. One the draft predicts very badly (0.2) leaves no draft that keeps
    a floor of 1, so nothing drafts."""
    acceptance = np.array([[0.9] * 6] * 3 + [[0.45] * 6])
    costs = StepCosts(base=0.0145, drafting=0.001, per_draft_token=0.001, per_draft_forward=0.0005)
    free = choose_draft_lengths(acceptance, costs)
    floored = choose_draft_lengths(acceptance, costs, speed_floor=1.0)
    assert slowest_share(acceptance, costs, free) < 0.5, free
    assert slowest_share(acceptance, costs, floored) >= 1.0 and floored.min() > 0, floored
    assert 0.75 * goodput(acceptance, costs, free) < goodput(acceptance, costs, floored) < goodput(acceptance, costs, free)
    acceptance[3] = 0.2
    assert choose_draft_lengths(acceptance, costs, speed_floor=1.0).tolist() == [0, 0, 0, 0]
    # A looser floor allows more: the kept share falls with the floor, the goodput rises.
    half = choose_draft_lengths(acceptance, costs, speed_floor=0.5)
    assert slowest_share(acceptance, costs, half) >= 0.5
    assert goodput(acceptance, costs, floored) <= goodput(acceptance, costs, half) <= goodput(acceptance, costs, free)


@pytest.mark.parametrize("seed", range(40))
def test_with_a_speed_floor_the_choice_keeps_it_and_is_never_worse_than_no_drafts(seed):
    """On random small cases: the floor holds for every request, the goodput is at least that of no
    drafts (always allowed) and at most the brute-force optimum without a floor."""
    rng = np.random.default_rng(seed)
    n, max_k = int(rng.integers(1, 5)), int(rng.integers(1, 5))
    acceptance = rng.uniform(0.0, 1.0, (n, max_k)) ** rng.uniform(0.2, 2.0)
    costs = StepCosts(base=rng.uniform(0.001, 0.02), drafting=rng.uniform(0, 0.005),
                      per_draft_token=rng.uniform(0, 0.004), per_draft_forward=rng.uniform(0, 0.004))
    floor = float(rng.uniform(0.3, 1.0))
    k = choose_draft_lengths(acceptance, costs, max_k, speed_floor=floor)
    assert slowest_share(acceptance, costs, k) >= floor - 1e-12
    assert goodput(acceptance, costs, np.zeros(n, int)) <= goodput(acceptance, costs, k) * (1 + 1e-9)
    assert goodput(acceptance, costs, k) <= brute_force(acceptance, costs, max_k) * (1 + 1e-9)


def test_for_one_request_the_floor_cannot_bind_and_is_not_checked():
    """One request's speed is the step's goodput, and the best choice is at least as fast as no drafts,
    so the floor holds without its check (which the search skips at batch 1): on 200 random cases the
    choice with any floor is the one without, and keeps the floor."""
    rng = np.random.default_rng(7)
    for _ in range(200):
        max_k = int(rng.integers(1, 7))
        acceptance = rng.uniform(0.0, 1.0, (1, max_k)) ** rng.uniform(0.2, 2.0)
        costs = StepCosts(base=rng.uniform(0.001, 0.02), drafting=rng.uniform(0, 0.005),
                          per_draft_token=rng.uniform(0, 0.004), per_draft_forward=rng.uniform(0, 0.004))
        free = choose_draft_lengths(acceptance, costs, max_k)
        floor = float(rng.uniform(0.3, 1.0))
        assert choose_draft_lengths(acceptance, costs, max_k, speed_floor=floor).tolist() == free.tolist()
        assert slowest_share(acceptance, costs, free) >= floor - 1e-12


def best_gain_order_candidate_keeping_the_floor(acceptance, costs, max_k, floor) -> float:
    """The goodput of the best draft set the floored search may pick, each candidate built and tested
    one at a time: for a longest draft M, the largest gains below position M (earlier position on ties),
    the first p of them, kept when the worst-served request keeps the floor; no drafts always kept."""
    n = len(acceptance)
    gains = np.cumprod(acceptance[:, :max_k], axis=1)
    entries = sorted(((-gains[r, j], j, r) for r in range(n) for j in range(max_k)))
    best = goodput(acceptance, costs, np.zeros(n, int))
    for longest in range(1, max_k + 1):
        k = np.zeros(n, int)
        for _, j, r in (e for e in entries if e[1] < longest):
            k[r] += 1
            if slowest_share(acceptance, costs, k) >= floor:
                best = max(best, goodput(acceptance, costs, k))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_the_floored_search_finds_the_best_candidate_that_keeps_the_floor(seed):
    """The floor is checked over intervals of the sorted gains (`_floor_kept`), not row by row at every
    candidate: on random cases with ties and a target forward that bends upwards, the choice is the best
    candidate built and tested one by one."""
    rng = np.random.default_rng(100 + seed)
    n, max_k = int(rng.integers(1, 9)), int(rng.integers(1, 7))
    acceptance = rng.uniform(0.0, 1.0, (n, max_k)) ** rng.uniform(0.1, 2.0)
    if seed % 3 == 0:
        acceptance = np.round(acceptance, 1)  # equal gains across rows and positions
    bend = rng.uniform(0, 0.001)
    costs = StepCosts(base=rng.uniform(0.005, 0.05), drafting=rng.uniform(0, 0.005),
                      per_draft_token=rng.uniform(0, 0.002), per_draft_forward=rng.uniform(0, 0.003),
                      verify_extra=lambda d: bend * np.asarray(d, dtype=float) ** 1.3)
    floor = float(rng.uniform(0.2, 1.0))
    k = choose_draft_lengths(acceptance, costs, max_k, speed_floor=floor)
    assert slowest_share(acceptance, costs, k) >= floor - 1e-12
    expected = best_gain_order_candidate_keeping_the_floor(acceptance, costs, max_k, floor)
    assert goodput(acceptance, costs, k) == pytest.approx(expected, rel=1e-9)


def test_the_floor_is_checked_over_every_candidate_only_when_the_best_one_breaks_it(monkeypatch):
    """When the best candidate keeps the floor the search returns it without `_floor_kept`; the choice
    is the same as with the full check over every candidate on 300 random cases (seed 11), some of each
    kind."""
    import plugin.speculation_policy as policy

    rng = np.random.default_rng(11)
    cases = []
    for _ in range(300):
        n, max_k = int(rng.integers(2, 9)), int(rng.integers(1, 7))
        acceptance = rng.uniform(0.0, 1.0, (n, max_k)) ** rng.uniform(0.1, 2.0)
        costs = StepCosts(base=rng.uniform(0.005, 0.05), drafting=rng.uniform(0, 0.005),
                          per_draft_token=rng.uniform(0, 0.002), per_draft_forward=rng.uniform(0, 0.003))
        cases.append((acceptance, costs, max_k, float(rng.uniform(0.2, 1.0))))
    full_checks = []
    floor_kept = policy._floor_kept
    monkeypatch.setattr(policy, "_floor_kept", lambda *args: full_checks.append(1) or floor_kept(*args))
    shortcut = [choose_draft_lengths(*case[:3], speed_floor=case[3]).tolist() for case in cases]
    checked = len(full_checks)
    monkeypatch.setattr(policy, "_keeps_floor", lambda *args: False)  # the full check every time
    full = [choose_draft_lengths(*case[:3], speed_floor=case[3]).tolist() for case in cases]
    assert shortcut == full
    assert 30 < checked < 270, checked  # both ways taken


def test_a_speed_floor_outside_0_to_1_is_refused():
    for bad in (0, -0.5, 1.5, "1", True):
        with pytest.raises(ValueError, match="request_speed_floor"):
            SpeculationPolicy("adaptive", 4, 2, speed_floor=bad)
    assert SpeculationPolicy("adaptive", 4, 2, speed_floor=1).summary()["request_speed_floor"] == 1


def test_acceptance_tracker_learns_per_request_and_per_position():
    tracker = AcceptanceTracker(max_k=4, rows=2)
    for _ in range(200):  # row 0 accepts every draft; row 1 accepts its first draft only
        tracker.record(drafted=np.array([4, 4]), accepted=np.array([4, 1]))
    estimate = tracker.estimate(2)
    assert estimate[0].min() > 0.8 and estimate[1, 1] < 0.5
    assert expected_tokens(estimate, np.array([4, 4])).tolist() == sorted(expected_tokens(estimate, np.array([4, 4])).tolist(), reverse=True)
    assert tracker.engine_rates()[0] > tracker.engine_rates()[1]  # position 1 fails more than position 0


def test_a_new_request_starts_from_the_engines_rate():
    tracker = AcceptanceTracker(max_k=3, rows=2)
    for _ in range(100):
        tracker.record(drafted=np.array([3, 3]), accepted=np.array([3, 3]))
    tracker.forget([1])
    assert tracker.estimate(2)[1].min() > 0.8


def test_online_cost_fit_recovers_a_linear_model():
    fit = OnlineLinearCost(("a", "b"), prior=[0.0, 0.0], scale=[1, 10], prior_weight=0.1)
    rng = np.random.default_rng(0)
    for _ in range(300):
        x = np.array([1.0, rng.integers(1, 20)])
        fit.observe(x, 0.005 + 0.0007 * x[1] + rng.normal(0, 1e-5))
    assert fit.coefficients() == pytest.approx([0.005, 0.0007], rel=0.05)


def test_online_cost_fit_measures_its_own_relative_error():
    """relative_error: the root mean square of each observation's error as the fit predicted it just
    before, over the root mean square of its seconds. 400 steps of a linear cost with 10% Gaussian noise
    (seed 1): 0.10 within 0.02; a noiseless one: below 0.01 once fitted."""
    rng = np.random.default_rng(1)
    noisy, exact = (OnlineLinearCost(("a", "b"), prior=[0.0, 0.0], scale=[1, 10], prior_weight=0.1) for _ in range(2))
    assert noisy.relative_error() == 0.0
    for _ in range(400):
        x = np.array([1.0, rng.integers(1, 20)])
        seconds = 0.005 + 0.0007 * x[1]
        noisy.observe(x, seconds * (1 + rng.normal(0, 0.1)))
        exact.observe(x, seconds)
    assert noisy.relative_error() == pytest.approx(0.10, abs=0.02)
    assert exact.relative_error() < 0.01


def test_the_choice_keeps_k_max_unless_its_gain_is_beyond_the_models_own_error():
    """Cutting drafts must beat K_max for every row by more than the target fit's recent relative error;
    a smaller modelled gain is within what the model gets wrong on a step, and K_max stays. Not where
    K_max for all breaks the speed floor, nor while costs are pinned."""
    policy = SpeculationPolicy("adaptive", max_k=4, rows=2, k_max_unless_sure=True)
    acceptance = np.array([[0.9] * 4, [0.2] * 4])
    costs = StepCosts(base=0.010, per_draft_token=0.0004)
    chosen = choose_draft_lengths(acceptance, costs, 4)
    gain = goodput(acceptance, costs, chosen) / goodput(acceptance, costs, [4, 4]) - 1
    assert chosen.tolist() != [4, 4] and 0.01 < gain < 0.2
    for margin, kept in ((0.0, chosen), (gain * 0.5, chosen), (gain * 2, np.array([4, 4]))):
        policy.target.relative_error = lambda requests, margin=margin: margin
        assert policy._adaptive_choice(acceptance, costs, 2).tolist() == kept.tolist()
    policy.speed_floor = 0.99  # K_max for both leaves the second row at 0.95 of its plain speed
    assert policy._adaptive_choice(acceptance, costs, 2).tolist() == chosen.tolist()
    policy.speed_floor = None
    policy.force_costs({"per_draft_token": 0.0004})
    assert policy._adaptive_choice(acceptance, costs, 2).tolist() == chosen.tolist()
    policy.force_costs(None)
    policy.k_max_unless_sure = False  # switched off: the model's choice whatever its margin
    assert policy._adaptive_choice(acceptance, costs, 2).tolist() == chosen.tolist()


def random_case(rng, n: int, max_k: int):
    acceptance = rng.uniform(0.0, 1.0, (n, max_k)) ** rng.uniform(0.2, 2.0)
    knee, slope = rng.integers(0, 4 * n), rng.uniform(0, 0.004)  # a forward's time is not linear in tokens
    costs = StepCosts(base=rng.uniform(0.001, 0.02), drafting=rng.uniform(0, 0.005),
                      per_draft_token=rng.uniform(0, 0.004), per_draft_forward=rng.uniform(0, 0.004),
                      verify_extra=lambda d: slope * np.maximum(d - knee, 0))
    return acceptance, costs


@pytest.mark.parametrize("seed", range(30))
def test_the_goodput_bound_is_at_least_the_best_choice(seed):
    from plugin.speculation_policy import _gains, _goodput_bound

    rng = np.random.default_rng(seed)
    acceptance, costs = random_case(rng, int(rng.integers(1, 4)), int(rng.integers(1, 5)))
    assert _goodput_bound(_gains(acceptance), costs) >= brute_force(acceptance, costs, acceptance.shape[1]) * (1 - 1e-12)


def test_the_k_max_shortcut_changes_no_choice():
    """K_max taken from the goodput bound without the search is what the search and the comparison
    with K_max would have given, over 300 random batches, costs, margins and floors (fixed seed), and
    the shortcut is taken in some of them and not in others."""
    from plugin.speculation_policy import _gains, _goodput_bound

    rng = np.random.default_rng(7)
    shortcuts = 0
    for case in range(300):
        n, max_k = int(rng.integers(1, 17)), int(rng.integers(1, 7))
        acceptance, costs = random_case(rng, n, max_k)
        acceptance = np.clip(acceptance + rng.uniform(0, 0.6), 0, 1)  # often K_max, so that the shortcut is taken
        policy = SpeculationPolicy("adaptive", max_k=max_k, rows=n, k_max_unless_sure=True,
                                   speed_floor=[None, 0.8, 0.95][case % 3])
        margin = rng.uniform(0.0, 0.1)
        policy.target.relative_error = lambda requests: margin
        chosen = choose_draft_lengths(acceptance, costs, max_k, policy.speed_floor)
        full = np.full(n, max_k)
        floor_kept = policy.speed_floor is None or n == 1 or bool(
            (expected_tokens(acceptance, full) / costs.step_time(full) >= policy.speed_floor / costs.base).all())
        full_wins = goodput(acceptance, costs, full) * (1 + margin) >= goodput(acceptance, costs, chosen)
        assert policy._adaptive_choice(acceptance, costs, n).tolist() == (full if floor_kept and full_wins else chosen).tolist()
        shortcuts += floor_kept and goodput(acceptance, costs, full) * (1 + margin) >= _goodput_bound(_gains(acceptance), costs)
    assert 5 <= shortcuts <= 295, shortcuts


def test_policy_switches_off_under_forced_high_cost_and_back():
    policy = SpeculationPolicy("adaptive", max_k=4, rows=4)
    policy.calibrate_target({1: 0.010, 32: 0.016})
    policy.calibrate_draft({1: 0.0005, 16: 0.0008})
    candidates = np.array([True, True, False, True])
    assert policy.choose(candidates, 4).tolist()[2] == 0
    assert policy.choose(candidates, 4).max() > 0
    policy.force_costs({"per_draft_token": 1.0})
    assert policy.choose(candidates, 4).max() == 0
    policy.force_costs(None)
    assert policy.choose(candidates, 4).max() > 0
    with pytest.raises(ValueError, match="unknown step-cost"):
        policy.force_costs({"verify": 1.0})
    with pytest.raises(ValueError, match="at least 0"):
        policy.force_costs({"per_draft_token": -0.001})
    assert policy.forced == {}  # the refused pin left nothing pinned


def test_a_policy_that_stopped_drafting_probes_again():
    """Pessimistic estimates stop speculation; every PROBE_INTERVAL steps without drafts, one step
    drafts a token per request so that acceptance and costs are measured again (not while pinned)."""
    policy = SpeculationPolicy("adaptive", max_k=4, rows=2)
    policy.calibrate_target({1: 0.010, 32: 0.016})
    policy.calibrate_draft({1: 0.0005, 16: 0.0008})
    for _ in range(300):
        policy.acceptance.record(np.array([4, 4]), np.array([0, 0]))  # the draft never right
    candidates = np.array([True, True])
    chosen = [policy.choose(candidates, 2).tolist() for _ in range(2 * policy.PROBE_INTERVAL + 2)]
    assert chosen.count([1, 1]) == 2 and chosen.count([0, 0]) == len(chosen) - 2
    policy.force_costs({"drafting": 1.0})
    assert all(policy.choose(candidates, 2).max() == 0 for _ in range(2 * policy.PROBE_INTERVAL))


def test_seeded_requests_draft_k_max_so_that_their_seed_reproduces_them():
    policy = SpeculationPolicy("adaptive", max_k=4, rows=3)
    policy.force_costs({"per_draft_token": 1.0})
    k = policy.choose(np.array([True, True, False]), 3, pinned=np.array([False, True, True]))
    assert k.tolist() == [0, 4, 0]
    # A forced K is as uniform as K_max, so it holds for seeded requests too (0: none drafts at all).
    for forced in (0, 2):
        policy.force_k(forced)
        k = policy.choose(np.array([True, True, False]), 3, pinned=np.array([False, True, True]))
        assert k.tolist() == [forced, forced, 0]


def test_fixed_and_off_modes():
    candidates = np.array([True, False])
    assert SpeculationPolicy("fixed", 5, 2).choose(candidates, 2).tolist() == [5, 0]
    assert SpeculationPolicy("off", 5, 2).choose(candidates, 2).tolist() == [0, 0]
    with pytest.raises(ValueError, match="k_policy"):
        SpeculationPolicy("greedy", 5, 2)


def test_cost_ratio_is_the_target_step_over_one_draft_forward():
    """The seeds' c from the step-cost model: the target's step (the step without drafts less the draft's
    own per-step overhead) over one row's draft forward; none for a policy that measures no costs."""
    policy = SpeculationPolicy("adaptive", max_k=4, rows=2)
    policy.force_costs({"base": 0.030, "per_draft_forward": 0.0015, "per_draft_token": 0.0005})
    overhead = policy.draft.coefficients()[0]
    assert policy.cost_ratio() == pytest.approx((0.030 - overhead) / 0.002)
    assert SpeculationPolicy("fixed", max_k=4, rows=2).cost_ratio() is None


def test_a_draft_forward_is_costed_over_every_row_of_the_batch():
    """The proposer's draft forward j feeds every row up to the last one still drafting (the rest feed
    scratch), so the step-cost model charges each forward for the batch's rows: one long draft in a big
    batch pays for its extra forwards over all of them, not for its own tokens alone."""
    policy = SpeculationPolicy("adaptive", max_k=4, rows=64)
    policy.calibrate_draft({1: 0.0006, 16: 0.0021})  # 0.5 ms a forward, plus 0.1 ms a row
    assert policy.costs(1).per_draft_forward == pytest.approx(0.0005 + 0.0001)
    assert policy.costs(16).per_draft_forward == pytest.approx(0.0005 + 16 * 0.0001)
    assert policy.costs(100).per_draft_forward == pytest.approx(0.0005 + 64 * 0.0001)  # beyond max_draft_rows none drafts
    assert policy.costs(16).per_draft_token == 0  # nothing observed of the engine yet
    # So in a batch of 16, a draft of 4 for a row the draft predicts well and 1 for the others costs as
    # much drafting as 4 for all: the choice gives the long draft only where its gain pays for that.
    acceptance = np.vstack([np.full((1, 4), 0.9), np.full((15, 4), 0.3)])
    k = choose_draft_lengths(acceptance, policy.costs(16), 4)
    assert k[0] >= k[1:].max()


def test_where_draft_forwards_feed_only_drafting_rows_a_row_fed_is_a_draft_tokens_cost():
    """The native forward feeds only the rows still drafting (the proposer's `feeds_drafting_rows`): each
    draft token is one row fed, so the row's cost moves from every forward to every draft token, and a
    short draft beside a long one saves draft time too."""
    policy = SpeculationPolicy("adaptive", max_k=4, rows=64)
    policy.calibrate_draft({1: 0.0006, 16: 0.0021})  # 0.5 ms a forward, plus 0.1 ms a row
    policy.feeds_drafting_rows = True
    costs = policy.costs(16)
    assert costs.per_draft_forward == pytest.approx(0.0005)
    assert costs.per_draft_token == pytest.approx(0.0001)
    assert costs.step_time(np.array([4] + [1] * 15)) - costs.step_time(np.array([1] * 16)) == pytest.approx(
        3 * 0.0005 + 3 * 0.0001 + float(costs.verify_extra(np.array([19.0]))[0] - costs.verify_extra(np.array([16.0]))[0]))


def test_the_engines_time_between_steps_is_a_step_cost():
    """The scheduler and the output processing run once per step and handle every draft token: a fixed
    engine cost per step is what drafting amortises (longer drafts), a cost per draft token is what it
    adds (shorter drafts)."""
    acceptance = np.full((4, 6), 0.7)

    def chosen(engine_step: float, engine_per_draft_token: float) -> int:
        policy = SpeculationPolicy("adaptive", max_k=6, rows=4)
        policy.calibrate_target({1: 0.002, 4: 0.002, 32: 0.004, 64: 0.008})
        policy.calibrate_draft({1: 0.0004, 16: 0.0012})
        for requests, drafts in [(4, 0), (4, 8), (4, 24), (2, 4), (3, 12)] * 40:
            policy.observe_engine(requests, drafts, engine_step + engine_per_draft_token * drafts)
        costs = policy.costs(4)
        assert costs.per_draft_token == pytest.approx(engine_per_draft_token, abs=1e-4)
        return int(choose_draft_lengths(acceptance, costs, 6).sum())

    plain = chosen(0.0, 0.0)
    assert chosen(0.010, 0.0) > plain
    assert chosen(0.0, 0.0008) < plain


def test_a_forced_k_overrides_the_choice_until_lifted():
    policy = SpeculationPolicy("adaptive", max_k=4, rows=3)
    policy.calibrate_target({1: 0.002, 32: 0.004})
    candidates = np.array([True, True, False])
    policy.force_k(2)
    assert policy.choose(candidates, 3).tolist() == [2, 2, 0]
    policy.force_k(0)
    assert policy.choose(candidates, 3).tolist() == [0, 0, 0]
    policy.force_k(None)
    assert policy.summary()["forced_k"] is None
    with pytest.raises(ValueError, match="0..4"):
        policy.force_k(5)


def test_the_model_curve_is_the_step_model_at_each_fixed_k():
    policy = SpeculationPolicy("adaptive", max_k=3, rows=4)
    policy.calibrate_target({1: 0.002, 64: 0.002})  # a flat forward: verifying drafts costs per_draft_token only
    policy.force_costs({"base": 0.010, "drafting": 0.0, "per_draft_token": 0.001, "per_draft_forward": 0.002})
    policy.acceptance.engine_accepted[:] = 98.0  # engine rates (98 + 1) / (98 + 2) = 0.99 at every position
    policy.acceptance.engine_tested[:] = 98.0
    curve = policy.model_curve(2)
    json.dumps(curve)  # it travels by vLLM's RPC, which takes plain types only
    assert [point["k"] for point in curve] == [0, 1, 2, 3]
    assert curve[0]["step_ms"] == pytest.approx(10.0) and curve[0]["tokens_per_s"] == pytest.approx(200.0)
    assert curve[2]["step_ms"] == pytest.approx(10.0 + 4 * 1.0 + 2 * 2.0)
    assert curve[2]["tokens_per_s"] == pytest.approx(2 * (1 + 0.99 + 0.99 ** 2) / 0.018)


def test_whole_token_counts_read_the_forward_curve_from_a_table_with_the_interpolated_values():
    policy = SpeculationPolicy("adaptive", max_k=4, rows=8)  # a table of 0..8 * 5 tokens
    policy.calibrate_target({1: 0.006, 8: 0.007, 32: 0.012})
    assert len(policy._forward_table) == 41
    counts = np.arange(0, 41)  # the table's, past the last calibrated point (32)
    interpolated = policy.forward_time(counts.astype(float))
    np.testing.assert_array_equal(policy._forward_table, interpolated)
    assert policy.forward_time(np.array([40]))[0] == pytest.approx(0.012 + 8 * 0.005 / 24)  # extrapolated
    np.testing.assert_array_equal(policy.forward_time(np.array([60, 0])), policy.forward_time(np.array([60.0, 0.0])))
    assert policy.forward_time(np.array([60]))[0] == pytest.approx(0.012 + 28 * 0.005 / 24)  # past the table
    assert policy.forward_time(np.array([-1.0]))[0] == pytest.approx(0.006)
    assert policy.forward_time(np.array([-1]))[0] == pytest.approx(0.006)  # no table index wraps round
    def no_interpolation(tokens):
        raise AssertionError("whole counts within the table must not interpolate")
    policy._interpolated_forward_time = no_interpolation
    np.testing.assert_array_equal(policy.forward_time(counts), interpolated)
    np.testing.assert_array_equal(policy.forward_time(np.array([7, 3])), interpolated[[7, 3]])
    with pytest.raises(AssertionError):
        policy.forward_time(np.array([41]))  # past the table: interpolated


def test_a_step_constant_the_data_cannot_split_stays_with_the_step_not_with_drafting():
    """Under load nearly every step drafts, so a step's fixed time (here 37 ms: the serving stack's
    contention on a small machine) is all but collinear with "any request drafted". The fit must not
    hand half of it to drafting (which would make a step without drafts look 18 ms cheaper than it is
    and stop speculation where it pays); when steps with and without drafts both occur, the drafting
    cost is still learnt."""
    def fitted(drafting_cost: float, drafted_share: float) -> tuple[float, float]:
        policy = SpeculationPolicy("adaptive", max_k=4, rows=32)
        policy.calibrate_target({1: 0.006, 32: 0.010, 128: 0.030})
        rng = np.random.default_rng(0)
        for _ in range(400):
            n, drafted = int(rng.integers(8, 33)), rng.random() < drafted_share
            tokens = n * (1 + 3 * drafted)
            forward = float(policy.forward_time(np.array([float(tokens)]))[0])
            policy.observe_target(n, tokens, drafted, 0.037 + forward + drafting_cost * drafted)
        plain, drafting = (0.037 + float(policy.forward_time(np.array([t]))[0]) for t in (16.0, 64.0))
        costs = policy.costs(16)  # the target's part: no draft or engine time was observed
        return costs.base / plain, costs.step_time(np.full(16, 3)) / (drafting + drafting_cost), costs.drafting

    base, step, drafting = fitted(0.0, drafted_share=0.95)
    assert drafting < 0.1 * 0.037 and base == pytest.approx(1.0, abs=0.1), (base, drafting)
    base, step, _ = fitted(0.005, drafted_share=0.5)  # split between drafting and verifying, but learnt
    assert base == pytest.approx(1.0, abs=0.1) and step == pytest.approx(1.0, abs=0.1), (base, step)


def test_a_verified_draft_token_the_calibration_cannot_see_is_learnt_and_lowers_k():
    """The start-up calibration times vLLM's dummy forward (no attention, no logits), flat at batch 1 over
    1..7 tokens; a real step pays for each verified draft token (attention over the context, its logits).
    Steps whose target time grows by 0.4 ms per draft token teach the model that slope, and the
    choice falls below the K it makes for drafts that cost nothing to verify."""
    def policy_after(per_token: float) -> SpeculationPolicy:
        policy = SpeculationPolicy("adaptive", max_k=6, rows=4)
        policy.calibrate_target({1: 0.007, 8: 0.007, 64: 0.012})
        policy.calibrate_draft({1: 0.0007, 4: 0.0008})
        policy.acceptance.engine_accepted[:] = 70.0  # 0.7 at every position
        policy.acceptance.engine_tested[:] = 100.0
        rng = np.random.default_rng(0)
        for _ in range(300):
            k = int(rng.integers(0, 7))
            policy.observe_target(1, 1 + k, k > 0, 0.007 + 0.001 + per_token * k)
            if k:
                policy.observe_draft(1, k, k, 0.0007 * k)
        return policy

    learnt = policy_after(0.0004)
    assert learnt.costs(1).token_time(np.array([6]))[0] == pytest.approx(6 * 0.0004, rel=0.1)
    assert learnt.costs(1).base == pytest.approx(0.008 + learnt.draft.coefficients()[0], rel=0.05)
    free = policy_after(0.0)
    assert free.costs(1).token_time(np.array([6]))[0] < 1e-4
    lower, higher = (p.choose(np.array([True]), 1)[0] for p in (learnt, free))
    assert lower < higher, (lower, higher)


def test_what_a_drafting_step_adds_once_is_saved_by_a_step_without_drafts():
    """The proposer costs 0.2 ms every step (following the batch, choosing K) and 1 ms more once when
    it drafts (planning, the commit): a step without drafts must be modelled without that 1 ms, or
    K = 0 looks dearer than it is."""
    policy = SpeculationPolicy("adaptive", max_k=4, rows=4)
    policy.calibrate_draft({1: 0.0005, 16: 0.0008})  # 0.48 ms a forward, 0.02 ms a row fed
    base_before = policy.costs(2).base
    rng = np.random.default_rng(0)
    for _ in range(300):
        forwards, rows = int(rng.integers(0, 5)), int(rng.integers(1, 5))
        policy.observe_draft(rows, forwards, rows * forwards,
                             0.0002 + 0.001 * (forwards > 0) + (0.00048 + 0.00002 * rows) * forwards)
    costs = policy.costs(2)
    assert costs.drafting == pytest.approx(0.001, abs=1e-4)
    assert costs.base - base_before == pytest.approx(0.0002, abs=1e-4)  # the every-step overhead, not the 1 ms
    assert policy.draft.coefficients()[0] == pytest.approx(0.0002, abs=1e-4)


def test_each_band_of_batch_sizes_learns_its_own_step_costs():
    """A draft token's cost differs by batch size (weight traffic at batch 1, arithmetic at 16), and one
    fit of every step is pulled towards the sizes the engine ran most: after 300 batch-1 steps where a
    draft token costs 1 ms, 40 steps at batch 4 where it costs 0.3 ms must be enough for batch 4's
    costs, without changing batch 1's. A band that has not run for a while falls back on the fit of all."""
    policy = SpeculationPolicy("adaptive", max_k=6, rows=4)
    policy.calibrate_target({1: 0.007, 8: 0.007, 64: 0.012})
    rng = np.random.default_rng(0)

    def run(requests: int, steps: int, fixed: float, per_token: float) -> None:
        for _ in range(steps):
            d = int(rng.integers(0, 6 * requests + 1))
            policy.observe_target(requests, requests + d, d > 0, fixed + per_token * d + rng.normal(0, 2e-4))

    run(1, 300, 0.008, 0.001)
    run(4, 40, 0.015, 0.0003)
    assert policy.costs(4).token_time(np.array([12]))[0] == pytest.approx(12 * 0.0003, rel=0.2)
    assert policy.costs(4).base == pytest.approx(0.015, rel=0.1)
    assert policy.costs(1).token_time(np.array([6]))[0] == pytest.approx(6 * 0.001, rel=0.15)
    mixed = policy.target.coefficients()  # all steps: between the two
    assert policy.target.summary()["by_batch"].keys() == {"1", "3-4"}
    run(1, 800, 0.008, 0.001)  # batch 4's steps have aged away: it is costed as all steps are
    assert policy.costs(4).token_time(np.array([12]))[0] == pytest.approx(12 * 0.001, rel=0.15)
    assert not np.allclose(mixed, policy.target.coefficients())
