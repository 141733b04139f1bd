"""`specserve burst`: N simultaneous streams against the served application, all sent at once, and how
it pushed back: replies by status, when each status arrived (percentiles, seconds from the burst's
start), and how long the accepted streams took to finish. For sizing `max_ongoing_requests` and
`max_queued_requests`: the excess should get 429 with Retry-After at once, the accepted ones finish
within the clients' patience."""

import asyncio
import json
import time
from collections import Counter

import httpx

from deployment.defaults import SPECULATIVE_MODEL_ID
from loadtest import auth_headers, load_prompts
from loadtest._report import percentile
from specserve.serve_process import DEFAULT_URL


async def burst(url: str, n: int, body: dict, patience_s: float = 120) -> list[dict]:
    """n simultaneous streams of body: per reply its status, headers, text, and the seconds to its
    status line and to its end ('status' 0 with an 'error' when the client gave up or failed)."""
    async def one(client, start):
        reply = {"status": 0, "headers": {}, "text": "", "status_s": None}
        try:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                reply |= {"status": response.status_code, "headers": dict(response.headers),
                          "status_s": time.monotonic() - start}
                reply["text"] = (await response.aread()).decode(errors="replace")
        except httpx.HTTPError as exc:
            reply["error"] = f"{type(exc).__name__}: {exc}"
        reply["end_s"] = time.monotonic() - start
        return reply

    limits = httpx.Limits(max_connections=n)
    async with httpx.AsyncClient(base_url=url, headers=auth_headers(), timeout=patience_s, limits=limits) as client:
        start = time.monotonic()
        return await asyncio.gather(*(one(client, start) for _ in range(n)))


def summary(replies: list[dict]) -> dict:
    by_status = Counter(r["status"] for r in replies)
    result = {"requests": len(replies), "by_status": dict(by_status)}
    for status in by_status:
        group = [r for r in replies if r["status"] == status]
        arrived = [r["status_s"] for r in group if r["status_s"] is not None]
        result[str(status)] = {"status_p50_s": percentile(arrived, 50), "status_p95_s": percentile(arrived, 95),
                               "status_max_s": max(arrived, default=0.0),
                               "end_max_s": max(r["end_s"] for r in group),
                               "retry_after": sorted({r["headers"].get("retry-after") for r in group} - {None})}
    return result


def main(args) -> int:
    prompt = load_prompts()[0]["prompt"]
    body = {"model": args.model, "prompt": prompt, "max_tokens": args.max_tokens, "ignore_eos": True, "stream": True}
    replies = asyncio.run(burst(args.host, args.requests, body, args.patience))
    result = summary(replies)
    print(json.dumps(result, indent=1))
    print(f"{args.requests} simultaneous {args.max_tokens}-token streams to {args.model}:")
    for status, count in sorted(result["by_status"].items()):
        s = result[str(status)]
        print(f"  {status}: {count} replies, status line after P50 {s['status_p50_s']:.2f} s / P95 "
              f"{s['status_p95_s']:.2f} s / max {s['status_max_s']:.2f} s, last one done at {s['end_max_s']:.1f} s"
              + (f", Retry-After {s['retry_after']}" if s["retry_after"] else ""))
    return 0


def add_arguments(p) -> None:
    p.add_argument("--host", default=DEFAULT_URL)
    p.add_argument("--model", default=SPECULATIVE_MODEL_ID)
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--patience", type=float, default=120, help="each client's timeout, seconds")
