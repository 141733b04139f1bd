"""The Llama-style draft's forward as one native call on CPU (`native_draft.cpp`), built with PyTorch's
C++ extension builder on first use and cached by it (`TORCH_EXTENSIONS_DIR`, by default
`~/.cache/torch_extensions`; `./scripts/setup.sh` builds it ahead, so an engine's start only loads it).

Why: on CPU a small draft is bound by per-operation overhead. The shipped draft's one-token forward
took 0.46 ms from Python and 0.13 from the native call at batch 1, 1.9 against 0.9 at batch 16 (here,
one thread). Inside an engine it is bound by memory too: the target's forward before it leaves the
draft's weights out of cache, so feeds of a few tokens multiply by bfloat16 copies (half the bytes),
and products of many rows (a prompt rebuilt, the LM head of a batch of 16) multiply in bfloat16
(`bfloat16_products`) where the processor does that faster than float32 (`bfloat16_gemm_pays`). The
engines running several at once build it once: the builder locks its directory.
"""

import sys
import time
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("native_draft.cpp")
_NAME = "specserve_native_draft"
_loaded: bool = False


def _flags() -> list[str]:
    flags = ["-O3", "-fopenmp-simd"]  # simd pragmas only: ATen's parallel_for brings the threads
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma"]
    return flags


def load() -> float:
    """Build (when the cache lacks it) and load the native forward once per process; the seconds that
    took. Raises when it cannot be built (no C++ compiler, say)."""
    global _loaded
    if _loaded:
        return 0.0
    from torch.utils.cpp_extension import load as build_and_load

    start = time.perf_counter()
    build_and_load(name=_NAME, sources=[str(SOURCE)], extra_cflags=_flags(), is_python_module=False,
                   verbose=False)
    _loaded = True
    return time.perf_counter() - start


BLOCK = 64  # the native products' output block (kBlock in native_draft.cpp)


def bfloat16_products(weights: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The two bfloat16 forms of the products' weights [m, k] the native forward multiplies by, or none at
    all when some weight is not exactly a bfloat16 value (a float32 checkpoint), where they would change
    the draft's weights:
    - copies for narrow feeds (`linear_bf16` in native_draft.cpp): transposed, [k, m rounded up to BLOCK],
      with float32 arithmetic, the same as float32's;
    - the weights as they are, for products of many rows, which multiply in bfloat16 (oneDNN; AMX where
      the processor has it). Rounding their inputs to bfloat16 moves the draft's logits at bfloat16's
      precision, as bfloat16 autocast would; q stays the distribution the draft's tokens are drawn from,
      so the verification stays exact."""
    if not all(torch.equal(w, w.to(torch.bfloat16).to(w.dtype)) for w in weights):
        return [], []
    copies = [torch.nn.functional.pad(w.t().to(torch.bfloat16), (0, -w.shape[0] % BLOCK)).contiguous()
              for w in weights]
    return copies, [w.to(torch.bfloat16).contiguous() for w in weights]


def bfloat16_gemm_pays(weight: torch.Tensor, rows: int = 16, repeats: int = 5) -> bool:
    """Whether `rows` rows multiply by weight [m, k] faster in bfloat16 (the native forward's wide products:
    inputs rounded, oneDNN) than in float32 on this processor, timed here on the thread's CPU clock (another
    engine starting beside this one does not inflate it), least of `repeats` each. Where the processor
    multiplies bfloat16 natively (AVX512-BF16, AMX) it does: 185 against 91 us for the shipped draft's LM
    head at 16 rows on one machine here. Where oneDNN emulates it (an AVX2-only AMD EPYC here) it took
    several times float32's: 2.2 against 0.40 ms for a [16, 512] x [512, 1024] product."""
    x = torch.randn(rows, weight.shape[1], dtype=torch.float32)
    w32, w16 = weight.float().contiguous(), weight.to(torch.bfloat16).contiguous()

    def least(product) -> float:
        product()  # the first call builds oneDNN's primitive
        times = []
        for _ in range(repeats):
            began = time.thread_time()
            product()
            times.append(time.thread_time() - began)
        return min(times)

    return least(lambda: torch.mm(x.to(torch.bfloat16), w16.t()).float()) < least(lambda: torch.mm(x, w32.t()))


def forward_op():
    """torch.ops' handle of the native forward (after `load`)."""
    return torch.ops.specserve_native.draft_forward


if __name__ == "__main__":  # `python -m plugin.native_draft`: build it ahead (scripts/setup.sh)
    try:
        print(f"specserve: native draft forward ready ({load():.1f} s)")
    except Exception as exc:  # noqa: BLE001 - a missing compiler is not an install failure: eager remains
        print(f"specserve: native draft forward not built ({type(exc).__name__}: {exc}); the draft runs "
              "eagerly", file=sys.stderr)
