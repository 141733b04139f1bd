"""`specserve bench-serve`: speculative against baseline, measured by a client this project did not write.

vLLM's own `bench serve` client (OpenAI completions, streamed, `ignore_eos`) against a running application
(./scripts/serve.sh), on prompts neither demo model saw: windows of 12-30 lines cut from the running
Python's own `test_*.py` files (the training corpus leaves test suites out, models/README.md), sent raw,
with no chat template. Each concurrency gets max(16, 4 x concurrency) requests; in every round each level
measures the baseline and the speculative model back to back, in alternating order, so the machine's
drift falls on both. With an API key set (SPECSERVE_API_KEY), the client sends it as OPENAI_API_KEY.
"""

import json
import os
import random
import sysconfig
from pathlib import Path

import numpy as np

from deployment.defaults import BASELINE_MODEL_ID, DEMO_TARGET, SPECULATIVE_MODEL_ID
from specserve.arguments import positive_int, positive_ints, temperatures
from specserve.serve_process import DEFAULT_URL


def cpython_test_windows(count: int, seed: int, test_dir: Path | None = None) -> list[str]:
    """`count` windows of 12-30 consecutive lines, each from a random `test_*.py` of `test_dir`."""
    test_dir = test_dir or Path(sysconfig.get_paths()["stdlib"]) / "test"
    files = sorted(test_dir.glob("test_*.py"))
    if not files:
        raise SystemExit(f"specserve bench-serve: no test_*.py under {test_dir} (a Python without its test suite)")
    rng = random.Random(seed)
    windows = []
    while len(windows) < count:
        lines = rng.choice(files).read_text(errors="replace").splitlines()
        size = rng.randint(12, 30)
        if len(lines) > size:
            start = rng.randrange(len(lines) - size)
            window = "\n".join(lines[start:start + size]) + "\n"
            if window.strip():
                windows.append(window)
    return windows


def requests_per_point(concurrency: int) -> int:
    return max(16, 4 * concurrency)


def measure(args, model: str, concurrency: int, temperature: float, prompts: Path, seed: int) -> dict:
    """One point of vLLM's client: its result's throughput and latencies, with every finished request's
    end-to-end seconds (for percentiles pooled over rounds)."""
    from vllm.benchmarks.serve import add_cli_args, main as vllm_bench_serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    result = vllm_bench_serve(parser.parse_args([
        "--backend", "openai", "--base-url", args.host, "--endpoint", "/v1/completions",
        "--model", model, "--tokenizer", args.tokenizer,
        "--dataset-name", "custom", "--dataset-path", str(prompts), "--skip-chat-template",
        "--custom-output-len", str(args.max_tokens), "--ignore-eos",
        "--num-prompts", str(requests_per_point(concurrency)), "--max-concurrency", str(concurrency),
        "--temperature", str(temperature), "--seed", str(seed),
        "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,95",
        "--disable-tqdm", "--ready-check-timeout-sec", "0", "--save-detailed",
    ]))
    finished = [latency for latency, error in zip(result["latencies"], result["errors"]) if not error]
    if not finished:  # a wrong host, model id or key: say so now, not as a division by zero at the end
        first_error = next((error for error in result["errors"] if error), "no error given").strip().splitlines()
        raise SystemExit(f"specserve bench-serve: no request to {model} at {args.host} finished: {first_error[-1]}")
    kept = ("completed", "failed", "output_throughput", "median_e2el_ms", "p95_e2el_ms", "median_ttft_ms", "median_tpot_ms")
    return {key: result[key] for key in kept} | {"e2e_s": finished}


def pooled(points: list[dict]) -> dict:
    """Mean throughput and end-to-end percentiles over every request of the points."""
    e2e_s = np.concatenate([point["e2e_s"] for point in points])
    return {"output_throughput": float(np.mean([point["output_throughput"] for point in points])),
            "median_e2el_ms": float(np.median(e2e_s)) * 1000, "p95_e2el_ms": float(np.percentile(e2e_s, 95)) * 1000}


def speed_ups(speculative: dict, baseline: dict) -> tuple[float, float, float]:
    """Throughput, P50 and P95 end to end of the speculative model over the baseline (above 1: better)."""
    return (speculative["output_throughput"] / baseline["output_throughput"],
            baseline["median_e2el_ms"] / speculative["median_e2el_ms"],
            baseline["p95_e2el_ms"] / speculative["p95_e2el_ms"])


def report(points: list[dict], max_tokens: int) -> str:
    lines = [f"Speculative over baseline, vLLM's bench serve client, {max_tokens} tokens, ignore_eos: throughput / "
             "P50 / P95 end to end, by round, then pooled (percentiles over every round's requests)",
             "| temperature | concurrency | baseline tok/s | by round | pooled | failed |", "|---|---|---|---|---|---|"]
    for key in dict.fromkeys((p["temperature"], p["concurrency"]) for p in points):
        same = [p for p in points if (p["temperature"], p["concurrency"]) == key]
        by_round = "; ".join(" / ".join(f"{r:.2f}" for r in speed_ups(p["speculative"], p["baseline"])) for p in same)
        baseline, speculative = pooled([p["baseline"] for p in same]), pooled([p["speculative"] for p in same])
        failed = sum(p[model]["failed"] for p in same for model in ("baseline", "speculative"))
        lines.append(f"| {key[0]:g} | {key[1]} | {baseline['output_throughput']:.1f} | {by_round} | "
                     + " / ".join(f"{r:.2f}" for r in speed_ups(speculative, baseline)) + f" | {failed} |")
    return "\n".join(lines)


def main(args) -> int:
    if os.environ.get("SPECSERVE_API_KEY"):
        os.environ.setdefault("OPENAI_API_KEY", os.environ["SPECSERVE_API_KEY"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    prompts = args.out.with_suffix(".prompts.jsonl")
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in cpython_test_windows(args.prompts, args.seed)))
    for model in (args.baseline, args.speculative):  # both replicas warm before the first point
        measure(args, model, 4, 0.0, prompts, args.seed)
    points = []
    for temperature in args.temperatures:
        for round_index in range(args.rounds):
            for level_index, concurrency in enumerate(args.concurrency):
                order = [args.baseline, args.speculative][:: -1 if (round_index + level_index) % 2 else 1]
                point = {"temperature": temperature, "round": round_index, "concurrency": concurrency}
                for model in order:
                    role = "baseline" if model == args.baseline else "speculative"
                    point[role] = measure(args, model, concurrency, temperature, prompts,
                                          args.seed + 1000 * round_index + concurrency)
                points.append(point)
                args.out.write_text(json.dumps(points, indent=1))
    print("\n" + report(points, args.max_tokens))
    return 0


def add_arguments(p) -> None:
    p.add_argument("--host", default=DEFAULT_URL)
    p.add_argument("--speculative", default=SPECULATIVE_MODEL_ID)
    p.add_argument("--baseline", default=BASELINE_MODEL_ID)
    p.add_argument("--tokenizer", default=DEMO_TARGET, help="the served target's tokenizer (path or hub id)")
    p.add_argument("--concurrency", type=positive_ints, default=[1, 4, 16, 32])
    p.add_argument("--temperatures", type=temperatures, default=[0.0, 0.7])
    p.add_argument("--rounds", type=positive_int, default=2)
    p.add_argument("--max-tokens", type=positive_int, default=128)
    p.add_argument("--prompts", type=positive_int, default=160, help="prompt windows cut from the test files")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("out/bench-serve.json"))
