"""The layering: what vLLM loads imports nothing of the serving or tooling code; the load test talks
HTTP only; private Ray and vLLM internals sit behind a version check."""

import json
import subprocess
import sys

import pytest

from deployment.defaults import REPO_ROOT


def modules_loaded_by(*imports: str) -> set[str]:
    """Top-level project packages (and their modules) a fresh interpreter holds after the imports."""
    code = "; ".join(f"import {m}" for m in imports) + "; import sys, json; print(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    return {m for m in loaded if m.split(".")[0] in ("plugin", "deployment", "loadtest", "specserve")}


def test_engine_plugin_loads_no_serving_or_tooling_module():
    engine = ("plugin.proposer", "plugin.worker", "plugin.vllm_rejection_sampler", "plugin.engine_plugin")
    loaded = modules_loaded_by(*engine)
    assert set(engine) <= loaded
    assert not {m for m in loaded if not m.startswith("plugin")}, loaded


def test_load_test_loads_no_plugin_or_tooling_module():
    """The locustfile talks HTTP: of the project it reads only the defaults' model ids."""
    loaded = modules_loaded_by("loadtest.locustfile", "loadtest._report")
    assert {m for m in loaded if not m.startswith("loadtest")} == {"deployment", "deployment.defaults"}, loaded


def test_untested_vllm_is_refused_with_a_clear_message(monkeypatch):
    from plugin._vllm_internals import check_vllm_version

    monkeypatch.delenv("SPECSERVE_ALLOW_UNTESTED_VLLM", raising=False)
    check_vllm_version("0.32.0")
    with pytest.raises(RuntimeError, match=r"tested with vLLM 0\.32\.x .* this is vLLM 0\.33\.1"):
        check_vllm_version("0.33.1")
    monkeypatch.setenv("SPECSERVE_ALLOW_UNTESTED_VLLM", "1")
    check_vllm_version("0.33.1")  # the operator's explicit opt-in: a warning only


def test_untested_ray_is_refused_with_a_clear_message(monkeypatch):
    from deployment._ray_internals import check_ray_version

    monkeypatch.delenv("SPECSERVE_ALLOW_UNTESTED_RAY", raising=False)
    check_ray_version("2.60.0")
    with pytest.raises(RuntimeError, match=r"tested with Ray 2\.60\.0 .* this is Ray 2\.61\.0"):
        check_ray_version("2.61.0")


def test_engine_start_fails_on_an_untested_vllm():
    """The check runs when vLLM's worker process imports the plugin: a fresh interpreter that sees
    another vLLM version fails to import the worker with the message."""
    code = "import vllm; vllm.__version__ = '0.99.0'; import plugin.worker"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=180,
                            env={k: v for k, v in __import__("os").environ.items() if k != "SPECSERVE_ALLOW_UNTESTED_VLLM"})
    assert result.returncode != 0 and "this is vLLM 0.99.0" in result.stderr
