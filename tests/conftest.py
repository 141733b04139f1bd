"""Shared engines: one plain and one speculative vLLM engine on the shipped demo pair (for the module that
uses them, so their memory is free afterwards), and the Serve application of serve_config.yaml (for the
session: the deployment and the load tests share it). Tests marked `exclusive` need the machine's Ray
and Serve ports to themselves: they run last, after the shared application has stopped."""

import pytest

_shared = {}


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.get_closest_marker("exclusive") is not None)  # stable: order kept otherwise


@pytest.fixture(scope="module")
def plain_llm():
    from specserve.engines import build_llm, shutdown_llm

    llm = build_llm(speculative=False, seed=0)
    yield llm
    shutdown_llm(llm)


@pytest.fixture(scope="module")
def spec_llm():
    """The speculator as shipped (adaptive K), admitting 32 requests a step with a draft row for each:
    at that load the policy still drafts for most of them (tests that need drafts check the share)."""
    from specserve.engines import build_llm, shutdown_llm

    llm = build_llm(speculative=True, seed=0, max_num_seqs=32, max_draft_rows=32)
    yield llm
    shutdown_llm(llm)


@pytest.fixture(scope="session")
def serve_app():
    """`serve run serve_config.yaml` itself, started once for the session (shared with the load tests).
    SPECSERVE_TEST_URL names one already running instead (while developing: it is not stopped after)."""
    import os

    from specserve.serve_process import ServeProcess

    if os.environ.get("SPECSERVE_TEST_URL"):
        yield os.environ["SPECSERVE_TEST_URL"]
        return

    server = _shared["serve"] = ServeProcess("serve_config.yaml")
    try:
        ready_s = server.wait_ready()
        print(f"serve run serve_config.yaml ready in {ready_s:.0f} s")
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def shared_app_stopped():
    """Stop the session's shared application, if one runs, so that a test can use Ray's and Serve's
    ports itself (such tests are marked `exclusive` and run after every other)."""
    server = _shared.pop("serve", None)
    if server is not None:
        server.stop()


@pytest.fixture(scope="session")
def output_dir():
    """Where tests leave what a person may want to look at (screenshots): $SPECSERVE_TEST_OUTPUT, or
    test-output/ in the repository."""
    import os
    from pathlib import Path

    from deployment.defaults import REPO_ROOT

    path = Path(os.environ.get("SPECSERVE_TEST_OUTPUT") or REPO_ROOT / "test-output")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def browser():
    """Headless Chromium (Debian's package, which ./scripts/setup.sh installs) driven by Playwright, for
    one test: Playwright's sync API runs an event loop in this thread while it is open, which would
    stop later tests from calling asyncio.run."""
    import shutil

    from playwright.sync_api import sync_playwright

    executable = shutil.which("chromium") or shutil.which("chromium-browser")
    assert executable, "no Chromium on PATH: ./scripts/setup.sh installs Debian's chromium package"
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        yield chromium
        chromium.close()
