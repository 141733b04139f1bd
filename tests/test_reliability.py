"""Faults, scaling and strangers, against an application of its own: configs/autoscaling.yaml (the
embedded default, 1 to 2 replicas per model) with a draft that fails on 30% of its steps, started with
an API key. It needs Ray's and Serve's ports, so it runs after the shared application has stopped
(`exclusive`). Each test bounds its own traffic; the whole module takes about 5 minutes."""

import asyncio
import csv
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from deployment.defaults import BASELINE_MODEL_ID as BASELINE
from deployment.defaults import REPO_ROOT
from deployment.defaults import SPECULATIVE_MODEL_ID as SPEC
from loadtest import load_prompts

pytestmark = [pytest.mark.slow, pytest.mark.exclusive]

KEY = "sk-specserve-test-4f1c9a"  # made up here, for this module's application only
AUTH = {"Authorization": f"Bearer {KEY}"}
FAULT_RATE = 0.3


@pytest.fixture(scope="module")
def app(shared_app_stopped, tmp_path_factory):
    from specserve.serve_process import ServeProcess

    config = yaml.safe_load((REPO_ROOT / "configs/autoscaling.yaml").read_text())
    config["applications"][0]["args"]["speculative_options"] = {"fault_injection_rate": FAULT_RATE}
    path = tmp_path_factory.mktemp("reliability") / "faulty-autoscaling.yaml"
    path.write_text(yaml.safe_dump(config))
    server = ServeProcess(str(path), path.with_name("serve.log"), env={"SPECSERVE_API_KEY": KEY})
    patch = pytest.MonkeyPatch()
    try:
        server.wait_ready()
        family = psutil.Process(server.proc.pid).children(recursive=True)
        # The tooling (Locust, specserve.soak) sends $SPECSERVE_API_KEY, as a user's shell would.
        patch.setenv("SPECSERVE_API_KEY", KEY)
        yield server
    finally:
        patch.undo()
        server.stop()
    # serve run and every process it started are gone (the engines included).
    assert not [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def get(app, path, **kwargs):
    return httpx.get(f"{app.url}{path}", headers=AUTH, timeout=60, **kwargs)


def complete(app, model, prompt, max_tokens=24, headers=AUTH):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{app.url}/v1/completions", json=body, headers=headers, timeout=120)


def locust(app, out: Path, seconds: int, users: int, *classes: str, max_tokens: int = 32) -> subprocess.Popen:
    """Headless Locust with the key in its environment (loadtest/locustfile.py sends it)."""
    cmd = [str(Path(sys.executable).with_name("locust")), "-f", str(REPO_ROOT / "loadtest"), "--headless",
           "--host", app.url, "-u", str(users), "-r", str(users), "-t", f"{seconds}s", "--stop-timeout", "90",
           "--csv", str(out), "--only-summary", "--max-tokens", str(max_tokens), *classes]
    return subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def locust_requests(out: Path) -> dict:
    """(requests, failures) per Locust request name, from its stats CSV."""
    with open(f"{out}_stats.csv") as f:
        return {r["Name"]: (int(r["Request Count"]), int(r["Failure Count"]))
                for r in csv.DictReader(f) if r["Type"] == "POST"}


def finish(process: subprocess.Popen, timeout: float = 240) -> None:
    _, err = process.communicate(timeout=timeout)
    assert process.returncode in (0, 1), err[-3000:]  # 1: some requests failed; the callers check which


def test_api_key_guards_every_v1_route_and_leaves_health_open(app):
    from openai import AuthenticationError, OpenAI

    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for method, path in (("GET", "/v1/models"), ("GET", "/v1/specserve/stats"), ("POST", "/v1/completions")):
            response = httpx.request(method, f"{app.url}{path}", headers=headers, timeout=30,
                                     json={"model": SPEC, "prompt": "x", "max_tokens": 1})
            assert response.status_code == 401, (path, headers, response.text[:200])
            assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{app.url}/health", timeout=30).status_code == 200
    assert complete(app, SPEC, "import os\n").status_code == 200

    with pytest.raises(AuthenticationError):
        OpenAI(base_url=f"{app.url}/v1", api_key="wrong", max_retries=0).models.list()
    models = OpenAI(base_url=f"{app.url}/v1", api_key=KEY, max_retries=0).models.list()
    assert {m.id for m in models.data} == {SPEC, BASELINE}

    # The key is in no log: serve run's, nor any file of the Ray session it started.
    logs = [app.log_path, *Path("/tmp/ray/session_latest/logs").rglob("*")]
    assert not [p for p in logs if p.is_file() and KEY.encode() in p.read_bytes()]


def test_playground_asks_for_the_key_and_keeps_it_in_the_browser(app, browser):
    page = browser.new_page()
    page.goto(f"{app.url}/playground")
    page.wait_for_selector("body[data-ready=true]")
    assert page.is_visible("#key-box")  # the application has a key, so the page asks for it

    def race() -> str:
        page.fill("#max-tokens", "8")
        page.click("#race")
        page.wait_for_selector("body[data-race=done], body[data-race=failed]", timeout=120_000)
        return page.get_attribute("body", "data-race")

    assert race() == "failed" and "401" in page.inner_text("#error")
    page.fill("#api-key", KEY)
    page.click("#save-key")
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    assert page.evaluate("() => localStorage.getItem('specserve-api-key')") == KEY
    assert race() == "done", page.inner_text("#error")
    page.close()


def test_fault_injected_draft_serves_a_locust_run_without_failures_and_stays_exact(app, tmp_path):
    before = get(app, "/v1/specserve/stats").json()[SPEC]["failures"]
    run = locust(app, tmp_path / "faults", 20, 4, "SpeculativeUser")
    finish(run)
    requests, failures = locust_requests(tmp_path / "faults")["speculative /v1/completions"]
    assert requests > 0 and failures == 0
    stats = get(app, "/v1/specserve/stats").json()[SPEC]
    assert stats["failures"] - before > 0, "no draft fault was injected"
    assert 0 < stats["steps_drafted"]
    for prompt in load_prompts(category="function_body")[:3]:
        texts = [complete(app, model, prompt["prompt"], 48).json()["choices"][0]["text"] for model in (SPEC, BASELINE)]
        assert texts[0] == texts[1]


def wait_settled(app, timeout_s: float = 180) -> None:
    """Until the speculative model runs exactly one replica, none starting or stopping: the load of an
    earlier test may have scaled it out (configs/autoscaling.yaml), and a replica still starting or
    stopping would share the cores with what a test measures."""
    deadline = time.monotonic() + timeout_s
    while (replicas := get(app, "/v1/specserve/replicas").json()[SPEC]) != {"RUNNING": 1}:
        assert time.monotonic() < deadline, replicas
        time.sleep(2)


def test_engine_death_under_load_is_recovered_without_disturbing_the_baseline(app, tmp_path):
    from specserve.soak import engine_processes, kill_engine, recovery_timeline

    wait_settled(app)
    run = locust(app, tmp_path / "death", 100, 2, "SpeculativeUser", "BaselineUser")
    time.sleep(15)
    (old,) = engine_processes(SPEC)
    t0 = time.monotonic()
    kill_engine(SPEC)
    while (health := httpx.get(f"{app.url}/health", timeout=30)).status_code == 200 and time.monotonic() - t0 < 10:
        time.sleep(0.5)
    # An OpenAI-style 503 naming the model, returned rather than raised: a raised one is logged as an ERROR
    # with its traceback at every probe (a hundred here while the engine is replaced).
    assert health.status_code == 503 and SPEC in health.json()["error"]["message"], health.text
    timeline = asyncio.run(recovery_timeline(app.url, SPEC, t0, timeout_s=240))
    print("recovery timeline (s after the kill):", timeline)
    assert timeline["health_failed_at_s"] < 10 and timeline["recovered_at_s"] is not None
    assert "is not healthy" not in app.log_path.read_text(errors="replace")
    assert not old.is_running()
    # One engine per running replica: the requests queued behind the outage may have scaled the model
    # out (configs/autoscaling.yaml allows two), so the count follows the replicas rather than being 1.
    deadline = time.monotonic() + 120
    while True:
        replicas, engines = get(app, "/v1/specserve/replicas").json()[SPEC], engine_processes(SPEC)
        if replicas.keys() == {"RUNNING"} and len(engines) == replicas["RUNNING"]:
            break
        assert time.monotonic() < deadline, (replicas, engines)
        time.sleep(2)
    for i in range(3):  # started after recovery: all succeed
        assert complete(app, SPEC, f"def f{i}(x):\n").status_code == 200
    finish(run)
    results = locust_requests(tmp_path / "death")
    assert results["baseline /v1/completions"][0] > 0 and results["baseline /v1/completions"][1] == 0, results
    assert get(app, "/v1/specserve/unfinished_requests").json() == {SPEC: 0, BASELINE: 0}


def test_scale_out_under_load_and_back_in_without_failures(app, tmp_path):
    def running():
        return get(app, "/v1/specserve/replicas").json()[SPEC].get("RUNNING", 0)

    wait_settled(app)  # after the engine-death test: its replacement replica, maybe an upscale
    # A replica starts in 30-60 s here, slower under load (on a slower machine the second one was up 152 s
    # into the load): the load lasts long enough for that.
    run = locust(app, tmp_path / "scale", 240, 8, "SpeculativeUser")
    deadline = time.monotonic() + 240
    while running() < 2:
        assert time.monotonic() < deadline, "no second speculative replica under load"
        time.sleep(2)
    # Each replica's engine counters, as `specserve loadtest` sums them: both replicas answer.
    replicas = get(app, "/v1/specserve/stats", params={"model": SPEC, "every_replica": "true"}).json()[SPEC]
    assert len(replicas) == 2 and all(r["enabled"] and r["replica"] == tag for tag, r in replicas.items()), replicas
    # The drain check asks both replicas too (their requests summed in the plain form).
    unfinished = get(app, "/v1/specserve/unfinished_requests", params={"every_replica": "true"}).json()[SPEC]
    assert unfinished.keys() == replicas.keys() and all(n >= 0 for n in unfinished.values()), unfinished
    finish(run, timeout=360)  # the rest of the 240 s load and Locust's stop
    deadline = time.monotonic() + 120
    while running() > 1:
        assert time.monotonic() < deadline, "the second replica was not removed after the load"
        time.sleep(2)
    requests, failures = locust_requests(tmp_path / "scale")["speculative /v1/completions"]
    assert requests > 0 and failures == 0
