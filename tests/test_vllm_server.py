"""The README's command for vLLM's own OpenAI server with the plugin's flags, run as written (on its
own port) on this CPU build: it starts, and one completion is speculated."""

import os
import shlex
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from deployment.defaults import REPO_ROOT

pytestmark = pytest.mark.slow
PORT = 8011


def readme_command() -> list[str]:
    """The README's bash block that starts vllm.entrypoints.openai.api_server, as argv."""
    blocks = (REPO_ROOT / "README.md").read_text().split("```bash\n")[1:]
    block = next(b.split("```")[0] for b in blocks if "vllm.entrypoints.openai.api_server" in b)
    argv = shlex.split(block.replace("\\\n", " "), comments=True)
    assert argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"], argv
    return [sys.executable, *argv[1:]]


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    family = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    for child in family:  # the engine core process, should it outlive its server
        try:
            child.kill()
        except psutil.Error:
            pass


def test_readme_vllm_server_command_serves_speculatively(tmp_path):
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([*readme_command(), "--host", "127.0.0.1", "--port", str(PORT)], cwd=REPO_ROOT,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{PORT}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            pytest.fail("not ready in 300 s:\n" + (tmp_path / "server.log").read_text()[-3000:])
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "def add(a, b):\n", "max_tokens": 32, "temperature": 0, "ignore_eos": True}
        done = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        assert done["usage"]["completion_tokens"] == 32, done
        assert done["metrics"]["speculative_decoding"]["num_draft_tokens"] > 0, done
    finally:
        stop(proc)
        log.close()
