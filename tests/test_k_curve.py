"""`specserve k-curve`'s arithmetic (the command itself is a benchmark, run by hand): each K against the
best fixed K of its own round, beside the model's curve."""

import pytest

from specserve.k_curve import ADAPTIVE, summarise


def test_each_k_is_compared_with_the_best_fixed_k_of_its_own_round():
    """Round 1 ran 2x faster for every K: the ratios stay those of round 0. The adaptive row is never the
    'best fixed K'; the model's tokens/s are taken relative to the model's best K."""
    rows = []
    for rd, scale in ((0, 1.0), (1, 2.0)):
        for k, tps in ((ADAPTIVE, 190.0), (0, 100.0), (1, 160.0), (2, 200.0)):
            rows.append({"batch": 4, "round": rd, "k": k, "tokens_per_s": tps * scale,
                         "mean_acceptance_length": None if k == 0 else 2.0})
        rows += [{"batch": 4, "round": rd, "k": k, "model_step_ms": ms, "model_tokens_per_s": tps}
                 for k, ms, tps in ((0, 10.0, 400.0), (1, 12.0, 500.0), (2, 14.0, 450.0))]
    summary = {row["k"]: row for row in summarise(rows)}
    assert list(summary) == [ADAPTIVE, 0, 1, 2]
    assert summary[ADAPTIVE]["of_best_fixed"] == pytest.approx(0.95)
    assert summary[2]["of_best_fixed"] == pytest.approx(1.0) and summary[0]["of_best_fixed"] == pytest.approx(0.5)
    assert summary[2]["tokens_per_s"] == pytest.approx(300.0)  # the median over the two rounds
    assert summary[1]["model_of_best"] == pytest.approx(1.0) and summary[2]["model_of_best"] == pytest.approx(0.9)
    assert summary[ADAPTIVE]["model_step_ms"] is None and summary[0]["mean_acceptance_length"] is None


def test_the_decode_comparison_uses_decode_steps_and_tolerates_points_without_any():
    """Decode tokens/s are compared with the best fixed K's decode tokens/s of the same round; a point
    whose log held no full-batch decode step (None) drops out of the ratio instead of failing it."""
    rows = [{"batch": 16, "round": 0, "k": k, "tokens_per_s": 100.0, "mean_acceptance_length": 2.0,
             "decode_tokens_per_s": d, "decode_step_ms": ms}
            for k, d, ms in ((ADAPTIVE, 380.0, 50.0), (1, 300.0, 40.0), (2, 400.0, 55.0), (3, None, None))]
    summary = {row["k"]: row for row in summarise(rows)}
    assert summary[ADAPTIVE]["decode_of_best_fixed"] == pytest.approx(0.95)
    assert summary[1]["decode_of_best_fixed"] == pytest.approx(0.75) and summary[1]["decode_step_ms"] == 40.0
    assert summary[3]["decode_of_best_fixed"] is None and summary[3]["of_best_fixed"] == pytest.approx(1.0)
