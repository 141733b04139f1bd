"""Streaming completions over SSE, timed: what one load-test request measures. Not a locustfile
(the leading underscore keeps Locust from loading it)."""

import csv
import json
import os
import random
import threading
import time
from dataclasses import asdict, dataclass, field

from loadtest import load_prompts

_PROMPTS = None


def prompt_rng(seed: int | None, user_number: int) -> random.Random:
    """The prompt sequence of the user_number-th user: the same for every run given the same seed, so
    that targets measured one after another draw the same prompts (their acceptance differs by prompt
    more than 5%, and the comparison should not); unseeded when seed is None."""
    return random.Random() if seed is None else random.Random(f"{seed}:{user_number}")


def random_prompt(rng: random.Random) -> dict:
    global _PROMPTS
    if _PROMPTS is None:
        _PROMPTS = load_prompts()
    return rng.choice(_PROMPTS)


@dataclass
class Sample:
    target: str
    category: str
    start: float
    ttft_s: float = 0.0
    tpot_s: float = 0.0  # time per output token after the first
    e2e_s: float = 0.0
    output_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    ok: bool = False
    error: str = ""
    concurrency: int = field(default_factory=lambda: int(os.environ.get("SPECSERVE_CONCURRENCY", "0")))
    round: int = field(default_factory=lambda: int(os.environ.get("SPECSERVE_ROUND", "0")))  # `--rounds`
    prompt_id: str = ""
    user: int = 0  # the user's number in its Locust run, in the order started (its prompt sequence)


def read_stream(response, sample: Sample, start: float) -> None:
    """Fill sample from the SSE events of a streaming completion response, timed from start."""
    first = last = None
    usage, metrics = {}, {}
    if response.status_code != 200:
        sample.error = f"HTTP {response.status_code}: {response.text[:200]}"
        return
    for line in response.iter_lines():
        if not line or not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            sample.error = str(event["error"])[:200]
            return
        if event.get("choices") and event["choices"][0].get("text"):
            last = time.perf_counter()
            first = first or last
        usage = event.get("usage") or usage
        metrics = event.get("metrics") or metrics
    end = time.perf_counter()
    sample.output_tokens = int(usage.get("completion_tokens", 0))
    sample.e2e_s = end - start
    sample.ttft_s = (first or end) - start
    if sample.output_tokens > 1 and first is not None:
        sample.tpot_s = (last - first) / (sample.output_tokens - 1)
    spec = metrics.get("speculative_decoding") or {}
    sample.drafted_tokens = int(spec.get("num_draft_tokens", 0))
    sample.accepted_tokens = int(spec.get("num_accepted_draft_tokens", 0))
    sample.ok = sample.output_tokens > 0
    if not sample.ok:
        sample.error = "no tokens in the stream"


class SampleWriter:
    """Appends raw per-request samples to the CSV named by SPECSERVE_SAMPLES_CSV, if set."""

    def __init__(self, path: str | None):
        self.path = path
        self.lock = threading.Lock()

    def write(self, sample: Sample) -> None:
        if not self.path:
            return
        row = asdict(sample)
        with self.lock:
            new = not os.path.exists(self.path)
            with open(self.path, "a", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(row))
                if new:
                    writer.writeheader()
                writer.writerow(row)
