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
