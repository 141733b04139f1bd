"""The speculation arithmetic against the seeds' table, and the `specserve math` command."""

import json
import subprocess
import sys

import pytest
import torch

from plugin.speculation_math import acceptance_rate, expected_tokens, optimal_k, optimal_k_table, speedup

# alpha, c, optimal k, speed-up: the seeds' table, as printed there.
SEED_TABLE = [
    (0.6, 10, 3, 1.67), (0.6, 20, 4, 1.92), (0.6, 50, 6, 2.17),
    (0.7, 10, 4, 1.98), (0.7, 20, 6, 2.35), (0.7, 50, 8, 2.76),
    (0.8, 10, 6, 2.47), (0.8, 20, 8, 3.09), (0.8, 50, 11, 3.82),
    (0.9, 10, 10, 3.43), (0.9, 20, 13, 4.67), (0.9, 50, 19, 6.37),
]


@pytest.mark.parametrize("alpha,c,k,s", SEED_TABLE)
def test_reproduces_the_seeds_table(alpha, c, k, s):
    best_k, best = optimal_k(alpha, c)
    assert best_k == k
    assert round(best, 2) == s


def test_table_has_the_twelve_rows():
    assert [(r["alpha"], r["c"], r["k"], round(r["speedup"], 2)) for r in optimal_k_table()] == SEED_TABLE


def test_expected_tokens_for_k5_alpha071_is_3_01_not_3_47():
    """The from-scratch README claims about 3.47 tokens per step for K=5, alpha=0.71;
    (1 - 0.71^6) / (1 - 0.71) is 3.0066."""
    assert expected_tokens(0.71, 5) == pytest.approx(3.0066, abs=1e-4)
    assert abs(expected_tokens(0.71, 5) - 3.47) > 0.4


def test_edges():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert speedup(0.0, 1, 10) == pytest.approx(1 / 1.1)
    p, q = torch.tensor([0.3, 0.7]), torch.tensor([0.6, 0.4])
    assert acceptance_rate(p, q).item() == pytest.approx(0.7)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "specserve.cli", "math", *args], capture_output=True, text=True)


def test_cli_single_and_json():
    out = run_cli("--alpha", "0.8", "--c", "20")
    assert out.returncode == 0
    header, row = out.stdout.splitlines()
    assert header.split() == ["alpha", "c", "optimal", "k", "speed-up"]
    assert row.split() == ["0.80", "20", "8", "3.09x"]  # alpha, c, optimal k, speed-up
    rows = json.loads(run_cli("--table", "--json").stdout)
    assert len(rows) == 12 and set(rows[0]) == {"alpha", "c", "k", "speedup"}
    assert (rows[-1]["k"], round(rows[-1]["speedup"], 2)) == (19, 6.37)


def test_cli_rejects_bad_input():
    assert run_cli("--alpha", "1.5", "--c", "20").returncode == 2
    assert run_cli().returncode == 2
