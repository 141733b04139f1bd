"""`specserve loadtest`: Locust, headless, against each target alone at each concurrency level, then
the report. Starts `serve run serve_config.yaml` itself when nothing answers at --host, and stops it."""

import csv
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from deployment.defaults import REPO_ROOT
from loadtest import _options
from loadtest._report import TARGETS, capacity, speedups, summarize, write_outputs
from specserve.serve_process import DEFAULT_URL, ServeProcess, is_ready

USER_CLASS = {"speculative": "SpeculativeUser", "baseline": "BaselineUser"}


def log(msg: str) -> None:
    print(f"[loadtest {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def replica_memory_bytes() -> int:
    """Resident memory of the LLM server replicas and their engine processes."""
    import psutil

    total = 0
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info.get("cmdline") or [])
        if "LLMServer" in cmd:
            try:
                family = [proc, *proc.children(recursive=True)]
                total += sum(p.memory_info().rss for p in family)
            except psutil.Error:
                pass
    return total


def warm_up(url: str, model: str) -> None:
    body = {"model": model, "prompt": "import os\n", "max_tokens": 16, "temperature": 0}
    httpx.post(f"{url}/v1/completions", json=body, timeout=120).raise_for_status()


def locust_command(out: Path, url: str, target: str, concurrency: int, duration: int, args) -> tuple[list[str], dict]:
    """Headless Locust for one target at one concurrency (closed loop: users = concurrency), with every
    load-test option of `args` on its command line. Returns (argv, environment)."""
    env = os.environ | {"SPECSERVE_SAMPLES_CSV": str(out / "samples.csv"), "SPECSERVE_CONCURRENCY": str(concurrency)}
    cmd = [str(Path(sys.executable).with_name("locust")), "-f", str(REPO_ROOT / "loadtest"), "--headless",
           "--host", url, "-u", str(concurrency), "-r", str(concurrency), "-t", f"{duration}s",
           "--stop-timeout", "120", "--csv", str(out / "locust" / f"{target}_c{concurrency}"), "--only-summary",
           "--loglevel", "WARNING", *_options.to_argv(args), USER_CLASS[target]]
    return cmd, env


def run_level(out: Path, url: str, target: str, concurrency: int, duration: int, args) -> None:
    cmd, env = locust_command(out, url, target, concurrency, duration, args)
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if result.returncode not in (0, 1):  # 1: some requests failed, which the report shows
        raise RuntimeError(f"locust failed ({result.returncode}):\n{result.stderr[-3000:]}")


def main(args) -> int:
    out = Path(args.out)
    (out / "locust").mkdir(parents=True, exist_ok=True)
    (out / "samples.csv").unlink(missing_ok=True)
    levels = [int(c) for c in args.concurrency.split(",")]
    server = None
    if not is_ready(args.host):
        log(f"nothing answers at {args.host}; starting serve run serve_config.yaml")
        server = ServeProcess("serve_config.yaml", out / "serve.log", args.host)
        log(f"ready in {server.wait_ready():.0f} s")
    memory = {}
    try:
        for target in TARGETS:
            warm_up(args.host, getattr(args, f"{target}_model"))
            memory[target] = {"after_warm_up_bytes": replica_memory_bytes()}
            for c in levels:
                log(f"{target}: concurrency {c} for {args.duration} s")
                run_level(out, args.host, target, c, args.duration, args)
            memory[target]["at_end_bytes"] = replica_memory_bytes()
    finally:
        if server is not None:
            log("stopping the application it started")
            server.stop()
    with open(out / "samples.csv") as f:
        samples = list(csv.DictReader(f))
    summary = summarize(samples)
    speed = speedups(summary)
    plan = capacity(summary, args.slo_p95_e2e, args.target_rps) if args.slo_p95_e2e else None
    for target, m in memory.items():
        m["change"] = (m["at_end_bytes"] - m["after_warm_up_bytes"]) / max(m["after_warm_up_bytes"], 1)
    extra = {"host": args.host, "duration_s": args.duration,
             **{o.dest: getattr(args, o.dest) for o in _options.OPTIONS}, "replica_memory": memory}
    write_outputs(out, summary, speed, plan, extra)
    print((out / "report.md").read_text())
    return 0


def add_arguments(p) -> None:
    p.add_argument("--out", required=True, help="directory for samples.csv, summary.json, report.md, charts")
    p.add_argument("--host", default=DEFAULT_URL)
    p.add_argument("--concurrency", default="1,2,4,8,16")
    p.add_argument("--duration", type=int, default=30, help="seconds per target and concurrency level")
    p.add_argument("--slo-p95-e2e", type=float, help="SLO on P95 end-to-end latency, seconds")
    p.add_argument("--target-rps", type=float, help="request rate to size replicas for")
    _options.add_to(p)  # the locustfile's own options, forwarded to Locust as given
