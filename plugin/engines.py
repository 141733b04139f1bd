"""vLLM engines for the demo pair on this machine: the settings the tests, benchmarks and the
embedded serve config share (CPU-sized; a GPU needs none of the memory caps)."""

from typing import Any

from plugin.config import speculative_engine_kwargs
from plugin.paths import DEFAULT_DRAFT, DEFAULT_TARGET

# enforce_eager keeps start-up near 20 s on CPU. On CPU gpu_memory_utilization is the share of RAM an
# engine may use, model included: 0.1 leaves about 1.3 GB of KV cache (80k tokens) after the ~1 GB the
# engine needs; 0.04 left none on a 24 GiB machine.
DEMO_ENGINE_KWARGS: dict[str, Any] = {
    "enforce_eager": True,
    "gpu_memory_utilization": 0.1,
    "max_model_len": 1024,
    "disable_log_stats": False,
    # vLLM 0.32 on CPU crashes a seeded request whose prompt is prefilled in chunks
    # (gpu_model_runner._bookkeeping_sync calls Generator.set_offset, which CPU generators lack).
    "enable_chunked_prefill": False,
}


# Draft length for the demo pair: c = 16 and alpha = 0.78 put the optimum at k = 7 (specserve math);
# measured at batch 1, K = 6 gave 2.05x plain against 1.93x at K = 4 (specserve bench --k 6).
DEMO_NUM_SPECULATIVE_TOKENS = 6


def engine_kwargs(speculative: bool, num_speculative_tokens: int = DEMO_NUM_SPECULATIVE_TOKENS, target: str = DEFAULT_TARGET,
                  draft: str = DEFAULT_DRAFT, **overrides) -> dict[str, Any]:
    kwargs = {"model": str(target), **DEMO_ENGINE_KWARGS}
    if speculative:
        spec_options = {k: overrides.pop(k) for k in ("fault_injection_rate", "max_draft_rows", "max_draft_len")
                        if k in overrides}
        kwargs |= speculative_engine_kwargs(draft, num_speculative_tokens, **spec_options)
    return kwargs | overrides


def build_llm(speculative: bool, **kwargs):
    from vllm import LLM

    return LLM(**engine_kwargs(speculative, **kwargs))


def shutdown_llm(llm) -> None:
    """Stop an `LLM`'s engine processes now rather than at interpreter exit."""
    import gc

    engine = getattr(llm, "llm_engine", None)
    if engine is not None and hasattr(engine, "shutdown"):
        engine.shutdown()
    del llm
    gc.collect()
