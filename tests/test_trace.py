"""`plugin.trace`: the worker's bounded trace book, the cut to the completion, token texts and the
summary figures (fast; the engine and HTTP paths are tested in test_engine and test_deployment)."""

import pytest

from plugin.speculation_math import optimal_k, speedup
from plugin.trace import TRACE_ARG, TraceBook, cut_to_completion, step_record, summarize, token_texts, trace_document


def test_trace_key_only_for_requests_that_ask():
    from plugin.trace import trace_key

    assert trace_key(None, "r1") is None
    assert trace_key({}, "r1") is None
    assert trace_key({TRACE_ARG: 0}, "r1") is None
    assert trace_key({TRACE_ARG: "false"}, "r1") is None
    assert trace_key({TRACE_ARG: "False"}, "r1") is None and trace_key({TRACE_ARG: "no"}, "r1") is None
    assert trace_key({TRACE_ARG: 1}, "r1") == "r1"
    assert trace_key({TRACE_ARG: True}, "r1") == "r1"
    assert trace_key({TRACE_ARG: "my-key"}, "r1") == "my-key"


def test_step_record_names_recovered_and_bonus():
    rejected = step_record([5, 6, 7], [5, 9])
    assert (rejected["k"], rejected["accepted"], rejected["recovered"], rejected["bonus"]) == (3, 1, 9, None)
    all_passed = step_record([5, 6], [5, 6, 8])
    assert (all_passed["accepted"], all_passed["recovered"], all_passed["bonus"]) == (2, None, 8)
    no_drafts = step_record([], [4])
    assert (no_drafts["k"], no_drafts["accepted"], no_drafts["bonus"]) == (0, 0, 4)


def test_book_holds_only_traced_requests_and_frees_them():
    book = TraceBook(max_unclaimed=2)
    book.start("a", "key-a")
    book.record("a", [], [1])
    book.record("a", [2, 3], [2, 4])
    book.record("untraced", [1], [1, 2])  # never started: nothing kept
    book.record("a", [9], [])  # a prompt chunk that emitted nothing
    assert book.held() == {"trace_live_requests": 1, "trace_held": 1, "trace_held_steps": 2}
    trace = book.take("key-a")
    assert [s["emitted"] for s in trace["steps"]] == [[1], [2, 4]] and not trace["truncated"]
    assert book.take("key-a") is None
    book.record("a", [5], [5, 6])  # after the take: ignored
    book.finish(["a"])
    assert book.held() == {"trace_live_requests": 0, "trace_held": 0, "trace_held_steps": 0}


def test_unclaimed_traces_are_bounded_oldest_first():
    book = TraceBook(max_unclaimed=2)
    for name in "abc":
        book.start(name, name)
        book.record(name, [], [1])
    book.finish(["a", "b", "c"])
    assert book.take("a") is None
    assert book.take("b") is not None and book.take("c") is not None


def test_steps_per_trace_are_bounded():
    book = TraceBook(max_steps=3)
    book.start("a", "a")
    for _ in range(5):
        book.record("a", [1], [1, 2])
    trace = book.take("a")
    assert len(trace["steps"]) == 3 and trace["truncated"]


def test_cut_to_completion_shortens_the_last_step_and_drops_later_ones():
    steps = [step_record([], [1]), step_record([2, 3, 4], [2, 3, 4, 5]), step_record([6], [6, 7])]
    kept = cut_to_completion(steps, 3)
    assert [s["emitted"] for s in kept] == [[1], [2, 3]]
    assert kept[1]["cut"] and "cut" not in kept[0]
    assert cut_to_completion(steps, 7) == steps


def test_token_texts_concatenate_to_the_decoded_whole():
    pieces = {1: "Hel", 2: "lo", 3: " wor", 4: "ld"}

    def decode(ids):
        return "".join(pieces[i] for i in ids)

    assert token_texts(decode, [1, 2, 3, 4]) == ["Hel", "lo", " wor", "ld"]


def test_token_texts_decode_the_first_tokens_after_the_prompt():
    """A tokenizer that drops a text's leading space (SentencePiece does) spells the completion's first
    token with its space only after context: the prompt's last tokens."""
    pieces = {0: "def", 1: " add", 2: "(a"}

    def decode(ids):
        return "".join(pieces[i] for i in ids).lstrip(" ")

    assert token_texts(decode, [1, 2]) == ["add", "(a"]
    assert token_texts(decode, [1, 2], prefix=[0]) == [" add", "(a"]


def test_token_texts_with_a_split_multibyte_character():
    raw = {1: b"a", 2: "é".encode()[:1], 3: "é".encode()[1:], 4: b"b"}

    def decode(ids):
        return b"".join(raw[i] for i in ids).decode("utf-8", errors="replace")

    texts = token_texts(decode, [1, 2, 3, 4])
    assert texts == ["a", "", "é", "b"] and "".join(texts) == decode([1, 2, 3, 4])


def test_summary_figures_follow_the_seeds_formula():
    steps = [step_record([], [1]),  # the prompt's step
             step_record([1, 2, 3], [1, 2, 3, 4]),  # all accepted: bonus
             step_record([1, 2, 3], [1, 9]),  # one accepted, then recovered
             step_record([1, 2, 3], [7])]  # rejected at once
    s = summarize(steps, cost_ratio=10.0)
    assert (s["steps"], s["tokens"], s["drafted"], s["accepted"], s["recovered"], s["bonus"]) == (4, 8, 9, 4, 2, 2)
    assert s["tokens_per_step"] == pytest.approx(8 / 4)
    assert s["acceptance_rate"] == pytest.approx(4 / 9, abs=1e-4)
    alpha = 4 / 6  # accepted / (accepted + rejections): untested drafts after a rejection do not count
    assert s["alpha"] == pytest.approx(alpha, abs=1e-4)
    assert s["predicted_speedup"] == pytest.approx(speedup(alpha, 3, 10.0), abs=1e-3) and s["predicted_k"] == 3
    assert (s["optimal_k"], s["optimal_speedup"]) == (optimal_k(alpha, 10.0)[0], pytest.approx(optimal_k(alpha, 10.0)[1], abs=1e-3))
    without_costs = summarize(steps, cost_ratio=None)
    assert without_costs["predicted_speedup"] is None and without_costs["alpha"] == s["alpha"]


def test_trace_document_adds_texts_and_summary():
    trace = {"steps": [step_record([], [1]), step_record([2, 3], [2, 5])], "truncated": False, "k_max": 4,
             "cost_ratio": 8.0}
    doc = trace_document(trace, 3, lambda ids: "".join(f"<{i}>" for i in ids))
    assert doc["k_max"] == 4 and doc["summary"]["tokens"] == 3
    assert doc["steps"][1]["emitted_text"] == ["<2>", "<5>"] and doc["steps"][1]["drafted_text"] == ["<2>", "<3>"]


def test_the_command_line_starts_without_vllm_or_torch():
    """`specserve --help` (and every subcommand's parser) imports neither: they load when a command runs."""
    import json
    import subprocess
    import sys

    code = ("import sys, json; from specserve.cli import build_parser; build_parser(); "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []
