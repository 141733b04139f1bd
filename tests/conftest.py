"""Shared engines: one plain and one speculative vLLM engine on the shipped demo pair (for the module that
uses them, so their memory is free afterwards), and the Serve application of serve_config.yaml (for the
session: the deployment and the load tests share it)."""

import pytest


@pytest.fixture(scope="module")
def plain_llm():
    from plugin.engines import build_llm, shutdown_llm

    llm = build_llm(speculative=False, seed=0)
    yield llm
    shutdown_llm(llm)


@pytest.fixture(scope="module")
def spec_llm():
    from plugin.engines import build_llm, shutdown_llm

    llm = build_llm(speculative=True, seed=0)
    yield llm
    shutdown_llm(llm)


@pytest.fixture(scope="session")
def serve_app():
    """`serve run serve_config.yaml` itself, started once for the session (shared with the load tests)."""
    from deployment.launch import ServeProcess

    server = ServeProcess("serve_config.yaml")
    try:
        ready_s = server.wait_ready()
        print(f"serve run serve_config.yaml ready in {ready_s:.0f} s")
        yield server.url
    finally:
        server.stop()
