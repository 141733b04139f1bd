"""`specserve loadtest`: Locust, headless, against each target alone at each concurrency level, then
the report. Starts `serve run` on --config (serve_config.yaml) itself when nothing answers at --host,
and stops it.

Targets: the speculative model, any --compare models (more speculative model ids, e.g. the fixed-K
variants of configs/k-sweep.yaml), the baseline, and with --repeat-baseline the baseline once more (the
noise band). Every target is warmed up first; then each concurrency level in turn runs every target, in
a shuffled order: this machine's speed drifts by 10-30% over minutes, and measuring one target's
levels after another's would put that drift between the targets compared. Each run draws its order's
seed (--order-seed repeats one; summary.json records it): with one fixed order, runs of the same
targets all measured them in the same sequence, and whatever that sequence favoured they repeated.
With --rounds R each level runs every target R times, each round in an order of its own: one 30 s
window per point is noisier than the 5% that separates close policies, and R rounds pool R windows'
requests. Within a round every target draws the same prompts (Locust's --prompt-seed, a new seed each
round). For each speculative target the engine's own counters (/v1/specserve/stats) are read before and
after every level: the chosen-K histogram and the shares of steps and requests that drafted come from
the engine, since the per-request HTTP summary leaves out steps without drafts; an autoscaled model's
are summed over its replicas."""

import argparse
import csv
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx

from deployment.defaults import REPO_ROOT
from loadtest import _options, auth_headers
from loadtest._report import BASELINE, BASELINE_REPEAT, capacity, engine_counters, speedups, summarize, write_outputs
from specserve.arguments import positive_ints
from specserve.serve_process import DEFAULT_URL, ServeProcess, is_ready, served_stats

USER_CLASS = {"speculative": "SpeculativeUser", "baseline": "BaselineUser"}


def plan_targets(args) -> list[tuple[str, str, str]]:
    """(label, Locust user class, model id) for each target, in the order they are measured."""
    targets = [("speculative", "SpeculativeUser", args.speculative_model)]
    targets += [(model, "SpeculativeUser", model) for model in filter(None, (args.compare or "").split(","))]
    targets.append((BASELINE, "BaselineUser", args.baseline_model))
    if args.repeat_baseline:
        targets.append((BASELINE_REPEAT, "BaselineUser", args.baseline_model))
    return targets


def measurement_order(targets: list, levels: list[int], seed: int = 0, rounds: int = 1) -> list[tuple[int, int, tuple]]:
    """(level, round, target) in the order measured: each level in turn, and within it each round
    running every target in an order of its own (shuffled)."""
    rng = random.Random(seed)
    order = []
    for level in levels:
        for r in range(rounds):
            shuffled = list(targets)
            rng.shuffle(shuffled)
            order += [(level, r, target) for target in shuffled]
    return order


def one_model_stats(url: str, model: str, timeout_s: float = 30, **params) -> dict:
    """This model's entry of /v1/specserve/stats ({} when absent). Only this model is asked: asking wakes
    an engine's worker, which would then spin beside the one measured."""
    return served_stats(url, timeout_s, model=model, **params).get(model) or {}


def speculation_stats(url: str, model: str) -> dict | None:
    """The model's engine counters from one of its replicas, or None when it does not speculate."""
    try:
        stats = one_model_stats(url, model)
    except httpx.HTTPError:
        return None
    return stats if stats.get("enabled") else None


def replica_counters(url: str, model: str) -> dict | None:
    """Each running replica's engine counters by replica tag (`?every_replica=true`), or None when the
    model does not speculate: an autoscaled model's work is spread over its replicas."""
    try:
        replicas = one_model_stats(url, model, timeout_s=60, every_replica="true")
    except httpx.HTTPError:
        return None
    return replicas if replicas and all(r.get("enabled") for r in replicas.values()) else None


def policy_label(stats: dict) -> str:
    """'adaptive (K_max 6, request speed floor 0.8)' from a speculative engine's stats, for the title."""
    details = [f"K_max {stats.get('k_max', '?')}"]
    if stats.get("k_policy") == "adaptive" and stats.get("request_speed_floor") is not None:
        details.append(f"request speed floor {stats['request_speed_floor']}")
    return f"{stats.get('k_policy', '?')} ({', '.join(details)})"


def models_label(stats: dict, model: str) -> str:
    """'target <name> / draft <name>' from the speculative engine's settings (its stats), for the charts'
    title; the model id where they are unknown."""
    names = {k: "/".join(Path(v).parts[-2:]) for k, v in (stats.get("models") or {}).items()}
    return f"target {names.get('target', '?')} / draft {names.get('draft', '?')}" if names else model


def log(msg: str) -> None:
    print(f"[loadtest {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def replica_memory_bytes(url: str, model: str) -> int:
    """Resident memory of the model's replica with its engine processes (one replica asked, from
    /v1/specserve/stats): works against a remote application too."""
    return one_model_stats(url, model).get("replica_memory_bytes", 0)


def warm_up(url: str, model: str) -> None:
    body = {"model": model, "prompt": "import os\n", "max_tokens": 16, "temperature": 0}
    httpx.post(f"{url}/v1/completions", json=body, headers=auth_headers(), timeout=120).raise_for_status()


def locust_command(out: Path, url: str, target: str, concurrency: int, duration: int, args,
                   user_class: str | None = None, model: str | None = None, round_: int = 0) -> tuple[list[str], dict]:
    """Headless Locust for one target at one concurrency (closed loop: users = concurrency), with every
    load-test option of `args` on its command line (the user class's model id replaced by `model` when
    given). Samples are labelled with `target`. Returns (argv, environment)."""
    user_class = user_class or USER_CLASS[target]
    options = vars(args).copy()
    # Common prompts: every target of a round draws the same sequence, user by user (in 12 s points
    # at 0.7 the acceptance of the requests two targets drew differed by up to 20%, and their ratio with it).
    options["prompt_seed"] = (args.prompt_seed or 0) + round_
    if model is not None:
        options["speculative_model" if user_class == "SpeculativeUser" else "baseline_model"] = model
    env = os.environ | {"SPECSERVE_SAMPLES_CSV": str(out / "samples.csv"), "SPECSERVE_CONCURRENCY": str(concurrency),
                        "SPECSERVE_TARGET_LABEL": target, "SPECSERVE_ROUND": str(round_)}
    cmd = [str(Path(sys.executable).with_name("locust")), "-f", str(REPO_ROOT / "loadtest"), "--headless",
           "--host", url, "-u", str(concurrency), "-r", str(concurrency), "-t", f"{duration}s",
           "--stop-timeout", "120", "--csv", str(out / "locust" / f"{target}_c{concurrency}_r{round_}"), "--only-summary",
           "--loglevel", "WARNING", *_options.to_argv(argparse.Namespace(**options)), user_class]
    return cmd, env


def run_level(out: Path, url: str, target: str, concurrency: int, duration: int, args,
              user_class: str | None = None, model: str | None = None, round_: int = 0) -> None:
    cmd, env = locust_command(out, url, target, concurrency, duration, args, user_class, model, round_)
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if result.returncode not in (0, 1):  # 1: some requests failed, which the report shows
        raise RuntimeError(f"locust failed ({result.returncode}):\n{result.stderr[-3000:]}")


def main(args) -> int:
    if args.rounds < 1:
        print("specserve loadtest: --rounds must be at least 1", file=sys.stderr)
        return 2
    out = Path(args.out)
    (out / "locust").mkdir(parents=True, exist_ok=True)
    (out / "samples.csv").unlink(missing_ok=True)
    server = None
    if not is_ready(args.host):
        log(f"nothing answers at {args.host}; starting serve run {args.config}")
        server = ServeProcess(args.config, out / "serve.log", args.host)
        # Five engines of configs/k-sweep.yaml starting on two cores took over 400 s on a slow day.
        log(f"ready in {server.wait_ready(timeout_s=1200):.0f} s")
    memory, engine, spec_stats, title_models = {}, {}, {}, args.speculative_model
    try:
        targets = plan_targets(args)
        for label, _, model in targets:
            warm_up(args.host, model)
            memory[label] = {"after_warm_up_bytes": replica_memory_bytes(args.host, model)}
        before: dict = {}  # (target, level) -> its engine's counters before the level's first round
        order_seed = args.order_seed if args.order_seed is not None else random.SystemRandom().randrange(2**31)
        log(f"measurement order seed {order_seed}")
        for c, r, (label, user_class, model) in measurement_order(targets, args.concurrency, order_seed, args.rounds):
            log(f"{label} ({model}): concurrency {c} for {args.duration} s, round {r + 1} of {args.rounds}")
            if r == 0:
                before[label, c] = replica_counters(args.host, model)
            run_level(out, args.host, label, c, args.duration, args, user_class, model, r)
            # Each target has an engine of its own, idle while the others run: its counters from before
            # its first round to after its last are its rounds' alone.
            if r == args.rounds - 1 and before[label, c] is not None:
                engine.setdefault(label, {})[c] = engine_counters(before[label, c], replica_counters(args.host, model) or {})
        for label, _, model in targets:
            memory[label]["at_end_bytes"] = replica_memory_bytes(args.host, model)
        spec_stats = speculation_stats(args.host, args.speculative_model) or {}
        title_models = models_label(spec_stats, args.speculative_model)
    finally:
        if server is not None:
            log("stopping the application it started")
            server.stop()
    with open(out / "samples.csv") as f:
        samples = list(csv.DictReader(f))
    summary = summarize(samples)
    for label, levels in engine.items():
        for c, counters in levels.items():
            summary[label][c]["engine"] = counters
    speed = speedups(summary, samples)
    plan = capacity(summary, args.slo_p95_e2e, args.target_rps) if args.slo_p95_e2e else None
    for target, m in memory.items():
        m["change"] = (m["at_end_bytes"] - m["after_warm_up_bytes"]) / max(m["after_warm_up_bytes"], 1)
    extra = {"host": args.host, "duration_s": args.duration, "rounds": args.rounds, "order_seed": order_seed,
             "models_label": title_models,
             "k_policy": policy_label(spec_stats),
             **{o.dest: getattr(args, o.dest) for o in _options.OPTIONS}, "replica_memory": memory}
    write_outputs(out, summary, speed, plan, extra)
    print((out / "report.md").read_text())
    return 0


def add_arguments(p) -> None:
    p.add_argument("--out", required=True, help="directory for samples.csv, summary.json, report.md, charts")
    p.add_argument("--host", default=DEFAULT_URL)
    p.add_argument("--config", default="serve_config.yaml", help="serve config to start when nothing answers at --host")
    p.add_argument("--compare", help="more speculative model ids to measure like the speculative one "
                   "(e.g. specserve-k2,specserve-k4,specserve-k6 of configs/k-sweep.yaml)")
    p.add_argument("--repeat-baseline", action="store_true", help="measure the baseline again at the end: the noise band")
    p.add_argument("--concurrency", type=positive_ints, default="1,2,4,8,16")
    p.add_argument("--duration", type=int, default=30, help="seconds per target and concurrency level")
    p.add_argument("--rounds", type=int, default=1, help="times each target is measured at each level (each round "
                   "in an order of its own; the report pools the rounds and sets each against the baseline's)")
    p.add_argument("--order-seed", type=int, help="seed of the targets' shuffled order (drawn afresh each run "
                   "when not given, and recorded in summary.json)")
    p.add_argument("--slo-p95-e2e", type=float, help="SLO on P95 end-to-end latency, seconds")
    p.add_argument("--target-rps", type=float, help="request rate to size replicas for")
    _options.add_to(p)  # the locustfile's own options, forwarded to Locust as given
