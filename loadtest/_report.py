"""From raw per-request samples to capacity-planning numbers: percentiles, throughput, speed-up, the
crossover where speculation stops paying, and the SLO arithmetic. Pure functions, then the writers."""

import json
import math
from pathlib import Path

import numpy as np

TARGETS = ("speculative", "baseline")


def percentile(values, q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else float("nan")


def measured_seconds(rows: list[dict]) -> float:
    """The window a level was measured over: from its first request's start to its last one's end.
    Locust's run time is only nominal: requests in flight at its end are allowed to finish."""
    starts = [float(s["start"]) for s in rows]
    ends = [float(s["start"]) + float(s["e2e_s"]) for s in rows]
    return max(ends) - min(starts)


def summarize(samples: list[dict]) -> dict:
    """samples: dicts with target, concurrency, ok, start (epoch s), e2e_s, tpot_s, ttft_s, output_tokens,
    drafted/accepted tokens. Returns {target: {concurrency: stats}}; rates count over the measured window."""
    levels = sorted({(s["target"], int(s["concurrency"])) for s in samples})
    out: dict = {}
    for target, conc in levels:
        rows = [s for s in samples if s["target"] == target and int(s["concurrency"]) == conc]
        seconds = measured_seconds(rows)
        ok = [s for s in rows if str(s["ok"]) in ("True", "true", "1")]
        e2e = [float(s["e2e_s"]) for s in ok]
        tpot = [float(s["tpot_s"]) for s in ok]
        drafted = sum(int(s["drafted_tokens"]) for s in ok)
        accepted = sum(int(s["accepted_tokens"]) for s in ok)
        tokens = sum(int(s["output_tokens"]) for s in ok)
        out.setdefault(target, {})[conc] = {
            "requests": len(ok),
            "failures": len(rows) - len(ok),
            "p50_e2e_s": percentile(e2e, 50),
            "p95_e2e_s": percentile(e2e, 95),
            "p50_tpot_s": percentile(tpot, 50),
            "p95_tpot_s": percentile(tpot, 95),
            "p50_ttft_s": percentile([float(s["ttft_s"]) for s in ok], 50),
            "output_tokens_per_s": tokens / seconds,
            "requests_per_s": len(ok) / seconds,
            "acceptance_rate": accepted / drafted if drafted else None,
            "measured_s": seconds,
        }
    return out


def speedups(summary: dict) -> dict:
    """Per concurrency: baseline P50 e2e over speculative P50 e2e (above 1: speculation is faster),
    the throughput ratio, and the crossover: the lowest concurrency where speculation stops paying."""
    levels = sorted(set(summary.get("speculative", {})) & set(summary.get("baseline", {})))
    rows = {}
    for c in levels:
        spec, base = summary["speculative"][c], summary["baseline"][c]
        rows[c] = {
            "p50_e2e_speedup": base["p50_e2e_s"] / spec["p50_e2e_s"],
            "throughput_ratio": spec["output_tokens_per_s"] / base["output_tokens_per_s"],
        }
    crossover = next((c for c in levels if rows[c]["p50_e2e_speedup"] < 1.0), None)
    return {"by_concurrency": rows, "crossover_concurrency": crossover}


def capacity(summary: dict, slo_p95_e2e_s: float, target_rps: float | None = None) -> dict:
    """Per target: the highest concurrency whose P95 end-to-end latency is within the SLO, the request
    rate one replica sustains there, and the replicas needed for target_rps."""
    plan = {}
    for target, levels in summary.items():
        within = [c for c, s in sorted(levels.items()) if s["p95_e2e_s"] <= slo_p95_e2e_s and s["failures"] == 0]
        best = max(within) if within else None
        rps = levels[best]["requests_per_s"] if best is not None else 0.0
        plan[target] = {
            "max_concurrency_within_slo": best,
            "requests_per_s_per_replica": rps,
            "replicas_for_target": (math.ceil(target_rps / rps) if rps > 0 else None) if target_rps else None,
        }
    return {"slo_p95_e2e_s": slo_p95_e2e_s, "target_requests_per_s": target_rps, "targets": plan}


def write_outputs(out_dir: Path, summary: dict, speed: dict, plan: dict | None, extra: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(
        {"summary": summary, "speedup": speed, "capacity": plan, **extra}, indent=2, default=str))
    _charts(out_dir, summary, speed)
    (out_dir / "report.md").write_text(markdown(summary, speed, plan, extra))


def markdown(summary: dict, speed: dict, plan: dict | None, extra: dict) -> str:
    lines = ["# specserve load test", ""]
    for k, v in extra.items():
        lines.append(f"- {k}: {v}")
    lines += ["", "| target | concurrency | requests | failures | measured s | P50 e2e s | P95 e2e s | P50 TPOT ms | "
              "output tok/s | acceptance |", "|---|---|---|---|---|---|---|---|---|---|"]
    for target, levels in summary.items():
        for c, s in levels.items():
            acc = "-" if s["acceptance_rate"] is None else f"{s['acceptance_rate']:.2f}"
            lines.append(f"| {target} | {c} | {s['requests']} | {s['failures']} | {s['measured_s']:.1f} | {s['p50_e2e_s']:.3f} | "
                         f"{s['p95_e2e_s']:.3f} | {s['p50_tpot_s'] * 1e3:.1f} | {s['output_tokens_per_s']:.1f} | {acc} |")
    lines += ["", "| concurrency | P50 e2e speed-up | throughput ratio |", "|---|---|---|"]
    for c, r in speed["by_concurrency"].items():
        lines.append(f"| {c} | {r['p50_e2e_speedup']:.2f}x | {r['throughput_ratio']:.2f}x |")
    cross = speed["crossover_concurrency"]
    lines += ["", f"Crossover (speculation stops paying): {'none within the tested range' if cross is None else f'concurrency {cross}'}."]
    if plan:
        lines += ["", f"## Capacity for P95 end-to-end latency <= {plan['slo_p95_e2e_s']} s", "",
                  "| target | max concurrency within SLO | requests/s per replica | replicas for "
                  f"{plan['target_requests_per_s']} req/s |", "|---|---|---|---|"]
        for target, p in plan["targets"].items():
            lines.append(f"| {target} | {p['max_concurrency_within_slo']} | {p['requests_per_s_per_replica']:.2f} | "
                         f"{p['replicas_for_target']} |")
    lines += ["", "Charts: latency.png, tpot.png, throughput.png, speedup.png", ""]
    return "\n".join(lines)


def _charts(out_dir: Path, summary: dict, speed: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def plot(name, ylabel, series):
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, xs, ys, style in series:
            ax.plot(xs, ys, style, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)

    def series(key, scale=1.0, styles=("-", "--")):
        out = []
        for target in summary:
            xs = sorted(summary[target])
            for q, style in zip(("p50", "p95"), styles):
                out.append((f"{target} {q.upper()}", xs, [summary[target][c][f"{q}_{key}"] * scale for c in xs], style))
        return out

    plot("latency.png", "end-to-end latency (s)", series("e2e_s"))
    plot("tpot.png", "time per output token (ms)", series("tpot_s", 1e3))
    plot("throughput.png", "output tokens/s", [
        (t, sorted(summary[t]), [summary[t][c]["output_tokens_per_s"] for c in sorted(summary[t])], "-")
        for t in summary])
    xs = sorted(speed["by_concurrency"])
    ys = [speed["by_concurrency"][c]["p50_e2e_speedup"] for c in xs]
    plot("speedup.png", "P50 e2e speed-up (baseline / speculative)",
         [("speed-up", xs, ys, "-"), ("break-even", xs, [1.0] * len(xs), ":")])
