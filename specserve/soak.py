"""`specserve soak`: mixed traffic for a chosen time against the served application, and what a platform
engineer reads off it: failed requests, latency percentiles per time window, every replica's memory
over time, and at the end the engines' unfinished requests and the draft's tracked requests
(both back to zero once traffic stops). Starts `serve run --config` itself when nothing answers.

Traffic: `--concurrency` closed-loop clients, each request drawn at random (seeded) among the
speculative and baseline models, greedy or temperature 0.7, short (32) or long (256 tokens), streamed or
not. With `--kill-engine-after S` (an application on this machine) it kills the speculative model's vLLM
engine process S seconds in and records the recovery timeline: when `/health` reported it, when the
model served again, and which requests failed in between.
"""

import asyncio
import json
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from deployment.defaults import BASELINE_MODEL_ID, SPECULATIVE_MODEL_ID
from loadtest import auth_headers, load_prompts
from loadtest._report import percentile
from specserve.serve_process import DEFAULT_URL, ServeProcess, is_ready, served_stats

SHAPES = [(temperature, max_tokens, stream)
          for temperature in (0.0, 0.7) for max_tokens in (32, 256) for stream in (False, True)]


@dataclass
class Outcome:
    model: str
    temperature: float
    max_tokens: int
    stream: bool
    start: float  # seconds since the soak began
    end: float = 0.0
    status: int = 0
    tokens: int = 0
    error: str = ""


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


async def one_request(client: httpx.AsyncClient, outcome: Outcome, prompt: str, t0: float, patience_s: float) -> Outcome:
    body = {"model": outcome.model, "prompt": prompt, "max_tokens": outcome.max_tokens,
            "temperature": outcome.temperature, "ignore_eos": True, "stream": outcome.stream}
    if outcome.stream:
        body["stream_options"] = {"include_usage": True}
    try:
        async with asyncio.timeout(patience_s):
            if outcome.stream:
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    outcome.status = response.status_code
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            event = json.loads(line[6:])
                            if "error" in event:
                                outcome.error = str(event["error"])[:200]
                            outcome.tokens = (event.get("usage") or {}).get("completion_tokens", outcome.tokens)
                    if response.status_code != 200:
                        outcome.error = outcome.error or f"HTTP {response.status_code}"
            else:
                response = await client.post("/v1/completions", json=body)
                outcome.status = response.status_code
                if response.status_code == 200:
                    outcome.tokens = response.json()["usage"]["completion_tokens"]
                else:
                    outcome.error = f"HTTP {response.status_code}: {response.text[:200]}"
        if not outcome.error and outcome.tokens != outcome.max_tokens:
            outcome.error = f"{outcome.tokens} of {outcome.max_tokens} tokens"
    except (httpx.HTTPError, TimeoutError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"[:200]
    outcome.end = time.monotonic() - t0
    return outcome


async def clients(url: str, duration_s: float, concurrency: int, seed: int, t0: float, patience_s: float,
                  models: list[str]) -> list[Outcome]:
    prompts = [p["prompt"] for p in load_prompts()]
    rng = random.Random(seed)
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, headers=auth_headers(), limits=limits, timeout=patience_s) as client:
        async def worker():
            while time.monotonic() - t0 < duration_s:
                temperature, max_tokens, stream = rng.choice(SHAPES)
                outcome = Outcome(rng.choice(models), temperature, max_tokens, stream, time.monotonic() - t0)
                outcomes.append(await one_request(client, outcome, rng.choice(prompts), t0, patience_s))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes


def model_stats(url: str) -> dict:
    """Each model's stats by replica tag ({model: {tag: stats}}): an autoscaled model's replicas each
    have their own memory and tracked requests."""
    return served_stats(url, every_replica="true")


def replica_name(model: str, tag: str) -> str:
    """'<model> #<replica>': the replica's own id, the last part of its Serve tag."""
    return f"{model} #{tag.rsplit('#', 1)[-1]}"


def memory_sample(stats: dict, t: float) -> dict:
    """Each replica's memory (replica and engine processes, '<model> #<replica>'), and its engine's alone
    ('<model> #<replica> engine'): a leak shows in a replica, and a model's sum would change with its
    replica count."""
    sample = {"t": round(t, 1)}
    for model, replicas in stats.items():
        for tag, s in replicas.items():
            name = replica_name(model, tag)
            sample[name] = s.get("replica_memory_bytes", 0)
            sample[f"{name} engine"] = s.get("engine_memory_bytes", 0)
    return sample


async def memory_sampler(url: str, interval_s: float, t0: float, samples: list, stop: asyncio.Event) -> None:
    """Every replica's memory every interval."""
    while not stop.is_set():
        try:
            stats = await asyncio.to_thread(model_stats, url)
            samples.append(memory_sample(stats, time.monotonic() - t0))
        except httpx.HTTPError:
            pass  # an engine being replaced: the sample is skipped, the soak goes on
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
        except TimeoutError:
            pass


# -- engine death --------------------------------------------------------------------------------

def replica_of(title: str, model_id: str) -> bool:
    """Whether a process title is that of a Serve replica of model_id. Ray titles a replica's process
    ray::ServeReplica:<app>:<deployment>, with the method it runs appended while it runs one
    (".handle_request_with_rejection()") and padded with spaces; the deployment is
    SpecServeLLMServer:<model id with "/" as "--" and "." as "_">."""
    if not title.startswith("ray::ServeReplica:"):
        return False
    parts = title.removeprefix("ray::ServeReplica:").split(":")
    deployment = model_id.replace("/", "--").replace(".", "_")
    return len(parts) >= 3 and parts[2].split(".")[0].strip() == deployment


def engine_processes(model_id: str) -> list:
    """The vLLM engine processes under the Serve replica(s) of model_id on this machine."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if replica_of(" ".join(proc.info.get("cmdline") or []), model_id):
            try:
                found += [c for c in proc.children(recursive=True) if "EngineCore" in " ".join(c.cmdline())]
            except psutil.Error:
                pass
    return found


def kill_engine(model_id: str) -> int:
    """SIGKILL the engine process of model_id's replica (the first, if several): returns its pid."""
    engines = engine_processes(model_id)
    if not engines:
        raise RuntimeError(f"no engine process of {model_id} on this machine")
    os.kill(engines[0].pid, signal.SIGKILL)
    return engines[0].pid


async def recovery_timeline(url: str, model_id: str, t0: float, timeout_s: float = 600) -> dict:
    """After a kill: seconds (since the soak began) to the first failing /health, and to the first
    moment /health is 200 again and model_id completes a request."""
    timeline = {"killed_at_s": round(time.monotonic() - t0, 2)}
    body = {"model": model_id, "prompt": "import os\n", "max_tokens": 4, "temperature": 0}
    async with httpx.AsyncClient(base_url=url, headers=auth_headers(), timeout=10) as client:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                healthy = (await client.get("/health")).status_code == 200
            except httpx.HTTPError:
                healthy = False
            now = round(time.monotonic() - t0, 2)
            if not healthy and "health_failed_at_s" not in timeline:
                timeline["health_failed_at_s"] = now
            if healthy and "health_failed_at_s" in timeline:
                try:
                    if (await client.post("/v1/completions", json=body, timeout=60)).status_code == 200:
                        timeline["recovered_at_s"] = round(time.monotonic() - t0, 2)
                        return timeline
                except httpx.HTTPError:
                    pass
            await asyncio.sleep(0.5)
    timeline["recovered_at_s"] = None
    return timeline


# -- report --------------------------------------------------------------------------------------

def windows(outcomes: list[Outcome], window_s: float) -> list[dict]:
    """Per window of request start time: requests, failures, P50/P95 end-to-end seconds and per-token ms."""
    rows = []
    last = max((o.start for o in outcomes), default=0.0)
    for i in range(int(last // window_s) + 1):
        batch = [o for o in outcomes if i * window_s <= o.start < (i + 1) * window_s]
        ok = [o for o in batch if not o.error]
        e2e = [o.end - o.start for o in ok]
        per_token = [1e3 * (o.end - o.start) / o.tokens for o in ok if o.tokens]
        rows.append({"from_s": i * window_s, "requests": len(batch), "failures": len(batch) - len(ok),
                     "p50_e2e_s": percentile(e2e, 50), "p95_e2e_s": percentile(e2e, 95),
                     "p50_ms_per_token": percentile(per_token, 50), "p95_ms_per_token": percentile(per_token, 95)})
    return rows


def memory_growth(samples: list[dict], warm_up_s: float) -> dict:
    """Per replica: memory at its first sample after warm-up, at its last, and the relative change (a
    replica that started or stopped during the soak is measured over the samples it has)."""
    growth = {}
    after = [s for s in samples if s["t"] >= warm_up_s] or samples
    for name in dict.fromkeys(k for s in after for k in s if k != "t"):
        first, last = (next(s[name] for s in ordered if name in s) for ordered in (after, after[::-1]))
        growth[name] = {"after_warm_up_bytes": first, "at_end_bytes": last,
                        "change": (last - first) / first if first else None}
    return growth


def failures_by_phase(outcomes: list[Outcome], timeline: dict | None) -> dict:
    """Failed requests per model: overall, and with an engine kill, those that overlapped the outage
    and those that started after recovery."""
    result = {"total": {}, "during_outage": {}, "after_recovery": {}}
    killed, recovered = (timeline or {}).get("killed_at_s"), (timeline or {}).get("recovered_at_s")
    for o in outcomes:
        if not o.error:
            continue
        result["total"][o.model] = result["total"].get(o.model, 0) + 1
        if killed is not None:
            phase = "after_recovery" if recovered is not None and o.start >= recovered else \
                "during_outage" if o.end >= killed else None
            if phase:
                result[phase][o.model] = result[phase].get(o.model, 0) + 1
    return result


def markdown(report: dict) -> str:
    lines = ["# specserve soak", "",
             f"{report['duration_s']} s at concurrency {report['concurrency']}, models {', '.join(report['models'])}: "
             f"{report['requests']} requests, {report['failures']} failed.", "",
             "| from s | requests | failures | P50 e2e s | P95 e2e s | P50 ms/token | P95 ms/token |",
             "|---|---|---|---|---|---|---|"]
    for w in report["windows"]:
        lines.append(f"| {w['from_s']:.0f} | {w['requests']} | {w['failures']} | {w['p50_e2e_s']:.2f} | "
                     f"{w['p95_e2e_s']:.2f} | {w['p50_ms_per_token']:.1f} | {w['p95_ms_per_token']:.1f} |")
    lines += ["", "Replica memory (resident; '<model> #<replica>': replica and engine processes, '... engine': the engine's alone):", ""]
    for model, g in report["memory_growth"].items():
        change = "?" if g["change"] is None else f"{100 * g['change']:+.1f}%"
        lines.append(f"- {model}: {g['after_warm_up_bytes'] / 2**30:.2f} GiB after warm-up, "
                     f"{g['at_end_bytes'] / 2**30:.2f} GiB at the end ({change})")
    lines += ["", f"At the end: unfinished requests {report['unfinished_requests']}, "
                  f"draft tracked requests {report['draft_tracked_requests']}.",
              f"Failures by model: {report['failures_by_phase']['total'] or 'none'}."]
    if report.get("recovery"):
        r = report["recovery"]
        lines += ["", f"Engine of {report['models'][0]} killed at {r['killed_at_s']} s (pid {r['pid']}); /health "
                      f"failed at {r.get('health_failed_at_s')} s; served again at {r.get('recovered_at_s')} s. "
                      f"Failed requests overlapping the outage: {report['failures_by_phase']['during_outage'] or 'none'}; "
                      f"started after recovery: {report['failures_by_phase']['after_recovery'] or 'none'}."]
    return "\n".join(lines) + "\n"


async def soak(args) -> dict:
    models = [args.speculative_model, args.baseline_model]
    t0 = time.monotonic()
    samples: list[dict] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(memory_sampler(args.host, args.memory_interval, t0, samples, stop))
    traffic = asyncio.create_task(clients(args.host, args.duration, args.concurrency, args.seed, t0, args.patience, models))
    recovery = None
    if args.kill_engine_after is not None:
        await asyncio.sleep(args.kill_engine_after)
        pid = kill_engine(args.speculative_model)
        log(f"killed the engine of {args.speculative_model} (pid {pid})")
        recovery = await recovery_timeline(args.host, args.speculative_model, t0) | {"pid": pid}
        log(f"recovery: {recovery}")
    outcomes = await traffic
    stop.set()
    await sampler
    await asyncio.sleep(2)  # the engines retire the last aborted requests
    unfinished = httpx.get(f"{args.host}/v1/specserve/unfinished_requests", headers=auth_headers(), timeout=60).json()
    stats = model_stats(args.host)
    samples.append(memory_sample(stats, time.monotonic() - t0))
    return {
        "duration_s": args.duration, "concurrency": args.concurrency, "models": models, "seed": args.seed,
        "requests": len(outcomes), "failures": sum(bool(o.error) for o in outcomes),
        "windows": windows(outcomes, args.window), "memory": samples,
        "memory_growth": memory_growth(samples, args.warm_up),
        "unfinished_requests": unfinished,
        "draft_tracked_requests": sum(len(s.get("tracked_requests", [])) for s in stats[args.speculative_model].values()),
        "failures_by_phase": failures_by_phase(outcomes, recovery), "recovery": recovery,
        "errors": sorted({o.error for o in outcomes if o.error})[:20],
        "outcomes": [asdict(o) for o in outcomes],
    }


def main(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server = None
    if not is_ready(args.host):
        log(f"nothing answers at {args.host}; starting serve run {args.config}")
        server = ServeProcess(args.config, out / "serve.log", args.host)
        log(f"ready in {server.wait_ready():.0f} s")
    try:
        report = asyncio.run(soak(args))
    finally:
        if server is not None:
            server.stop()
    (out / "soak.json").write_text(json.dumps(report, indent=1))
    (out / "soak.md").write_text(markdown(report))
    print(markdown(report))
    return 0 if report["failures"] == 0 else 1


def add_arguments(p) -> None:
    p.add_argument("--out", required=True, help="directory for soak.json and soak.md")
    p.add_argument("--host", default=DEFAULT_URL)
    p.add_argument("--config", default="serve_config.yaml", help="serve config to start when nothing answers at --host")
    p.add_argument("--duration", type=float, default=600, help="seconds of traffic")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--window", type=float, default=60, help="seconds per row of the latency table")
    p.add_argument("--warm-up", type=float, default=60, help="memory growth is measured from this second on")
    p.add_argument("--memory-interval", type=float, default=15, help="seconds between memory samples")
    p.add_argument("--patience", type=float, default=120, help="a client's timeout per request, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kill-engine-after", type=float, help="kill the speculative model's engine this many seconds in")
    p.add_argument("--speculative-model", default=SPECULATIVE_MODEL_ID)
    p.add_argument("--baseline-model", default=BASELINE_MODEL_ID)
