"""Who gets in, and when: the API key on every `/v1` route, and the OpenAI-shaped reply that pushes back
when a model's queue is full.

The key. `SPECSERVE_API_KEY` in the environment of the process that builds the application (that of
`serve run`, or of the Ray cluster for `serve deploy`), or `api_key_file` in the application's args, a
file on that node holding the key. The builder passes the key's SHA-256 digest, never the key, to the
ingress replicas as a deployment argument, so no deployment config, dashboard or log holds it. Clients
send `Authorization: Bearer <key>` (the `openai` client's `api_key`); `/health` stays open for load
balancers and probes.

Back-pressure. Each model deployment bounds the requests its replicas run (`max_ongoing_requests`)
and those waiting for a replica (`max_queued_requests`, counted at the ingress, which is the caller).
Beyond them Ray Serve raises `BackPressureError`, carrying the status and `Retry-After` of the
deployment's `backpressure_config`; the ingress answers with them in an OpenAI-style error body
instead of Serve's plain-text reply. Serve counts a request as queued from its arrival until a replica
has taken it, so when many arrive together the ones still being handed to the replica fill the queue
and Serve rejects more than its bounds say (its router's own comment admits it): 8 of 64 simultaneous
streams to a model bounded at 32 running and 32 queued were rejected on an idle application. So the
ingress asks again for up to QUEUE_FULL_GRACE_S (`within_queue_grace`) and pushes back only a request
that still finds the queue full.
"""

import asyncio
import hashlib
import json
import hmac
import os
from pathlib import Path
from typing import Awaitable, Callable, Optional, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from ray.serve.exceptions import BackPressureError

API_KEY_ENV = "SPECSERVE_API_KEY"
PROTECTED_PREFIX = "/v1"


def read_api_key(api_key_file: Optional[str] = None) -> Optional[str]:
    """The key from SPECSERVE_API_KEY, else from api_key_file; None when neither gives one."""
    key = os.environ.get(API_KEY_ENV, "").strip()
    if not key and api_key_file:
        path = Path(api_key_file).expanduser()
        if not path.is_file():
            raise ValueError(f"api_key_file {api_key_file} does not exist on this node")
        key = path.read_text().strip()
    return key or None


def key_digest(key: Optional[str]) -> Optional[str]:
    return hashlib.sha256(key.encode()).hexdigest() if key else None


def openai_error(status: int, message: str, type_: str, code: str, headers: Optional[dict] = None) -> JSONResponse:
    """An error body as OpenAI's API writes it."""
    return JSONResponse({"error": {"message": message, "type": type_, "param": None, "code": code}},
                        status_code=status, headers=headers)


def route_path(request: Request) -> str:
    """The path the application routes on: the request's path less the root path it is served under.
    Serve's proxy passes a `route_prefix` other than "/" (and `http_options.root_path`) as the ASGI
    root_path and leaves it in the path, where FastAPI strips it before matching a route; so
    `/specserve/v1/completions` reaches the `/v1` routes and must be checked as `/v1/completions`."""
    path, root = request.scope.get("path", ""), request.scope.get("root_path", "").rstrip("/")
    return path[len(root):] if root and (path == root or path.startswith(root + "/")) else path


class ApiKeyCheck:
    """The check itself: the ingress replica sets the digest once (`require`); the HTTP middleware
    consults it on every request."""

    def __init__(self):
        self.digest: Optional[str] = None

    def require(self, digest: Optional[str]) -> None:
        self.digest = digest

    def allows(self, request: Request) -> bool:
        if self.digest is None or not route_path(request).startswith(PROTECTED_PREFIX):
            return True
        scheme, _, presented = request.headers.get("authorization", "").partition(" ")
        presented_digest = key_digest(presented.strip())
        if scheme.lower() != "bearer" or presented_digest is None:
            return False
        return hmac.compare_digest(presented_digest, self.digest)

    async def __call__(self, request: Request, call_next):
        if self.allows(request):
            return await call_next(request)
        return openai_error(401, "Missing or incorrect API key: send 'Authorization: Bearer <key>'.",
                            "invalid_request_error", "invalid_api_key")


# One ingress runs per replica process, so one check per process serves. The middleware is a module
# function so that the app pickled into the replica refers to this module's check, which the replica's
# ingress sets, rather than carrying a copy of it.
api_key_check = ApiKeyCheck()


async def check_api_key(request: Request, call_next):
    return await api_key_check(request, call_next)


QUEUE_FULL_GRACE_S = 1.0
FIRST_RETRY_S = 0.02

T = TypeVar("T")


async def within_queue_grace(call: Callable[[], Awaitable[T]], grace_s: float = QUEUE_FULL_GRACE_S) -> T:
    """call(), made again after 20, 40, 80, ... ms while it finds the queue full, for up to grace_s;
    then Serve's BackPressureError is raised. Calling again is safe: Serve rejects a request before it
    reaches a replica."""
    loop = asyncio.get_running_loop()
    deadline, wait_s = loop.time() + grace_s, FIRST_RETRY_S
    while True:
        try:
            return await call()
        except BackPressureError:
            if loop.time() + wait_s > deadline:
                raise
        await asyncio.sleep(wait_s)
        wait_s *= 2


def overloaded(model: str, status: int, retry_after_s: Optional[float]) -> JSONResponse:
    """The reply to a request that found its model's queue full (Serve's BackPressureError)."""
    retry = max(1, round(retry_after_s)) if retry_after_s else 1
    return openai_error(status, f"Model {model} is at capacity: every replica is busy and its queue is full. "
                                f"Retry after {retry} s.", "rate_limit_error", "overloaded",
                        headers={"Retry-After": str(retry)})


class JsonBackPressureReplies:
    """ASGI middleware for Ray Serve's HTTP proxy, which rejects requests beyond the ingress's own
    `max_queued_requests` before any application code runs, with a plain-text 429/503: this rewrites
    such replies as OpenAI-style JSON, keeping their status and Retry-After. The proxy loads it when
    RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=deployment.admission:proxy_middlewares is in its
    environment (scripts/serve.sh and the tooling set it); without it the replies stay plain text."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        held = None

        async def send_shaped(message):
            nonlocal held
            if message["type"] == "http.response.start" and message["status"] in (429, 503) and \
                    dict(message.get("headers") or []).get(b"content-type", b"").startswith(b"text/plain"):
                held = message  # Serve sends such a reply as one start and one body message
                return
            if held is not None and message["type"] == "http.response.body":
                text = message.get("body", b"").decode(errors="replace")
                body = json.dumps({"error": {"message": text, "type": "rate_limit_error" if held["status"] == 429
                                             else "service_unavailable", "param": None, "code": "overloaded"}}).encode()
                headers = [(k, v) for k, v in held.get("headers") or [] if k.lower() not in (b"content-type", b"content-length")]
                headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
                await send({**held, "headers": headers})
                held = None
                return await send({"type": "http.response.body", "body": body})
            await send(message)

        await self.app(scope, receive, send_shaped)


PROXY_CALLBACK_ENV = {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "deployment.admission:proxy_middlewares"}


def proxy_middlewares() -> list:
    from starlette.middleware import Middleware

    return [Middleware(JsonBackPressureReplies)]


ENGINE_RESTART_RETRY_S = 10


def engine_restarting(model: str) -> JSONResponse:
    """The reply to a request that reached a replica whose engine died: Serve's health check replaces
    the replica, and the model serves again once a new engine has started."""
    return openai_error(503, f"Model {model} is restarting its engine; retry after {ENGINE_RESTART_RETRY_S} s.",
                        "service_unavailable", "engine_restarting",
                        headers={"Retry-After": str(ENGINE_RESTART_RETRY_S)})
