"""Where the milliseconds of an engine step go: seconds per phase, summed over steps. Opt-in (the
speculator's `profile_steps` option), since on a GPU honest phase times need a device sync per phase.

The draft step's phases (the proposer times them), and two of the target's: its forward over the
step's tokens with the logits of the sampled positions, and sampling with verification (the rejection
sampler, or the plain sampler when nothing drafted), timed around the model runner's own calls
(`internals.profile_runner_phases`). What the step spends beyond these is the rest: the runner's input
preparation and bookkeeping, the engine's scheduling and output processing.

Beside it, always on, the step log: one small record per step (`StepLog`), from which the tooling
measures decode steps alone."""

import collections
import contextlib
import time

import torch

DRAFT_PHASES = ("follow_rows", "plan", "catch_up", "draft_forward", "sampling", "commit")
TARGET_PHASES = ("target_forward", "verify")
PHASES = TARGET_PHASES + DRAFT_PHASES
_OFF = contextlib.nullcontext()


def work_clock(device: torch.device):
    """The clock for the start-up calibration's timings: on a CPU the calling thread's CPU time, which
    other processes (another engine starting beside this one) do not inflate as they do the wall clock
    (a matmul took 246 ms quiet, 612 ms of wall time and 253 ms of CPU time beside four busy loops); on an
    accelerator the wall clock, around a device sync, since the host's CPU time says nothing there."""
    return time.thread_time if device.type == "cpu" else time.perf_counter


class StepProfile:
    def __init__(self, device: torch.device, enabled: bool):
        self.enabled = enabled
        self.sync = torch.cuda.synchronize if enabled and device.type == "cuda" else (lambda: None)
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def phase(self, name: str):
        return self._timed(name) if self.enabled else _OFF

    def timed(self, name: str, call):
        """call, with its time counted to phase name."""
        def run(*args, **kwargs):
            with self._timed(name):
                return call(*args, **kwargs)

        return run

    @contextlib.contextmanager
    def _timed(self, name: str):
        self.sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            self.seconds[name] += time.perf_counter() - start


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
