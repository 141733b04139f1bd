"""The step log's arithmetic: decode goodput over the steps with no prompt in them."""

import pytest

from plugin.step_log import StepLog, decode_goodput


def step(started, requests, tokens, drafts, emitted):
    return (started, requests, tokens, drafts, drafts and 2, emitted, 0.01, 0.002)


def test_decode_goodput_times_each_decode_step_to_the_next_steps_start_and_skips_prompt_steps():
    records = [step(0.00, 2, 6, 4, 5),    # decode: 2 requests, 4 drafts; 5 tokens in 0.04 s
               step(0.04, 3, 106, 4, 6),  # a prompt of 100 tokens joins: left out
               step(0.30, 3, 9, 6, 9),    # decode, 3 requests: 9 tokens in 0.06 s
               step(0.36, 3, 3, 0, 3)]    # the last record: no next start, left out
    every = decode_goodput(records)
    assert every["steps"] == 2 and every["tokens_per_s"] == pytest.approx(14 / 0.10)
    assert every["step_ms"] == pytest.approx(50.0) and every["draft_tokens_per_step"] == pytest.approx(5.0)
    full = decode_goodput(records, requests=3)
    assert full["steps"] == 1 and full["tokens_per_s"] == pytest.approx(9 / 0.06)
    assert decode_goodput(records[:1]) == {"steps": 0, "tokens_per_s": None, "step_ms": None, "draft_tokens_per_step": None}


def test_the_step_log_is_bounded_and_taking_it_empties_it():
    log = StepLog(size=3)
    for i in range(5):
        log.append(*step(float(i), 1, 1, 0, 1))
    taken = log.take()
    assert [r[0] for r in taken] == [2.0, 3.0, 4.0] and log.take() == []
