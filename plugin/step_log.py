"""The worker's step log: one small record per engine step, always on and bounded, and the arithmetic
the tooling does on it. No torch, no vLLM: the `specserve` command imports it before any engine."""

import collections

STEP_FIELDS = ("started", "requests", "tokens", "drafts", "longest", "emitted", "seconds", "draft_seconds")


class StepLog:
    """The engine's latest steps, one record each (STEP_FIELDS): when the step entered the worker, the
    requests, tokens and draft tokens scheduled, the longest draft, the tokens it emitted, the worker's
    seconds and the proposer's share of them. Always on and bounded (the oldest dropped past `size`):
    a record is one tuple per step. The tooling takes it (`SpeculativeWorker.specserve_take_step_log`)
    to see where a step's time goes and to judge K on decode steps alone (`decode_goodput`)."""

    def __init__(self, size: int = 4096):
        self.records: collections.deque = collections.deque(maxlen=size)

    def append(self, *fields) -> None:
        self.records.append(fields)

    def take(self) -> list[tuple]:
        records, self.records = list(self.records), collections.deque(maxlen=self.records.maxlen)
        return records


def decode_goodput(records: list, requests: int | None = None) -> dict:
    """Tokens per second over the decode steps of a step log (no prompt in the step), of this many
    requests if given, each step timed from its start to the next step's (the worker, the proposer and
    the engine's scheduling and output processing between them; the last record, with no next, is left
    out). A step with a prompt in it costs what the prompt costs whatever K, and in a closed loop (each
    finished request replaced at once) such steps took about half of the time at batch 16 here, enough
    to bury the difference between two K in noise; this leaves them out."""
    steps = seconds = tokens = drafts = 0
    for this, following in zip(records, records[1:]):
        started, n, scheduled, drafted, _, emitted = this[:6]
        if scheduled == n + drafted and (requests is None or n == requests):
            steps, seconds = steps + 1, seconds + following[0] - started
            tokens, drafts = tokens + emitted, drafts + drafted
    return {"steps": steps, "tokens_per_s": tokens / seconds if seconds > 0 else None,
            "step_ms": 1e3 * seconds / steps if steps else None, "draft_tokens_per_step": drafts / steps if steps else None}
