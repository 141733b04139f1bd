"""Shared engines: one plain and one speculative vLLM engine on the shipped demo pair, for the session."""

import pytest


@pytest.fixture(scope="session")
def plain_llm():
    from plugin.engines import build_llm, shutdown_llm

    llm = build_llm(speculative=False, seed=0)
    yield llm
    shutdown_llm(llm)


@pytest.fixture(scope="session")
def spec_llm():
    from plugin.engines import build_llm, shutdown_llm

    llm = build_llm(speculative=True, seed=0)
    yield llm
    shutdown_llm(llm)
