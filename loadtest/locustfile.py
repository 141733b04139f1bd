"""Load test of the speculative and the baseline model of the specserve application.

    locust -f loadtest/ --host http://127.0.0.1:8000                    # web UI
    locust -f loadtest/ --host http://127.0.0.1:8000 --headless -u 8 -t 60s SpeculativeUser
    locust -f loadtest/ ... BaselineUser                                # one class alone (--tags filters tasks, not users)
    locust -f loadtest/ ... --speculative-model M1 --baseline-model M2 --max-tokens 64 --temperature 0.7

The options (`loadtest/_options.py`): --max-tokens, --temperature, --ignore-eos, --speculative-model,
--baseline-model, --prompt-seed (the same prompts, user by user, in every run with the same seed: two
targets measured one after the other then differ by what they are, not by what they were asked; without
it each user draws at random). SPECSERVE_API_KEY in the environment is sent as the bearer key (an application
started with one answers 401 without it).

Each request streams a completion of a held-out prompt and reports, per target, custom entries that
Locust's percentiles and CSV files carry: `ttft` (time to first token), `tpot` (time per output token
after the first), `e2e` (end to end), all in ms, and `output_tokens` (a count in the response-time
column); the speculative target also reports `drafted_tokens` and `accepted_tokens`.
"""

import itertools
import os
import time

from locust import HttpUser, constant, events, tag, task

from loadtest import _options, auth_headers
from loadtest._stream import Sample, SampleWriter, prompt_rng, random_prompt, read_stream

events.init_command_line_parser.add_listener(_options.add_to)


_samples = SampleWriter(os.environ.get("SPECSERVE_SAMPLES_CSV"))
_user_numbers = itertools.count()  # in the order started: with --prompt-seed, the user's prompt sequence


def _report(target: str, sample: Sample, error) -> None:
    fire = events.request.fire
    for name, value in (("ttft", sample.ttft_s * 1e3), ("tpot", sample.tpot_s * 1e3), ("e2e", sample.e2e_s * 1e3),
                        ("output_tokens", sample.output_tokens)):
        fire(request_type=name, name=target, response_time=value, response_length=0, exception=error)
    if sample.drafted_tokens and not error:
        fire(request_type="drafted_tokens", name=target, response_time=sample.drafted_tokens, response_length=0)
        fire(request_type="accepted_tokens", name=target, response_time=sample.accepted_tokens, response_length=0)


class _CompletionUser(HttpUser):
    abstract = True
    wait_time = constant(0)  # closed loop: concurrency = number of users
    target = ""
    model_option = ""

    def on_start(self):
        self.number = next(_user_numbers)
        self.rng = prompt_rng(self.environment.parsed_options.prompt_seed, self.number)
        # `specserve loadtest` labels its comparison runs (another model id through the same class).
        self.target = os.environ.get("SPECSERVE_TARGET_LABEL") or self.target
        self.client.headers.update(auth_headers())

    def complete(self):
        opts = self.environment.parsed_options
        prompt = random_prompt(self.rng)
        body = {
            "model": getattr(opts, self.model_option),
            "prompt": prompt["prompt"],
            "max_tokens": opts.max_tokens,
            "temperature": opts.temperature,
            "ignore_eos": opts.ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        sample = Sample(target=self.target, category=prompt["category"], start=time.time(),
                        prompt_id=str(prompt["id"]), user=self.number)
        start = time.perf_counter()
        with self.client.post("/v1/completions", json=body, stream=True, catch_response=True,
                              name=f"{self.target} /v1/completions") as response:
            try:
                read_stream(response, sample, start)
            except Exception as exc:  # a broken stream is a failed request, not a crashed user
                sample.error = f"{type(exc).__name__}: {exc}"
            if sample.error:
                response.failure(sample.error)
            else:
                response.success()
        _samples.write(sample)
        _report(self.target, sample, RuntimeError(sample.error) if sample.error else None)


class SpeculativeUser(_CompletionUser):
    target = "speculative"
    model_option = "speculative_model"

    @tag("speculative")
    @task
    def completion(self):
        self.complete()


class BaselineUser(_CompletionUser):
    target = "baseline"
    model_option = "baseline_model"

    @tag("baseline")
    @task
    def completion(self):
        self.complete()
