"""The API-key check, the back-pressure replies and the proxy middleware that shapes Serve's own, as
pure functions and a bare ASGI app (the served application is tested in test_deployment and
test_reliability)."""

import asyncio
import hashlib
import json

import pytest
from starlette.requests import Request

from deployment.admission import (ApiKeyCheck, JsonBackPressureReplies, engine_restarting, key_digest,
                                  overloaded, read_api_key)


def request(path: str, authorization: str | None = None) -> Request:
    headers = [(b"authorization", authorization.encode())] if authorization is not None else []
    return Request({"type": "http", "method": "GET", "path": path, "headers": headers, "query_string": b""})


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
