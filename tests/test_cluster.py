"""The README's cluster path on this machine, with Ray 2.60's token authentication: `ray start --head`,
`serve deploy serve_config.yaml`, /health 200, `serve shutdown`, `ray stop`, and no Ray or engine process
left behind. It needs Ray's and Serve's default ports, so it runs after the shared application stops."""

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from deployment.defaults import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.exclusive]
BIN = Path(sys.executable).parent
LEFTOVER_MARKERS = ("EngineCore", "ServeReplica", "ServeController", "raylet", "gcs_server")


def cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """A ray or serve command as the README gives it: RAY_AUTH_MODE=token in its environment."""
    env = os.environ | {"RAY_AUTH_MODE": "token"}
    return subprocess.run([str(BIN / argv[0]), *argv[1:]], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def processes_started_since(t0: float) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["name", "cmdline", "create_time"]):
        text = " ".join([proc.info["name"] or "", *(proc.info["cmdline"] or [])])
        if proc.info["create_time"] >= t0 and any(m in text for m in LEFTOVER_MARKERS):
            found.append(proc)
    return found


def wait_until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(2)
    pytest.fail(f"{what} not within {timeout_s} s")


def healthy() -> bool:
    try:
        return httpx.get("http://127.0.0.1:8000/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_cluster_path_deploys_serves_and_leaves_nothing(shared_app_stopped):
    t0 = time.time() - 1
    started = cli("ray", "start", "--head")
    assert started.returncode == 0, started.stderr[-3000:]
    try:
        deployed = cli("serve", "deploy", "serve_config.yaml")
        assert deployed.returncode == 0, deployed.stdout[-2000:] + deployed.stderr[-2000:]
        wait_until(healthy, 400, "/health 200")
        assert "RUNNING" in cli("serve", "status").stdout
        shutdown = cli("serve", "shutdown", "-y")
        assert shutdown.returncode == 0, shutdown.stderr[-2000:]
        # serve shutdown deletes applications asynchronously: wait until they are gone (engines included)
        # before ray stop, which would leave engine processes running.
        wait_until(lambda: "specserve" not in cli("serve", "status").stdout, 120, "the application's removal")
    finally:
        stopped = cli("ray", "stop")
    time.sleep(3)
    leftovers = processes_started_since(t0)
    described = [f"{p.pid} {p.info['name']} {' '.join(p.info['cmdline'] or [])[:100]}" for p in leftovers]
    for proc in leftovers:  # this test's own, by pid, so that a failure leaves the machine clean
        proc.kill()
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    assert not described, described
