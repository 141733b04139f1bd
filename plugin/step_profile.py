"""Where the milliseconds of an engine step go: seconds per phase, summed over steps. Opt-in (the
speculator's `profile_steps` option), since on a GPU honest phase times need a device sync per phase.

The draft step's phases (the proposer times them), and two of the target's: its forward over the
step's tokens with the logits of the sampled positions, and sampling with verification (the rejection
sampler, or the plain sampler when nothing drafted), timed around the model runner's own calls
(`internals.profile_runner_phases`). What the step spends beyond these is the rest: the runner's input
preparation and bookkeeping, the engine's scheduling and output processing."""

import contextlib
import time

import torch

DRAFT_PHASES = ("follow_rows", "plan", "rebuild", "catch_up", "draft_forward", "sampling", "commit")
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
