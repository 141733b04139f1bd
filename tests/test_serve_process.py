"""`ServeProcess.wait_ready`: an application that never answers is stopped, not left running."""

import subprocess
import time

import pytest

from specserve.serve_process import ServeProcess


def stand_in(tmp_path):
    """A stand-in for `serve run` (a process that never serves, with a child of its own, in a session of
    its own as serve run is started) on a port nothing answers, and that child."""
    import psutil

    server = object.__new__(ServeProcess)
    server.url, server.stopped, server.log_path = "http://127.0.0.1:9", False, tmp_path / "serve.log"
    server.log_path.write_text("starting\n")
    server.proc = subprocess.Popen(["sh", "-c", "sleep 300 & wait"], start_new_session=True)
    deadline = time.monotonic() + 10
    while not (child := psutil.Process(server.proc.pid).children(recursive=True)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert child
    return server, child


def assert_stopped(server, child):
    import psutil

    assert server.proc.poll() is not None
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in child)


def test_an_application_that_is_not_ready_in_time_is_stopped(tmp_path):
    server, child = stand_in(tmp_path)
    with pytest.raises(TimeoutError, match="stopped"):
        server.wait_ready(timeout_s=1)
    assert_stopped(server, child)


def test_an_interrupted_wait_stops_the_application(tmp_path, monkeypatch):
    """Ctrl-C while the engines start (KeyboardInterrupt in the wait) stops serve run and its children:
    they are in a session of their own, which the terminal's SIGINT does not reach."""
    server, child = stand_in(tmp_path)

    def interrupted(url):
        raise KeyboardInterrupt
    monkeypatch.setattr("specserve.serve_process.is_ready", interrupted)
    with pytest.raises(KeyboardInterrupt):
        server.wait_ready(timeout_s=60)
    assert_stopped(server, child)
