"""The API-key check, the back-pressure replies and the proxy middleware that shapes Serve's own, as
pure functions and a bare ASGI app (the served application is tested in test_deployment and
test_reliability)."""

import asyncio
import hashlib
import json

import pytest
from starlette.requests import Request

from ray.serve.exceptions import BackPressureError

from deployment.admission import (ApiKeyCheck, JsonBackPressureReplies, engine_restarting, key_digest,
                                  overloaded, read_api_key, within_queue_grace)


def request(path: str, authorization: str | None = None, root_path: str = "") -> Request:
    headers = [(b"authorization", authorization.encode("latin-1"))] if authorization is not None else []
    return Request({"type": "http", "method": "GET", "path": path, "root_path": root_path, "headers": headers,
                    "query_string": b""})


def test_key_from_the_environment_first_then_the_file(monkeypatch, tmp_path):
    secret = tmp_path / "key"
    secret.write_text("  sk-file \n")
    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    assert read_api_key() is None
    assert read_api_key(str(secret)) == "sk-file"
    monkeypatch.setenv("SPECSERVE_API_KEY", "sk-env")
    assert read_api_key(str(secret)) == "sk-env"
    monkeypatch.delenv("SPECSERVE_API_KEY")
    with pytest.raises(ValueError, match="does not exist"):
        read_api_key(str(tmp_path / "missing"))
    assert key_digest("sk-env") == hashlib.sha256(b"sk-env").hexdigest() and key_digest(None) is None


def test_check_guards_v1_only_and_only_when_a_key_is_set():
    check = ApiKeyCheck()
    assert check.allows(request("/v1/completions"))  # no key configured: open
    check.require(key_digest("sk-right"))
    assert check.allows(request("/v1/models", "Bearer sk-right"))
    assert check.allows(request("/v1/models", "bearer  sk-right "))
    assert check.allows(request("/health"))
    for auth in (None, "", "Bearer", "Bearer sk-wrong", "sk-right", "Basic sk-right"):
        assert not check.allows(request("/v1/models", auth)), auth
        assert not check.allows(request("/v1/specserve/stats", auth)), auth


def test_check_guards_v1_under_a_route_prefix_too():
    """Serve's proxy passes a route_prefix as the ASGI root_path and leaves it in the path; FastAPI routes
    `/specserve/v1/completions` to `/v1/completions`, so the key is asked there too."""
    check = ApiKeyCheck()
    check.require(key_digest("sk-right"))
    for root in ("/specserve", "/specserve/", "/a/b"):
        path = root.rstrip("/") + "/v1/completions"
        assert not check.allows(request(path, root_path=root)), root
        assert not check.allows(request(path, "Bearer sk-wrong", root_path=root)), root
        assert check.allows(request(path, "Bearer sk-right", root_path=root)), root
        assert check.allows(request(root.rstrip("/") + "/health", root_path=root)), root


def test_a_key_of_blanks_is_refused_not_an_error():
    """A header whose key strips to nothing (a no-break space, say) is a wrong key: 401, never a 500."""
    check = ApiKeyCheck()
    check.require(key_digest("sk-right"))
    for auth in ("Bearer \xa0", "Bearer  \t", "Bearer \xa0\xa0"):
        assert not check.allows(request("/v1/models", auth)), repr(auth)


def full_queue_for(calls: int):
    """A call that finds the queue full its first `calls` times, then answers; with the times it was made."""
    made = []

    async def call():
        made.append(asyncio.get_running_loop().time())
        if len(made) <= calls:
            raise BackPressureError(num_queued_requests=32, max_queued_requests=32, status_code=429, retry_after_s=2)
        return "response"
    return call, made


def test_a_queue_that_frees_within_the_grace_admits_the_request():
    """Serve counts simultaneous arrivals still being handed to a replica as queued: a request that
    finds the queue full is asked again (20, 40, 80 ms later) and gets its response once there is room."""
    call, made = full_queue_for(3)
    assert asyncio.run(within_queue_grace(call, grace_s=1.0)) == "response"
    gaps = [b - a for a, b in zip(made, made[1:])]
    assert len(gaps) == 3 and all(gap >= wait - 0.002 for gap, wait in zip(gaps, [0.02, 0.04, 0.08])), gaps


def test_a_queue_still_full_after_the_grace_pushes_back():
    call, made = full_queue_for(1000)
    with pytest.raises(BackPressureError):
        asyncio.run(within_queue_grace(call, grace_s=0.25))
    # at 0, 20, 60 and 140 ms (fewer on a busy machine); the next would come after the grace
    assert 3 <= len(made) <= 4 and made[-1] - made[0] < 0.25


def test_other_failures_are_not_asked_again():
    made = []

    async def call():
        made.append(1)
        raise RuntimeError("engine dead")
    with pytest.raises(RuntimeError):
        asyncio.run(within_queue_grace(call))
    assert made == [1]


def test_rejections_are_openai_errors_with_retry_after():
    reply = overloaded("m", 429, 1.2)
    body = json.loads(reply.body)
    assert reply.status_code == 429 and reply.headers["retry-after"] == "1"
    assert body["error"]["type"] == "rate_limit_error" and "m" in body["error"]["message"]
    assert overloaded("m", 503, None).headers["retry-after"] == "1"
    restarting = engine_restarting("m")
    assert restarting.status_code == 503 and int(restarting.headers["retry-after"]) > 0


def run_asgi(app, path="/v1/completions") -> tuple[dict, bytes]:
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app({"type": "http", "path": path, "headers": []}, receive, send))
    return sent[0], b"".join(m.get("body", b"") for m in sent[1:])


def plain_reply(status: int, text: bytes, content_type: bytes = b"text/plain; charset=utf-8"):
    async def app(scope, receive, send):
        headers = [(b"content-type", content_type), (b"content-length", str(len(text)).encode())]
        if status == 429:
            headers.append((b"retry-after", b"2"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": text})
    return app


def test_proxy_middleware_writes_serves_plain_text_back_pressure_as_json():
    start, body = run_asgi(JsonBackPressureReplies(plain_reply(429, b"Request dropped due to backpressure.")))
    headers = dict(start["headers"])
    assert start["status"] == 429 and headers[b"retry-after"] == b"2"
    assert headers[b"content-type"] == b"application/json" and int(headers[b"content-length"]) == len(body)
    assert json.loads(body)["error"]["message"] == "Request dropped due to backpressure."
    # Everything else passes untouched: JSON errors, successes.
    for status, text, kind in ((429, b'{"error": {}}', b"application/json"), (200, b"ok", b"text/plain")):
        start, body = run_asgi(JsonBackPressureReplies(plain_reply(status, text, kind)))
        assert start["status"] == status and body == text
