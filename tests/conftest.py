"""Shared engines: one plain and one speculative vLLM engine on the shipped demo pair, for the session."""

import gc

import pytest


def _shutdown(llm) -> None:
    engine = getattr(llm, "llm_engine", None)
    if engine is not None and hasattr(engine, "shutdown"):
        engine.shutdown()
    del llm
    gc.collect()


@pytest.fixture(scope="session")
def plain_llm():
    from plugin.engines import build_llm

    llm = build_llm(speculative=False, seed=0)
    yield llm
    _shutdown(llm)


@pytest.fixture(scope="session")
def spec_llm():
    from plugin.engines import build_llm

    llm = build_llm(speculative=True, seed=0)
    yield llm
    _shutdown(llm)


@pytest.fixture(scope="session")
def shutdown_engine():
    return _shutdown
