"""What needs CUDA: the sampling core's exactness on the device and the compiled (CUDA-graph) draft
decode against the eager one. Skipped without a GPU; `scripts/gpu-check.sh` runs the same checks with
timings, and `scripts/gpu-cluster-check.sh` the engine tests against a user's own pair."""

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_exact_sampling_on_cuda():
    from specserve.gpu_check import exactness

    result = exactness(torch.device("cuda"), 100_000)
    assert result["passed"], result


def test_compiled_draft_decode_matches_eager_on_cuda():
    from specserve.gpu_check import decode_times

    result = decode_times(torch.device("cuda"), [1, 3, 16], max_len=512, steps=10)
    assert result["compile_failed"] is None, result["compile_failed"]
    assert all(r["within_tolerance"] for r in result["rows"]), result["rows"]
