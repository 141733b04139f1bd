"""Load-test tooling: the report arithmetic on fixed samples, and a short real Locust run on loopback."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deployment.defaults import REPO_ROOT
from loadtest._report import capacity, percentile, speedups, summarize, write_outputs


def sample(target, conc, e2e, start=0.0, tokens=100, drafted=0, accepted=0, ok=True):
    return {"target": target, "concurrency": conc, "ok": str(ok), "start": start, "e2e_s": e2e, "tpot_s": e2e / 100,
            "ttft_s": 0.1, "output_tokens": tokens, "drafted_tokens": drafted, "accepted_tokens": accepted}


# Measured windows (first start to last end): 10 s at concurrency 1, 20 s at concurrency 4.
FIXED = (
    [sample("speculative", 1, e, s) for e, s in zip((1.0, 2.0, 3.0, 4.0, 5.0), (0, 1, 2, 3, 5))]
    + [sample("baseline", 1, e) for e in (2.0, 4.0, 6.0, 8.0, 10.0)]
    + [sample("speculative", 4, e, s, drafted=40, accepted=30) for e, s in zip((6.0, 6.0, 8.0, 8.0), (0, 0, 12, 12))]
    + [sample("speculative", 4, 0, 5, ok=False)]
    + [sample("baseline", 4, e, s) for e, s in zip((4.0, 5.0, 6.0, 7.0), (0, 15, 14, 13))]
)


def test_percentiles_throughput_and_acceptance():
    assert percentile([1, 2, 3, 4, 5], 50) == 3.0
    assert percentile([1, 2, 3, 4, 5], 95) == pytest.approx(4.8)  # 4 + 0.8 * (5 - 4)
    s = summarize(FIXED)
    assert s["speculative"][1]["measured_s"] == 10.0 and s["baseline"][4]["measured_s"] == 20.0
    assert s["speculative"][1]["p50_e2e_s"] == 3.0 and s["baseline"][1]["p50_e2e_s"] == 6.0
    assert s["baseline"][1]["p95_e2e_s"] == pytest.approx(9.6)
    assert s["speculative"][1]["output_tokens_per_s"] == 50.0  # 5 x 100 tokens in 10 s
    assert s["speculative"][4]["failures"] == 1 and s["speculative"][4]["requests"] == 4
    assert s["speculative"][4]["acceptance_rate"] == 0.75
    assert s["speculative"][4]["requests_per_s"] == 0.2


def test_speedup_and_crossover():
    speed = speedups(summarize(FIXED))
    assert speed["by_concurrency"][1]["p50_e2e_speedup"] == 2.0  # 6 / 3
    assert speed["by_concurrency"][4]["p50_e2e_speedup"] == pytest.approx(5.5 / 7.0)
    assert speed["crossover_concurrency"] == 4


def test_slo_capacity_arithmetic():
    s = summarize(FIXED)
    plan = capacity(s, slo_p95_e2e_s=7.0, target_rps=1.0)["targets"]
    # speculative: c=1 P95 4.8 s is within 7 s; c=4 P95 8.0 s is not (and had a failure).
    assert plan["speculative"]["max_concurrency_within_slo"] == 1
    assert plan["speculative"]["requests_per_s_per_replica"] == 0.5
    assert plan["speculative"]["replicas_for_target"] == 2  # ceil(1.0 / 0.5)
    # baseline: c=1 P95 9.6 s misses; c=4 P95 6.85 s is within: 4 requests / 20 s = 0.2 req/s.
    assert plan["baseline"]["max_concurrency_within_slo"] == 4
    assert plan["baseline"]["replicas_for_target"] == 5
    # Autoscaling: keep each replica at the concurrency that met the SLO, 1.5x that at most.
    assert plan["baseline"]["autoscaling"] == {"target_ongoing_requests": 4, "max_ongoing_requests": 6,
                                               "min_replicas": 1, "max_replicas": 5}
    assert plan["speculative"]["autoscaling"]["max_ongoing_requests"] == 2
    assert capacity(s, slo_p95_e2e_s=1.0)["targets"]["baseline"]["autoscaling"] is None


def test_report_files(tmp_path):
    s = summarize(FIXED)
    write_outputs(tmp_path, s, speedups(s), capacity(s, 7.0, 1.0), {"note": "fixed"})
    for name in ("summary.json", "report.md", "latency.png", "tpot.png", "throughput.png", "speedup.png"):
        assert (tmp_path / name).stat().st_size > 0
    report = (tmp_path / "report.md").read_text()
    assert "concurrency 4" in report
    assert "baseline: `max_ongoing_requests: 6, autoscaling_config: {min_replicas: 1, max_replicas: 5, " \
           "target_ongoing_requests: 4}`" in report


def test_rates_count_the_measured_window_not_the_nominal_duration():
    """Locust lets requests in flight at the end of -t finish: four back-to-back 10 s requests of a
    level run for 30 s take 40 s, and the level's rates are counted over those 40 s."""
    samples = [sample("baseline", 1, 10.0, start=100.0 + 10 * i) for i in range(4)]
    level = summarize(samples)["baseline"][1]
    assert level["measured_s"] == 40.0
    assert level["output_tokens_per_s"] == pytest.approx(400 / 40)
    assert level["requests_per_s"] == pytest.approx(4 / 40)


def test_every_load_test_option_reaches_locust(monkeypatch, tmp_path):
    """`specserve loadtest`'s Locust command line, parsed by Locust's own parser with the locustfile
    loaded (in a fresh interpreter: Locust patches the standard library with gevent), carries every
    option of the locustfile as given to specserve loadtest, the GPU profile's model ids included."""
    from loadtest import _options
    from specserve.cli import build_parser
    from specserve.loadtest_runner import locust_command

    given = {"--speculative-model": "qwen2.5-7b-speculative", "--baseline-model": "qwen2.5-7b-baseline",
             "--max-tokens": "7", "--temperature": "0.5", "--ignore-eos": "false", "--prompt-seed": "5"}
    assert set(given) == {o.flag for o in _options.OPTIONS}, "a new option needs a value here"
    args = build_parser().parse_args(["loadtest", "--out", str(tmp_path), *[a for kv in given.items() for a in kv]])
    cmd, env = locust_command(tmp_path, "http://127.0.0.1:9", "speculative", 2, 5, args)
    code = ("import json, sys; import loadtest.locustfile; from locust.argument_parser import get_parser; "
            "o = get_parser().parse_args(sys.argv[1:]); "
            f"print(json.dumps({{d: getattr(o, d) for d in {[o.dest for o in _options.OPTIONS]!r}}}))")
    result = subprocess.run([sys.executable, "-c", code, *cmd[1:]], env=env, cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    parsed = json.loads(result.stdout.strip().splitlines()[-1])
    assert parsed == {"speculative_model": "qwen2.5-7b-speculative", "baseline_model": "qwen2.5-7b-baseline",
                      "max_tokens": 7, "temperature": 0.5, "ignore_eos": False, "prompt_seed": 5}


def test_every_target_of_a_round_draws_the_same_prompts_and_each_round_new_ones(tmp_path):
    """Common prompts: the seed that `specserve loadtest` gives Locust is the same for every target of a
    round and new each round; with one seed, the i-th user draws the same sequence in every run (and
    users draw different ones); without one, runs differ."""
    from loadtest._stream import prompt_rng, random_prompt
    from specserve.cli import build_parser
    from specserve.loadtest_runner import locust_command

    def seed(target, round_, *given):
        args = build_parser().parse_args(["loadtest", "--out", str(tmp_path), *given])
        cmd, _ = locust_command(tmp_path, "http://127.0.0.1:9", target, 4, 5, args, "SpeculativeUser", target, round_)
        return int(cmd[cmd.index("--prompt-seed") + 1])

    assert seed("speculative", 0) == seed("specserve-k4", 0) == 0 and seed("baseline", 3, "--prompt-seed", "7") == 10
    assert len({seed("speculative", r) for r in range(4)}) == 4

    def drawn(seed_, user, n=20):
        rng = prompt_rng(seed_, user)
        return [random_prompt(rng)["id"] for _ in range(n)]

    assert drawn(3, 0) == drawn(3, 0) and drawn(3, 1) == drawn(3, 1)
    assert drawn(3, 0) != drawn(3, 1) and drawn(3, 0) != drawn(4, 0)
    assert drawn(None, 0) != drawn(None, 0)


@pytest.mark.slow
def test_short_headless_locust_run(serve_app, tmp_path):
    """Both user classes for 25 s: no failures; P50/P95 of every custom entry for both targets; with
    --prompt-seed, each user's requests are its seeded prompt sequence, in order."""
    from loadtest._stream import prompt_rng, random_prompt

    prefix = tmp_path / "run"
    cmd = [str(Path(sys.executable).with_name("locust")), "-f", str(REPO_ROOT / "loadtest"), "--headless",
           "--host", serve_app, "-u", "4", "-r", "4", "-t", "25s", "--stop-timeout", "60", "--csv", str(prefix),
           "--only-summary", "--max-tokens", "32", "--prompt-seed", "11", "SpeculativeUser", "BaselineUser"]
    env = os.environ | {"SPECSERVE_SAMPLES_CSV": str(tmp_path / "samples.csv")}
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180)
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
    with open(tmp_path / "samples.csv") as f:
        samples = sorted(csv.DictReader(f), key=lambda s: float(s["start"]))
    assert {s["user"] for s in samples} == {"0", "1", "2", "3"}
    for user in range(4):
        asked = [s["prompt_id"] for s in samples if s["user"] == str(user)]
        rng = prompt_rng(11, user)
        assert asked == [random_prompt(rng)["id"] for _ in asked], user


@pytest.mark.slow
def test_the_load_test_reads_each_replicas_counters_from_the_served_route(serve_app):
    """What `specserve loadtest` reads from /v1/specserve/stats of the real application: the speculative
    model's counters by replica tag (one replica here), which `engine_counters` sums; nothing for the
    baseline, which does not speculate; each replica's memory; the models for the title."""
    from deployment.defaults import BASELINE_MODEL_ID, SPECULATIVE_MODEL_ID
    from loadtest._report import engine_counters
    from specserve.loadtest_runner import models_label, replica_counters, replica_memory_bytes, speculation_stats

    (tag, stats), = replica_counters(serve_app, SPECULATIVE_MODEL_ID).items()
    assert stats["enabled"] and stats["replica"] == tag and len(stats["chosen_k_histogram"]) == stats["k_max"] + 1
    assert engine_counters({tag: stats}, {tag: stats})["replicas"] == 1
    assert replica_counters(serve_app, BASELINE_MODEL_ID) is None and speculation_stats(serve_app, BASELINE_MODEL_ID) is None
    assert replica_memory_bytes(serve_app, BASELINE_MODEL_ID) > 2**30
    assert models_label(speculation_stats(serve_app, SPECULATIVE_MODEL_ID), "m") == "target models/target / draft models/draft"


def test_comparison_targets_noise_band_and_engine_counters():
    """More targets than speculative/baseline: each gets P50/P95 speed-ups and a throughput ratio
    against the baseline; a repeated baseline is the noise band; engine counters become shares."""
    from loadtest._report import engine_counters

    samples = FIXED + [sample("specserve-k2", 1, e) for e in (3.0, 3.0, 3.0)] + \
        [sample("baseline-repeat", 1, e) for e in (2.0, 4.0, 6.0, 8.0, 10.0)]
    speed = speedups(summarize(samples))
    assert speed["by_target"]["specserve-k2"]["by_concurrency"][1]["p50_e2e_speedup"] == 2.0
    assert speed["by_target"]["baseline-repeat"]["by_concurrency"][1]["p95_e2e_speedup"] == 1.0
    assert speed["by_concurrency"] == speed["by_target"]["speculative"]["by_concurrency"]
    before = {"r1": {"chosen_k_histogram": [5, 0, 10], "steps": 10, "steps_drafted": 5, "finished_requests": 2,
                     "finished_requests_drafted": 1}}
    after = {"r1": {"chosen_k_histogram": [15, 10, 10], "steps": 30, "steps_drafted": 10, "finished_requests": 6,
                    "finished_requests_drafted": 4, "engine_cost_ms": "r1's"}}
    counters = engine_counters(before, after)
    assert counters == {"k_histogram": [10, 10, 0], "mean_k": 0.5, "drafted_step_share": 0.25,
                        "drafted_request_share": 0.75, "replicas": 1, "engine_cost_ms": "r1's"}
    # Autoscaled: a replica that started during the level counts from zero and adds to the first; the
    # cost model comes from the replica that ran more steps; one that stopped is named as lost.
    after["r2"] = {"chosen_k_histogram": [0, 0, 30], "steps": 30, "steps_drafted": 30, "finished_requests": 4,
                   "finished_requests_drafted": 4, "engine_cost_ms": "r2's"}
    before["r0"] = before["r1"]
    counters = engine_counters(before, after)
    assert counters == {"k_histogram": [10, 10, 30], "mean_k": 1.4, "drafted_step_share": 35 / 50,
                        "drafted_request_share": 7 / 8, "replicas": 2, "replicas_lost": ["r0"],
                        "engine_cost_ms": "r2's"}


def test_charts_read_in_a_minute(tmp_path):
    """Concurrency ticks are the plain numbers measured; the title names models, K policy, output
    length and duration; the speed-up chart has a break-even line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from loadtest._report import _concurrency_axis, chart_title

    fig, ax = plt.subplots()
    ax.plot([1, 2, 4, 16], [1, 1, 1, 1])
    _concurrency_axis(ax, [1, 2, 4, 16])
    fig.canvas.draw()
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "4", "16"]
    plt.close(fig)
    title = chart_title({"models_label": "target t / draft d", "k_policy": "adaptive (K_max 6)", "max_tokens": 128,
                         "temperature": 0.0, "duration_s": 30})
    assert all(part in title for part in ("target t / draft d", "adaptive", "128 output tokens", "30 s per point"))
    s = summarize(FIXED)
    write_outputs(tmp_path, s, speedups(s), None, {"models_label": "m", "k_policy": "adaptive", "duration_s": 30})
    report = (tmp_path / "report.md").read_text()
    assert "P95 e2e speed-up" in report and "chosen K shares" in report


def test_each_level_runs_every_target_in_a_shuffled_order():
    """Levels one after another, each with every target once per round, each round in an order of its
    own (the machine's drift falls on every target alike), orders that a rerun with the same seed
    repeats, and that a run with another seed does not; each run draws a seed unless given one."""
    from specserve.cli import build_parser
    from specserve.loadtest_runner import measurement_order

    targets, levels = ["speculative", "k2", "k4", "baseline", "baseline-repeat"], [1, 2, 4, 8, 16, 32]
    order = measurement_order(targets, levels)
    assert [(level, r) for level, r, _ in order] == [(level, 0) for level in levels for _ in targets]
    blocks = [[t for level, _, t in order if level == c] for c in levels]
    assert all(sorted(block) == sorted(targets) for block in blocks)
    assert len({tuple(block) for block in blocks}) > 1
    assert order == measurement_order(targets, levels)
    assert measurement_order(targets, levels, seed=7) == measurement_order(targets, levels, seed=7) != order
    assert build_parser().parse_args(["loadtest", "--out", "x"]).order_seed is None
    assert build_parser().parse_args(["loadtest", "--out", "x", "--order-seed", "7"]).order_seed == 7
    rounds = measurement_order(targets, [1, 4], rounds=3)
    assert [(level, r) for level, r, _ in rounds] == [(level, r) for level in (1, 4) for r in range(3) for _ in targets]
    per_round = [tuple(t for level, r, t in rounds if (level, r) == key) for key in {(lv, r) for lv, r, _ in rounds}]
    assert all(sorted(block) == sorted(targets) for block in per_round) and len(set(per_round)) > 1


def test_rounds_pool_requests_add_windows_and_pair_each_round_with_the_baselines():
    """Two rounds of a level: percentiles over both rounds' requests, throughput over the two windows
    added up (not the hour between them), and each round's throughput ratio against the baseline's
    same round."""
    def rounds(target, e2es, starts):
        return [sample(target, 1, e, start=s) | {"round": r} for r, (e, s) in enumerate(zip(e2es, starts))]

    # speculative: round 0 one 2 s request at t=0, round 1 one 4 s request an hour later
    samples = rounds("speculative", (2.0, 4.0), (0.0, 3600.0)) + rounds("baseline", (4.0, 4.0), (10.0, 3610.0))
    s = summarize(samples)
    spec = s["speculative"][1]
    assert spec["measured_s"] == 6.0 and spec["output_tokens_per_s"] == pytest.approx(200 / 6)
    assert spec["output_tokens_per_s_by_round"] == {0: 50.0, 1: 25.0}
    assert spec["p50_e2e_s"] == 3.0 and spec["requests"] == 2
    by_round = speedups(s)["by_concurrency"][1]["throughput_ratio_by_round"]
    assert by_round == {0: pytest.approx(2.0), 1: pytest.approx(1.0)}
    assert summarize(FIXED)["speculative"][1]["output_tokens_per_s_by_round"] == {0: 50.0}  # samples without a round


def test_the_speculative_model_against_each_compared_one_round_by_round():
    """The default against a fixed-K variant: pooled, each round within that round, and the rounds'
    median, which one round's outlier does not move; the report prints them."""
    from loadtest._report import markdown

    def rounds(target, e2es):  # round r: one request of e2e s at t = 1000 r (100 tokens in e2e s)
        return [sample(target, 1, e, start=1000.0 * r) | {"round": r} for r, e in enumerate(e2es)]

    samples = (rounds("speculative", (2.0, 2.0, 1.0)) + rounds("specserve-k6", (2.0, 2.2, 4.0))
               + rounds("baseline", (4.0, 4.0, 4.0)) + rounds("baseline-repeat", (4.0, 4.0, 4.0)))
    speed = speedups(summarize(samples))
    assert set(speed["speculative_against"]) == {"specserve-k6"}  # neither baseline
    k6 = speed["speculative_against"]["specserve-k6"][1]
    assert k6["throughput_ratio_by_round"] == {0: pytest.approx(1.0), 1: pytest.approx(1.1), 2: pytest.approx(4.0)}
    assert k6["median_by_round"] == pytest.approx(1.1)
    assert k6["throughput_ratio"] == pytest.approx((300 / 5.0) / (300 / 8.2))
    assert "| specserve-k6 | 1 | 1.64x | 1.00 / 1.10 / 4.00 | 1.10x |" in markdown(summarize(samples), speed, None, {})


def test_the_title_names_the_k_policy_with_its_request_speed_floor():
    from specserve.loadtest_runner import policy_label

    assert policy_label({"k_policy": "adaptive", "k_max": 6, "request_speed_floor": 0.8}) == \
        "adaptive (K_max 6, request speed floor 0.8)"
    assert policy_label({"k_policy": "adaptive", "k_max": 6, "request_speed_floor": None}) == "adaptive (K_max 6)"
    assert policy_label({"k_policy": "fixed", "k_max": 4, "request_speed_floor": 0.8}) == "fixed (K_max 4)"
    assert policy_label({}) == "? (K_max ?)"


def test_the_same_requests_paired_across_targets_by_round_user_and_turn():
    """With common prompts each user's n-th request in a round asked every target the same prompt: the
    speed-up over those pairs (geometric mean) ignores failed requests, other rounds, other levels and
    pairs whose prompts differ; the report prints it with the pair count."""
    from loadtest._report import markdown, paired_e2e_speedup

    def req(target, user, prompt, e2e, start, round_=0, conc=2, ok=True):
        return sample(target, conc, e2e, start=start, ok=ok) | {"round": round_, "user": user, "prompt_id": prompt}

    samples = [req("speculative", 0, "p1", 1.0, 0), req("speculative", 0, "p2", 1.0, 1), req("speculative", 0, "p3", 1.0, 2),
               req("specserve-k6", 0, "p1", 2.0, 10), req("specserve-k6", 0, "p2", 1.5, 12),
               req("speculative", 1, "p4", 1.0, 0), req("speculative", 1, "p5", 1.0, 1, ok=False),
               req("speculative", 1, "p6", 1.0, 2),
               req("specserve-k6", 1, "p4", 1.0, 10), req("specserve-k6", 1, "p5", 3.0, 11),
               req("specserve-k6", 1, "p7", 5.0, 14),
               req("speculative", 0, "p9", 10.0, 100, round_=1), req("specserve-k6", 0, "p1", 9.0, 0, conc=4),
               req("baseline", 0, "p1", 4.0, 10), req("baseline", 1, "p4", 4.0, 10)]
    assert paired_e2e_speedup(samples, "speculative", "specserve-k6", 2) == \
        {"paired_e2e_speedup": pytest.approx(3 ** (1 / 3)), "pairs": 3}
    assert paired_e2e_speedup(samples, "speculative", "specserve-k2", 2) == {"paired_e2e_speedup": None, "pairs": 0}
    speed = speedups(summarize(samples), samples)
    k6 = speed["speculative_against"]["specserve-k6"][2]
    assert k6["paired_e2e_speedup"] == pytest.approx(3 ** (1 / 3)) and k6["pairs"] == 3
    assert "| 1.44x (3) |" in markdown(summarize(samples), speed, None, {})
    assert speedups(summarize(samples))["speculative_against"]["specserve-k6"][2].get("paired_e2e_speedup") is None
