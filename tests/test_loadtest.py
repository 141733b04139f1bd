"""Load-test tooling: the report arithmetic on fixed samples, and a short real Locust run on loopback."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest._report import capacity, percentile, speedups, summarize, write_outputs
from plugin.paths import REPO_ROOT


def sample(target, conc, e2e, tokens=100, drafted=0, accepted=0, ok=True):
    return {"target": target, "concurrency": conc, "ok": str(ok), "e2e_s": e2e, "tpot_s": e2e / 100,
            "ttft_s": 0.1, "output_tokens": tokens, "drafted_tokens": drafted, "accepted_tokens": accepted}


FIXED = (
    [sample("speculative", 1, e) for e in (1.0, 2.0, 3.0, 4.0, 5.0)]
    + [sample("baseline", 1, e) for e in (2.0, 4.0, 6.0, 8.0, 10.0)]
    + [sample("speculative", 4, e, drafted=40, accepted=30) for e in (6.0, 6.0, 8.0, 8.0)]
    + [sample("speculative", 4, 0, ok=False)]
    + [sample("baseline", 4, e) for e in (4.0, 5.0, 6.0, 7.0)]
)
DURATIONS = {("speculative", 1): 10.0, ("baseline", 1): 10.0, ("speculative", 4): 20.0, ("baseline", 4): 20.0}


def test_percentiles_throughput_and_acceptance():
    assert percentile([1, 2, 3, 4, 5], 50) == 3.0
    assert percentile([1, 2, 3, 4, 5], 95) == pytest.approx(4.8)  # 4 + 0.8 * (5 - 4)
    s = summarize(FIXED, DURATIONS)
    assert s["speculative"][1]["p50_e2e_s"] == 3.0 and s["baseline"][1]["p50_e2e_s"] == 6.0
    assert s["baseline"][1]["p95_e2e_s"] == pytest.approx(9.6)
    assert s["speculative"][1]["output_tokens_per_s"] == 50.0  # 5 x 100 tokens in 10 s
    assert s["speculative"][4]["failures"] == 1 and s["speculative"][4]["requests"] == 4
    assert s["speculative"][4]["acceptance_rate"] == 0.75
    assert s["speculative"][4]["requests_per_s"] == 0.2


def test_speedup_and_crossover():
    speed = speedups(summarize(FIXED, DURATIONS))
    assert speed["by_concurrency"][1]["p50_e2e_speedup"] == 2.0  # 6 / 3
    assert speed["by_concurrency"][4]["p50_e2e_speedup"] == pytest.approx(5.5 / 7.0)
    assert speed["crossover_concurrency"] == 4


def test_slo_capacity_arithmetic():
    s = summarize(FIXED, DURATIONS)
    plan = capacity(s, slo_p95_e2e_s=7.0, target_rps=1.0)["targets"]
    # speculative: c=1 P95 4.8 s is within 7 s; c=4 P95 8.0 s is not (and had a failure).
    assert plan["speculative"]["max_concurrency_within_slo"] == 1
    assert plan["speculative"]["requests_per_s_per_replica"] == 0.5
    assert plan["speculative"]["replicas_for_target"] == 2  # ceil(1.0 / 0.5)
    # baseline: c=1 P95 9.6 s misses; c=4 P95 6.85 s is within: 4 requests / 20 s = 0.2 req/s.
    assert plan["baseline"]["max_concurrency_within_slo"] == 4
    assert plan["baseline"]["replicas_for_target"] == 5


def test_report_files(tmp_path):
    s = summarize(FIXED, DURATIONS)
    write_outputs(tmp_path, s, speedups(s), capacity(s, 7.0, 1.0), {"note": "fixed"})
    for name in ("summary.json", "report.md", "latency.png", "tpot.png", "throughput.png", "speedup.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert "concurrency 4" in (tmp_path / "report.md").read_text()


@pytest.mark.slow
def test_short_headless_locust_run(serve_app, tmp_path):
    """Both user classes for 25 s: no failures; P50/P95 of every custom entry for both targets."""
    prefix = tmp_path / "run"
    cmd = [str(Path(sys.executable).with_name("locust")), "-f", str(REPO_ROOT / "loadtest"), "--headless",
           "--host", serve_app, "-u", "4", "-r", "4", "-t", "25s", "--stop-timeout", "60", "--csv", str(prefix),
           "--only-summary", "--max-tokens", "32", "SpeculativeUser", "BaselineUser"]
    result = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(f"{prefix}_stats.csv") as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    for target in ("speculative", "baseline"):
        for entry in ("ttft", "tpot", "e2e", "output_tokens"):
            row = rows[(entry, target)]
            assert int(row["Request Count"]) > 0 and int(row["Failure Count"]) == 0, row
            assert float(row["50%"]) > 0 and float(row["95%"]) >= float(row["50%"])
    assert float(rows[("drafted_tokens", "speculative")]["50%"]) > 0
    assert int(rows[("POST", "baseline /v1/completions")]["Failure Count"]) == 0
