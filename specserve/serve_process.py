"""Start and stop `serve run <config>` as a child process: for the test suite and `specserve loadtest`;
and the tools' reads of the served application's own routes."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from deployment.admission import PROXY_CALLBACK_ENV
from deployment.defaults import REPO_ROOT
from loadtest import auth_headers

DEFAULT_URL = "http://127.0.0.1:8000"


def served_stats(url: str, timeout_s: float = 60, **params) -> dict:
    """/v1/specserve/stats of the application at url, with the API key when one is set: each model's
    speculator counters and memory ({model: stats}; with every_replica="true", {model: {tag: stats}};
    model=<id> asks that model alone)."""
    return httpx.get(f"{url}/v1/specserve/stats", params=params, headers=auth_headers(),
                     timeout=timeout_s).raise_for_status().json()


def is_ready(url: str = DEFAULT_URL) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200  # open without the API key
    except httpx.HTTPError:
        return False


class ServeProcess:
    def __init__(self, config: str = "serve_config.yaml", log_path: Path | None = None, url: str = DEFAULT_URL,
                 env: dict | None = None):
        """env: more environment variables for serve run (and so for its Ray cluster), e.g. the API key."""
        self.url = url
        self.stopped = False
        self.log_path = Path(log_path or REPO_ROOT / "out" / "serve.log")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        bin_dir = Path(sys.executable).parent
        self.serve = bin_dir / "serve"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([str(self.serve), "run", config], cwd=REPO_ROOT, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         env=os.environ | PROXY_CALLBACK_ENV | (env or {}))

    def wait_ready(self, timeout_s: float = 400) -> float:
        """Seconds until the application answers /health. One that does not within timeout_s is stopped
        before the error is raised, and so is one whose wait is interrupted (Ctrl-C: serve run is in a
        session of its own, so the terminal's SIGINT never reaches it): its engines would otherwise outlive
        the caller (a load test that gave up on five engines starting on two cores left all of them running)."""
        start = time.monotonic()
        try:
            while time.monotonic() - start < timeout_s:
                if self.proc.poll() is not None:  # serve run is gone; its Ray cluster and engines may not be
                    raise RuntimeError(f"serve run exited with {self.proc.returncode}:\n{self.log_tail()}")
                if is_ready(self.url):
                    return time.monotonic() - start
                time.sleep(1)
            raise TimeoutError(f"not ready after {timeout_s} s (stopped):\n{self.log_tail()}")
        except BaseException:
            self.stop()
            raise

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        """Stop serve run, its Ray cluster and the vLLM engine processes under it, by pid: each process
        it started and nothing else (`ray stop` would end every Ray instance on the machine, and still
        leaves the engines that replicas spawned running). A second call does nothing."""
        import psutil

        if self.stopped:
            return
        self.stopped = True

        try:
            family = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            family = []
        if self.proc.poll() is None:
            # SIGTERM: serve run shuts its application down on it; started without a terminal it ignores SIGINT.
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        for process in family:
            try:
                process.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(family, timeout=10)
