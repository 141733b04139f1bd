"""Where the milliseconds of a draft step go: seconds per phase, summed over steps. Opt-in (the
speculator's `profile_steps` option), since on a GPU honest phase times need a device sync per phase."""

import contextlib
import time

import torch

PHASES = ("follow_rows", "plan", "catch_up", "draft_forward", "sampling", "commit")
_OFF = contextlib.nullcontext()


class StepProfile:
    def __init__(self, device: torch.device, enabled: bool):
        self.enabled = enabled
        self.sync = torch.cuda.synchronize if enabled and device.type == "cuda" else (lambda: None)
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def phase(self, name: str):
        return self._timed(name) if self.enabled else _OFF

    @contextlib.contextmanager
    def _timed(self, name: str):
        self.sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            self.seconds[name] += time.perf_counter() - start
