"""Offline vLLM engines on the demo pair, for the tests and the benchmarks: the embedded default's engine
settings (`deployment.defaults`) with the speculator switched on or off."""

import inspect
from typing import Any

from deployment.defaults import DEMO_DRAFT, DEMO_ENGINE_KWARGS, DEMO_NUM_SPECULATIVE_TOKENS, DEMO_TARGET, cpu_engine_env
from plugin.config import speculative_engine_kwargs

# Every keyword option of speculative_engine_kwargs goes to it, never to vllm.LLM.
SPECULATIVE_OPTIONS = frozenset(
    name for name, p in inspect.signature(speculative_engine_kwargs).parameters.items() if p.kind is p.KEYWORD_ONLY)


def engine_kwargs(speculative: bool, num_speculative_tokens: int = DEMO_NUM_SPECULATIVE_TOKENS,
                  target: str = DEMO_TARGET, draft: str = DEMO_DRAFT, **overrides) -> dict[str, Any]:
    """vllm.LLM keyword arguments: the demo engine settings, the speculator when asked, then overrides.
    Overrides named like a `speculative_engine_kwargs` option (max_draft_rows, draft_dtype, ...) go there."""
    kwargs = {"model": str(target), **DEMO_ENGINE_KWARGS}
    spec_options = {k: overrides.pop(k) for k in list(overrides) if k in SPECULATIVE_OPTIONS}
    if speculative:
        kwargs |= speculative_engine_kwargs(draft, num_speculative_tokens, **spec_options)
    elif spec_options:
        raise ValueError(f"speculator options {sorted(spec_options)} given for a plain engine")
    return kwargs | overrides


def start_llm(**kwargs):
    """`vllm.LLM(**kwargs)`, its engine processes started, on CPU, with the environment the served engines
    get (`deployment.defaults.CPU_ENGINE_ENV`)."""
    import os

    from vllm import LLM
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return LLM(**kwargs)
    preload = os.environ.get("LD_PRELOAD")
    os.environ.update(cpu_engine_env())
    try:
        return LLM(**kwargs)  # its engine processes start here, with the environment above
    finally:  # what this process starts later (a browser, `serve run`) is not preloaded with the engine's libraries
        if preload is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = preload


def build_llm(speculative: bool, **kwargs):
    return start_llm(**engine_kwargs(speculative, **kwargs))


def shutdown_llm(llm) -> None:
    """Stop an `LLM`'s engine processes now rather than at interpreter exit."""
    import gc

    engine = getattr(llm, "llm_engine", None)
    if engine is not None and hasattr(engine, "shutdown"):
        engine.shutdown()
    del llm
    gc.collect()
