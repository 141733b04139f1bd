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
                                  ["loadtest", "--concurrency", "1,2.5"], ["bench-sampler", "--batch-sizes", ""]])
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
