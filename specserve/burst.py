"""`specserve burst`: N simultaneous streams against the served application, all sent at once, and how
it pushed back: replies by status, when each status arrived (percentiles, seconds from the burst's
start), and how long the accepted streams took to finish. For sizing `max_ongoing_requests` and
`max_queued_requests`: the excess should get 429 with Retry-After within about a second (at once from
Serve's proxy, after the ingress's grace from a model: `deployment.admission.within_queue_grace`), and
the accepted ones finish within the clients' patience.

One Python client holding hundreds of connections on a busy machine is slow to read its own replies, so
the burst's timings say as much about the client as about the server. A probe in a process of its own
(one connection, one short request every half second while the burst runs) measures how fast the
server itself answers during the burst."""

import asyncio
import json
import multiprocessing
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


def probe(url: str, body: dict, headers: dict, start_after_s: float, every_s: float, count: int, results) -> None:
    """Short requests on one connection, sequentially, after start_after_s: per reply its status, the
    seconds to it and its text (for `pushed_back_by`); put on the results queue."""
    with httpx.Client(base_url=url, headers=headers, timeout=120) as client:
        time.sleep(start_after_s)
        replies = []
        for _ in range(count):
            began = time.monotonic()
            try:
                reply = client.post("/v1/completions", json=body)
                replies.append({"status": reply.status_code, "seconds": time.monotonic() - began, "text": reply.text[:500]})
            except httpx.HTTPError as exc:
                replies.append({"status": 0, "seconds": time.monotonic() - began, "text": str(exc)})
            time.sleep(every_s)
    results.put(replies)


def probe_summary(replies: list[dict]) -> dict:
    result = {"requests": len(replies), "by_status": dict(Counter(r["status"] for r in replies))}
    for name, group in pushed_back_groups(replies).items():
        seconds = [r["seconds"] for r in group]
        result[name] = {"replies": len(seconds), "p50_s": percentile(seconds, 50), "max_s": max(seconds)}
    return result


def pushed_back_by(reply: dict) -> str:
    """Who answered a 429/503: the ingress (the model's queue was full, `deployment.admission.overloaded`)
    or Serve's HTTP proxy (the ingress's own queue was full), from the reply's message."""
    try:
        message = json.loads(reply["text"])["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = reply["text"]
    return "ingress" if "is at capacity" in message else "proxy"


def pushed_back_groups(replies: list[dict]) -> dict[str, list[dict]]:
    """The 429 and 503 replies by who answered: {"429 from the proxy": [...], "429 from the ingress": [...]}."""
    groups: dict[str, list[dict]] = {}
    for reply in replies:
        if reply["status"] in (429, 503):
            groups.setdefault(f"{reply['status']} from the {pushed_back_by(reply)}", []).append(reply)
    return groups


def summary(replies: list[dict]) -> dict:
    by_status = Counter(r["status"] for r in replies)
    result = {"requests": len(replies), "by_status": dict(by_status)}
    groups = {status: [r for r in replies if r["status"] == status] for status in by_status}
    groups |= pushed_back_groups(replies)
    for status, group in groups.items():
        arrived = [r["status_s"] for r in group if r["status_s"] is not None]
        result[str(status)] = {"replies": len(group), "status_p50_s": percentile(arrived, 50), "status_p95_s": percentile(arrived, 95),
                               "status_max_s": max(arrived, default=0.0),
                               "end_max_s": max(r["end_s"] for r in group),
                               "retry_after": sorted({r["headers"].get("retry-after") for r in group} - {None})}
    return result


def main(args) -> int:
    prompt = load_prompts()[0]["prompt"]
    body = {"model": args.model, "prompt": prompt, "max_tokens": args.max_tokens, "ignore_eos": True, "stream": True}
    spawn = multiprocessing.get_context("spawn")
    probes, prober = spawn.Queue(), None
    if args.probes:
        prober = spawn.Process(target=probe, args=(
            args.host, {"model": args.model, "prompt": prompt, "max_tokens": 4}, auth_headers(), 1.0, 0.5, args.probes, probes))
        prober.start()
    replies = asyncio.run(burst(args.host, args.requests, body, args.patience))
    result = summary(replies)
    result["probe"] = None
    if prober is not None:
        result["probe"] = probe_summary(probes.get(timeout=600))
        prober.join(timeout=60)
    print(json.dumps(result, indent=1))
    print(f"{args.requests} simultaneous {args.max_tokens}-token streams to {args.model}:")
    for status in [str(k) for k in sorted(result["by_status"])] + sorted(k for k in result if " from the " in k):
        s = result[status]
        print(f"  {status}: {s['replies']} replies, status line after P50 {s['status_p50_s']:.2f} s / P95 "
              f"{s['status_p95_s']:.2f} s / max {s['status_max_s']:.2f} s, last one done at {s['end_max_s']:.1f} s"
              + (f", Retry-After {s['retry_after']}" if s["retry_after"] else ""))
    if result["probe"]:
        p = result["probe"]
        print(f"probe during the burst ({p['requests']} requests, one at a time, own process): {p['by_status']}")
        for key in sorted(k for k in p if " from the " in k):
            print(f"  {key}: {p[key]['replies']} replies in P50 {p[key]['p50_s']:.3f} s / max {p[key]['max_s']:.3f} s")
    return 0


def add_arguments(p) -> None:
    p.add_argument("--host", default=DEFAULT_URL)
    p.add_argument("--model", default=SPECULATIVE_MODEL_ID)
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--patience", type=float, default=120, help="each client's timeout, seconds")
    p.add_argument("--probes", type=int, default=10, help="short requests a separate process sends during the burst (0: none)")
