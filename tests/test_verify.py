"""`specserve verify`: its statistics (false-alarm rate and power, simulated), the refusal of a draft with
another tokenizer, and, in the real engines, the shipped pair passing with our speculator while vLLM's own
draft_model method on this CPU build and a deliberately broken control are told apart from it."""

import collections
import json

import numpy as np
import pytest

from specserve.verify import (MIN_TV, TOKENS_PER_TIE, allowed_divergences, greedy_divergences, homogeneity,
                              rejection_rate, sample_size, shifted)

# A realistic (t2, t3) distribution: Zipf-like over 300 pairs.
PAIRS = np.array([1.0 / (i + 1) ** 1.1 for i in range(300)])
PAIRS /= PAIRS.sum()


def test_false_alarm_rate_is_at_most_twice_nominal():
    """200 simulated repetitions with both samples from one distribution (2,000 each), at three levels."""
    rng = np.random.default_rng(7)
    for significance, allowed in ((0.05, 20), (0.01, 4), (1e-3, 0)):
        rate = rejection_rate(PAIRS, PAIRS, 2000, significance, 200, rng)
        assert rate * 200 <= allowed, (significance, rate)


def test_chosen_sample_size_detects_the_stated_total_variation():
    pilot = collections.Counter(dict(enumerate(np.random.default_rng(1).multinomial(2000, PAIRS))))
    n, power = sample_size(pilot, sims=100)
    alternative = shifted(PAIRS, MIN_TV)
    assert 0.5 * np.abs(np.pad(PAIRS, (0, len(alternative) - len(PAIRS))) - alternative).sum() == pytest.approx(MIN_TV)
    assert power >= 0.9
    # Fresh simulations at that n against the true distribution: power holds (within simulation noise).
    assert rejection_rate(PAIRS, alternative, n, 1e-3, 100, np.random.default_rng(2)) >= 0.8


def test_homogeneity_pools_rare_pairs_and_reports_total_variation():
    a = collections.Counter({(1, 2): 500, (3, 4): 480, (5, 6): 3, (7, 8): 2})
    p, tv = homogeneity(a, a.copy())
    assert p == pytest.approx(1.0) and tv == 0.0
    b = collections.Counter({(1, 2): 700, (3, 4): 280, (5, 6): 5})
    p, tv = homogeneity(a, b)
    # (5, 6) and (7, 8) are rare (under 10 together) and pooled: 5 and 5; total variation over the cells tested.
    assert p < 1e-6 and tv == pytest.approx(0.5 * (200 + 200 + 0) / 985)


def test_a_greedy_divergence_passes_only_where_the_speculative_token_ties_the_top_one():
    plain = [[1, 2, 3], [1, 2, 3], [4, 5, 6], [7, 8, 9]]
    spec = [[1, 2, 3], [1, 9, 3], [4, 5, 7], [7]]
    top = [[{}] * 3,
           [{1: -0.1}, {2: -0.69, 9: -0.70, 3: -3.0}, {3: -0.1}],  # 9 ties 2 (0.01 nats): a near-tie
           [{4: -0.1}, {5: -0.1}, {6: -0.69, 8: -0.69, 7: -0.9}],  # an exact tie, but 7 is not part of it
           [{7: -0.1}, {8: -0.1}, {9: -0.1}]]                      # cut short: no token to compare
    divergences = greedy_divergences(plain, top, spec)
    assert [(d["prompt"], d["token"], d["near_tie"]) for d in divergences] == [(1, 1, True), (2, 2, False), (3, 1, False)]
    assert divergences[0]["top2_gap_nats"] == pytest.approx(0.01) and divergences[1]["top2_gap_nats"] == 0.0
    # The allowance counts the tokens compared, each prompt up to its first divergence.
    assert allowed_divergences(plain, divergences) == 1
    long = [[0] * TOKENS_PER_TIE] * 5
    assert allowed_divergences(long, [{"prompt": 0, "token": 0}]) == 4


def run_cli(*argv):
    from specserve.cli import build_parser

    args = build_parser().parse_args(["verify", *argv])
    return args.func(args)


def test_a_draft_with_another_tokenizer_is_refused(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "def": 1, "return": 2}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 3}))
    report_path = tmp_path / "report.json"
    assert run_cli("--draft", str(tmp_path), "--json", str(report_path)) == 1
    report = json.loads(report_path.read_text())
    assert not report["passed"] and not report["vocabulary"]["passed"]
    assert "does not share the target's vocabulary" in report["vocabulary"]["detail"]
    assert "Vocabulary: FAIL" in capsys.readouterr().out


QUICK = ["--greedy-prompts", "8", "--greedy-tokens", "24", "--sizing-prompts", "8", "--no-measure-optimal-k"]


@pytest.mark.slow
def test_verify_passes_ours_and_fails_vllms_draft_model_on_this_build(tmp_path):
    """One plain reference run, compared with three engines: ours (must pass, with sizing), vLLM's own
    draft_model (its output follows q at temperature 1 on this CPU build: must fail the distribution
    check, and the report must say so), and a second plain engine (the control: must pass)."""
    from specserve.cli import build_parser
    from specserve.verify import markdown, verify

    def args(method):
        return build_parser().parse_args(["verify", "--method", method, *QUICK])

    ours, plain = verify(args("specserve"))
    assert ours["passed"], markdown(ours)
    dist = ours["distribution"]["settings"][0]
    assert dist["verdict"] == "pass" and dist["drafted_share"] > 0.9 and dist["samples"] >= 2000
    sizing = ours["sizing"]
    assert 0.5 < sizing["alpha"] < 0.95 and sizing["c"] > 1 and sizing["optimal_k"] >= 1
    assert sizing["measured_speedup_at_k"] > 1.0

    theirs, _ = verify(args("vllm-draft_model"), plain=plain)
    assert not theirs["passed"] and theirs["greedy"]["passed"]
    assert theirs["distribution"]["settings"][0]["verdict"] == "reject"
    assert "## 3. Distribution of tokens 2 and 3: FAIL" in markdown(theirs)

    control, _ = verify(args("plain"), plain=plain)
    assert control["passed"], markdown(control)
