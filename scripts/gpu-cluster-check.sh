#!/usr/bin/env bash
# Before rollout, on one GPU node of your cluster with your model hub: prove the speculator on your own
# pair and measure it. Greedy text equal to plain vLLM's and the temperature-1 distribution test in the
# engine (tests/test_engine.py), the CUDA checks (tests/test_gpu.py), then `specserve bench` of plain
# vLLM, this plugin and vLLM's own draft_model at batch 1, 4 and 16, with the step's profile (target, verification, each draft phase).
#
#   TARGET=Qwen/Qwen2.5-7B-Instruct DRAFT=Qwen/Qwen2.5-0.5B-Instruct ./scripts/gpu-cluster-check.sh
#
# Two engines share the GPU during the engine tests: SPECSERVE_ENGINE_KWARGS (JSON) sizes them.
set -euo pipefail
cd "$(dirname "$0")/.."
export SPECSERVE_BUILD=gpu SPECSERVE_TARGET="${TARGET:?set TARGET to the target model}" SPECSERVE_DRAFT="${DRAFT:?set DRAFT to the draft model}"
export SPECSERVE_ENGINE_KWARGS="${SPECSERVE_ENGINE_KWARGS:-{\"gpu_memory_utilization\": 0.4, \"kv_cache_memory_bytes\": null, \"dtype\": \"auto\", \"enforce_eager\": false, \"max_model_len\": 2048, \"enable_chunked_prefill\": true}}"
./scripts/setup.sh
mkdir -p out
.venv/bin/python -m pytest tests/test_gpu.py tests/test_engine.py -k "gpu or cuda or greedy_text or sampling_distribution" -ra
.venv/bin/specserve bench --configs plain,specserve,vllm-draft_model --batch-sizes 1,4,16 --temperatures 0,0.7 \
  --k "${K:-4}" --profile --json out/gpu-bench.json
