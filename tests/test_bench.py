"""`specserve bench`'s arithmetic (the command itself is a benchmark, run by hand): configurations with
their own K, and the interleaved rounds' within-round ratios."""

import pytest

from specserve.bench import config_kwargs, summarise_rounds


def test_a_configuration_may_name_its_own_k():
    assert config_kwargs("specserve-fixed:3", 6, False)["speculative_config"]["num_speculative_tokens"] == 3
    assert config_kwargs("specserve-fixed", 6, False)["speculative_config"]["num_speculative_tokens"] == 6
    assert config_kwargs("vllm-draft_model:2", 6, False)["speculative_config"]["num_speculative_tokens"] == 2


def test_ratios_are_taken_within_each_round():
    """Round 1 ran 2x faster for everyone (the machine drifted): the ratio stays 1.5x in both rounds,
    where the ratio of medians over rounds would mix the drift in."""
    rows = [
        {"config": "plain", "batch": 4, "temperature": 0.0, "round": 0, "tokens_per_s": 100.0},
        {"config": "ours", "batch": 4, "temperature": 0.0, "round": 0, "tokens_per_s": 150.0, "k_histogram": [1, 2]},
        {"config": "plain", "batch": 4, "temperature": 0.0, "round": 1, "tokens_per_s": 200.0},
        {"config": "ours", "batch": 4, "temperature": 0.0, "round": 1, "tokens_per_s": 300.0, "k_histogram": [0, 4]},
        {"config": "plain", "batch": 4, "temperature": 0.0, "round": 2, "tokens_per_s": 100.0},
        {"config": "ours", "batch": 4, "temperature": 0.0, "round": 2, "tokens_per_s": 120.0, "k_histogram": [3, 0]},
    ]
    ours = next(r for r in summarise_rounds(rows, "plain") if r["config"] == "ours")
    assert ours["rounds"] == 3
    assert ours["tokens_per_s"] == 150.0
    assert ours["ratio"] == pytest.approx(1.5)
    assert ours["ratio_range"] == pytest.approx((1.2, 1.5))
    assert ours["k_histogram"] == [4, 6]
    plain = next(r for r in summarise_rounds(rows, "plain") if r["config"] == "plain")
    assert plain["ratio"] == 1.0
    assert next(r for r in summarise_rounds(rows, "missing") if r["config"] == "ours")["ratio"] is None


def test_a_point_keeps_its_batch_full_but_for_the_last_wave():
    from specserve.bench import requests_at

    assert requests_at(1) == 16 and requests_at(16) == 48 and requests_at(16, 20) == 20


def test_a_configuration_the_speculator_refuses_is_a_clear_error(capsys):
    from specserve.cli import build_parser

    args = build_parser().parse_args(["bench", "--configs", "plain,specserve-fixed:0"])
    assert args.func(args) == 2
    assert "num_speculative_tokens must be at least 1" in capsys.readouterr().err
    args = build_parser().parse_args(["bench", "--configs", "specserve-fixed:x"])
    assert args.func(args) == 2
    assert "unknown configs ['specserve-fixed:x']" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["bench", "--batch-sizes", "1,x"], ["bench", "--batch-sizes", "0,4"],
                                  ["bench", "--temperatures", "0,-1"], ["k-curve", "--batch-sizes", "4,"],
                                  ["loadtest", "--concurrency", "1,2.5"], ["bench-sampler", "--batch-sizes", ""],
                                  ["bench", "--batch-sizes", "\u00b2"], ["bench", "--temperatures", "inf"]])
def test_a_malformed_number_list_is_refused_by_the_parser(argv, capsys):
    from specserve.cli import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2
    assert "separated by commas" in capsys.readouterr().err


def test_number_lists_parse_to_numbers():
    from specserve.cli import build_parser

    args = build_parser().parse_args(["bench", "--batch-sizes", "1, 4,16", "--temperatures", "0,0.7"])
    assert args.batch_sizes == [1, 4, 16] and args.temperatures == [0.0, 0.7]
    assert build_parser().parse_args(["loadtest", "--out", "out/x"]).concurrency == [1, 2, 4, 8, 16]


def test_the_step_profile_splits_a_step_into_target_draft_and_the_rest():
    from specserve.bench import step_profile

    before = {"steps": 10, "draft_seconds": 1.0, "profile_seconds": {"target_forward": 2.0, "verify": 0.5, "catch_up": 0.4}}
    after = {"steps": 110, "draft_seconds": 1.3, "profile_seconds": {"target_forward": 2.8, "verify": 0.6, "catch_up": 0.5}}
    prof = step_profile(before, after, seconds=1.5)  # 100 steps of 15 ms
    assert prof["step_ms"] == pytest.approx(15.0) and prof["draft_ms"] == pytest.approx(3.0)
    assert prof["phases_ms"] == pytest.approx({"target_forward": 8.0, "verify": 1.0, "catch_up": 1.0})
    assert prof["rest_ms"] == pytest.approx(15.0 - 3.0 - 8.0 - 1.0)


def test_the_profile_table_puts_the_targets_phases_first_and_the_rest_last(capsys):
    from specserve.bench import print_profile

    phases = {"target_forward": 8.0, "verify": 1.0, "follow_rows": 0.01, "catch_up": 1.0}
    print_profile([{"config": "specserve", "batch": 1, "temperature": 0.0, "round": 2,
                    "profile": {"step_ms": 15.0, "draft_ms": 3.0, "rest_ms": 3.0, "draft_share": 0.2, "phases_ms": phases}}])
    header, line = capsys.readouterr().out.strip().splitlines()[-2:]
    assert header.split() == ["config", "batch", "temp", "round", "step", "target_forward", "verify", "draft", "share",
                              "follow_rows", "catch_up", "rest"]
    assert line.split() == ["specserve", "1", "0.0", "2", "15.00", "8.000", "1.000", "3.00", "20%", "0.010", "1.000", "3.00"]


@pytest.mark.slow
def test_a_profiled_point_times_the_targets_forward_verification_and_each_draft_phase():
    """`specserve bench --profile` on a real engine: every phase of the step is timed, and the parts
    add up to no more than the step."""
    from loadtest import load_prompts
    from specserve.bench import measure_point, start_engine
    from specserve.engines import shutdown_llm

    prompts = [p["prompt"] for p in load_prompts()]
    llm = start_engine(config_kwargs("specserve-fixed:3", 6, True), prompts)
    try:
        row = measure_point(llm, "specserve-fixed:3", prompts, batch=2, temperature=0.0, new_tokens=24, requests_per_point=4)
    finally:
        shutdown_llm(llm)
    prof = row["profile"]
    phases = prof["phases_ms"]
    for phase in ("target_forward", "verify", "rebuild", "catch_up", "draft_forward", "sampling", "commit"):
        assert phases[phase] > 0, phase
    assert phases["target_forward"] + phases["verify"] + prof["draft_ms"] < prof["step_ms"]
    assert 0 < prof["rest_ms"] < prof["step_ms"]


def test_the_runners_forward_logits_and_sampling_are_timed_as_the_targets_phases():
    """`profile_runner_phases` on a stand-in runner: each call still returns its result, and its time
    goes to the right phase (the forward and the logits both to the target's forward)."""
    import time
    from types import SimpleNamespace

    import torch

    from plugin import _vllm_internals as internals
    from plugin.step_profile import StepProfile

    def slow(result):
        def call(*args, **kwargs):
            time.sleep(0.01)
            return result, args, kwargs
        return call

    runner = SimpleNamespace(_model_forward=slow("hidden"), _sample=slow("tokens"), model=SimpleNamespace(compute_logits=slow("logits")))
    profile = StepProfile(torch.device("cpu"), enabled=True)
    internals.profile_runner_phases(runner, profile)
    assert runner._model_forward(1, x=2) == ("hidden", (1,), {"x": 2})
    assert runner.model.compute_logits(3) == ("logits", (3,), {})
    assert runner._sample(4) == ("tokens", (4,), {})
    assert profile.seconds["target_forward"] >= 0.02 and 0.01 <= profile.seconds["verify"] < 0.02
    assert profile.seconds["catch_up"] == 0.0
