"""The prepared device check runs where it is kept: `scripts/gpu-check.sh --quick` on this CPU passes
and prints its three sections, so that it works the day a GPU is lent."""

import os
import subprocess
import sys

import pytest

from deployment.defaults import REPO_ROOT

pytestmark = pytest.mark.slow


def test_gpu_check_script_runs_and_passes_on_cpu(tmp_path):
    env = os.environ | {"PYTHON": sys.executable, "OUT": str(tmp_path)}
    result = subprocess.run([str(REPO_ROOT / "scripts" / "gpu-check.sh"), "--quick", "--device", "cpu"],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for heading in ("1. exactness", "2. verification step", "3. shipped draft"):
        assert heading in result.stdout
    assert result.stdout.strip().splitlines()[-1].startswith("PASS")
    assert (tmp_path / "gpu_check.json").stat().st_size > 0
