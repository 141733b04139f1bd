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


def _is_ok(sample: dict) -> bool:
    return str(sample["ok"]) in ("True", "true", "1")


def _by_round(rows: list[dict]) -> dict[int, list[dict]]:
    rounds: dict[int, list[dict]] = {}
    for s in rows:
        rounds.setdefault(int(s.get("round") or 0), []).append(s)
    return dict(sorted(rounds.items()))


def summarize(samples: list[dict]) -> dict:
    """samples: dicts with target, concurrency, ok, start (epoch s), e2e_s, tpot_s, ttft_s, output_tokens,
    drafted/accepted tokens, and round (`--rounds`: a level measured more than once). Returns {target:
    {concurrency: stats}}: percentiles over every round's requests, rates over the rounds' measured
    windows added up, and each round's own throughput (output_tokens_per_s_by_round)."""
    levels = sorted({(s["target"], int(s["concurrency"])) for s in samples})
    out: dict = {}
    for target, conc in levels:
        rows = [s for s in samples if s["target"] == target and int(s["concurrency"]) == conc]
        rounds = _by_round(rows)
        windows = {r: measured_seconds(group) for r, group in rounds.items()}
        seconds = sum(windows.values())
        ok = [s for s in rows if _is_ok(s)]
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
            "output_tokens_per_s_by_round": {
                r: sum(int(s["output_tokens"]) for s in group if _is_ok(s)) / windows[r]
                for r, group in rounds.items()},
            "requests_per_s": len(ok) / seconds,
            "acceptance_rate": accepted / drafted if drafted else None,
            "measured_s": seconds,
        }
    return out


BASELINE, BASELINE_REPEAT = "baseline", "baseline-repeat"


def speedups(summary: dict, samples: list[dict] | None = None) -> dict:
    """For every target measured against the baseline, per concurrency: P50 and P95 end-to-end
    speed-ups (baseline latency over the target's: above 1, the target is faster) and the throughput
    ratio, and its crossover (the lowest concurrency where its P50 speed-up falls below 1). The
    speculative target's are also at the top level. A second baseline run ("baseline-repeat") is
    compared like any target: its ratios are the noise band. With the samples, the speculative target
    is also set against each compared one request by request (`paired_e2e_speedup`)."""
    by_target = {}
    for target in summary:
        if target == BASELINE:
            continue
        levels = sorted(set(summary[target]) & set(summary.get(BASELINE, {})))
        rows = {}
        for c in levels:
            spec, base = summary[target][c], summary[BASELINE][c]
            rows[c] = {
                "p50_e2e_speedup": base["p50_e2e_s"] / spec["p50_e2e_s"],
                "p95_e2e_speedup": base["p95_e2e_s"] / spec["p95_e2e_s"],
                "throughput_ratio": spec["output_tokens_per_s"] / base["output_tokens_per_s"],
                # each round against the baseline's same round (measured minutes apart, not an hour)
                "throughput_ratio_by_round": _throughput_ratio_by_round(spec, base),
            }
        crossover = next((c for c in levels if rows[c]["p50_e2e_speedup"] < 1.0), None)
        by_target[target] = {"by_concurrency": rows, "crossover_concurrency": crossover}
    main = by_target.get("speculative", {"by_concurrency": {}, "crossover_concurrency": None})
    return {**main, "by_target": by_target, "speculative_against": speculative_against(summary, samples)}


def _throughput_ratio_by_round(mine: dict, theirs: dict) -> dict:
    """One level's throughput over another target's at the same level, round by round (each within its
    round), for the rounds both ran and in which the other emitted tokens."""
    their_rounds = theirs.get("output_tokens_per_s_by_round", {})
    return {r: tps / their_rounds[r] for r, tps in mine.get("output_tokens_per_s_by_round", {}).items()
            if their_rounds.get(r)}


def speculative_against(summary: dict, samples: list[dict] | None = None) -> dict:
    """The speculative model's throughput over each other speculative target's (`--compare`: the fixed-K
    variants), per concurrency: pooled over the rounds, each round's (measured minutes apart, within one
    round: the machine's drift between rounds cancels) and their median, which one round that a burst
    of noise hit does not move; with the samples, also its requests' end-to-end speed-up over the same
    requests of the other (`paired_e2e_speedup`)."""
    spec = summary.get("speculative", {})
    against = {}
    for target in summary:
        if target in ("speculative", BASELINE, BASELINE_REPEAT):
            continue
        rows = {}
        for c in sorted(set(spec) & set(summary[target])):
            mine, theirs = spec[c], summary[target][c]
            by_round = _throughput_ratio_by_round(mine, theirs)
            rows[c] = {"throughput_ratio": mine["output_tokens_per_s"] / theirs["output_tokens_per_s"],
                       "throughput_ratio_by_round": by_round,
                       "median_by_round": float(np.median(list(by_round.values()))) if by_round else None}
            if samples is not None:
                rows[c] |= paired_e2e_speedup(samples, "speculative", target, c)
        against[target] = rows
    return against


def paired_e2e_speedup(samples: list[dict], mine: str, theirs: str, concurrency: int) -> dict:
    """The geometric mean of theirs' end-to-end time over mine's for the same request: with common prompts
    (`--prompt-seed`) a user's n-th request in a round asks both targets the same prompt, so the pair
    differs by target, not by prompt. Pairs are matched by (round, user, turn) with the same prompt id and
    both answered; a user's turns are its requests in order of start, failed ones included (each drew
    its prompt). {"paired_e2e_speedup": x or None, "pairs": n}."""
    turns: dict = {}
    for s in sorted((s for s in samples if int(s["concurrency"]) == concurrency and s["target"] in (mine, theirs)
                     and s.get("prompt_id")), key=lambda s: float(s["start"])):
        turns.setdefault((s["target"], int(s.get("round") or 0), int(s["user"])), []).append(s)
    logs = [math.log(float(b["e2e_s"]) / float(a["e2e_s"]))
            for (target, r, user), requests in turns.items() if target == mine
            for a, b in zip(requests, turns.get((theirs, r, user), []))
            if a["prompt_id"] == b["prompt_id"] and _is_ok(a) and _is_ok(b) and float(a["e2e_s"]) > 0]
    return {"paired_e2e_speedup": math.exp(sum(logs) / len(logs)) if logs else None, "pairs": len(logs)}


COST_MODEL_KEYS = ("target_cost_ms", "draft_cost_ms", "engine_cost_ms", "engine_acceptance_per_position")


def engine_counters(before: dict, after: dict) -> dict:
    """What a speculative model's engines did during one level, from each replica's /v1/specserve/stats
    before and after ({replica tag: stats}), summed over the replicas: the chosen-K histogram
    (request-steps per K), the share of engine steps in which any request drafted, and the share of
    finished requests that drafted at least once. A replica that started during the level counts from
    zero; one that stopped took its counts with it (`replicas_lost`)."""
    counters = ("chosen_k_histogram", "steps", "steps_drafted", "finished_requests", "finished_requests_drafted")
    gained = {}  # replica tag -> what its counters gained
    for tag, now in after.items():
        was = before.get(tag) or {}
        gained[tag] = {key: np.subtract(now[key], was.get(key, 0)) for key in counters}
    total = {key: sum(g[key] for g in gained.values()) for key in counters}
    histogram = [int(n) for n in total["chosen_k_histogram"]] if gained else []
    # the adaptive policy's fitted step costs at the level's end, from the replica that ran most steps
    busiest = max(gained, key=lambda tag: gained[tag]["steps"], default=None)
    lost = sorted(set(before) - set(after))
    return {
        "k_histogram": histogram,
        "mean_k": sum(k * n for k, n in enumerate(histogram)) / max(sum(histogram), 1),
        "drafted_step_share": float(total["steps_drafted"] / max(total["steps"], 1)),
        "drafted_request_share": float(total["finished_requests_drafted"] / max(total["finished_requests"], 1)),
        "replicas": len(after),
        **({"replicas_lost": lost} if lost else {}),
        **{key: after[busiest][key] for key in COST_MODEL_KEYS if busiest is not None and key in after[busiest]},
    }


def capacity(summary: dict, slo_p95_e2e_s: float, target_rps: float | None = None) -> dict:
    """Per target: the highest concurrency whose P95 end-to-end latency is within the SLO, the request
    rate one replica sustains there, and the replicas needed for target_rps."""
    plan = {}
    for target, levels in summary.items():
        within = [c for c, s in sorted(levels.items()) if s["p95_e2e_s"] <= slo_p95_e2e_s and s["failures"] == 0]
        best = max(within) if within else None
        rps = levels[best]["requests_per_s"] if best is not None else 0.0
        replicas = (math.ceil(target_rps / rps) if rps > 0 else None) if target_rps else None
        plan[target] = {
            "max_concurrency_within_slo": best,
            "requests_per_s_per_replica": rps,
            "replicas_for_target": replicas,
            "autoscaling": autoscaling_config(best, replicas),
        }
    return {"slo_p95_e2e_s": slo_p95_e2e_s, "target_requests_per_s": target_rps, "targets": plan}


def autoscaling_config(concurrency_within_slo: int | None, replicas_for_target: int | None) -> dict | None:
    """Ray Serve settings for a model measured on one replica: scale to keep each replica at the highest
    concurrency that met the SLO (target_ongoing_requests); let a replica take half as many again while
    a new one starts (max_ongoing_requests: Serve's autoscaler needs head room above its target to see
    load build up); enough replicas for the target rate at that concurrency (max_replicas)."""
    if not concurrency_within_slo:
        return None
    return {"target_ongoing_requests": concurrency_within_slo,
            "max_ongoing_requests": math.ceil(1.5 * concurrency_within_slo),
            "min_replicas": 1, "max_replicas": max(replicas_for_target or 1, 1)}


def write_outputs(out_dir: Path, summary: dict, speed: dict, plan: dict | None, extra: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(
        {"summary": summary, "speedup": speed, "capacity": plan, **extra}, indent=2, default=str))
    _charts(out_dir, summary, speed, extra)
    (out_dir / "report.md").write_text(markdown(summary, speed, plan, extra))


def _k_shares(engine: dict | None) -> str:
    if not engine:
        return "-"
    total = max(sum(engine["k_histogram"]), 1)
    return " ".join(f"{n / total:.2f}" for n in engine["k_histogram"])


def markdown(summary: dict, speed: dict, plan: dict | None, extra: dict) -> str:
    lines = ["# specserve load test", "", f"**{chart_title(extra)}**", ""]
    for k, v in extra.items():
        lines.append(f"- {k}: {v}")
    lines += ["", "| target | concurrency | requests | failures | measured s | P50 e2e s | P95 e2e s | P50 TPOT ms | "
              "output tok/s | acceptance | drafted steps | drafted requests | mean K | chosen K shares (0, 1, ...) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for target, levels in summary.items():
        for c, s in levels.items():
            acc = "-" if s["acceptance_rate"] is None else f"{s['acceptance_rate']:.2f}"
            engine = s.get("engine")
            shares = (f"{engine['drafted_step_share']:.2f} | {engine['drafted_request_share']:.2f} | {engine['mean_k']:.2f}"
                      if engine else "- | - | -")
            lines.append(f"| {target} | {c} | {s['requests']} | {s['failures']} | {s['measured_s']:.1f} | {s['p50_e2e_s']:.3f} | "
                         f"{s['p95_e2e_s']:.3f} | {s['p50_tpot_s'] * 1e3:.1f} | {s['output_tokens_per_s']:.1f} | {acc} | "
                         f"{shares} | {_k_shares(engine)} |")
    lines += ["", "Against the baseline (above 1.00x: better than the baseline; with more than one round, the "
              "percentiles pool every round's requests, and each round's throughput is also set against the "
              "baseline's in the same round):", "",
              "| target | concurrency | throughput | throughput by round | P50 e2e speed-up | P95 e2e speed-up |",
              "|---|---|---|---|---|---|"]
    for target, result in speed["by_target"].items():
        for c, r in result["by_concurrency"].items():
            rounds = " / ".join(f"{x:.2f}" for x in r.get("throughput_ratio_by_round", {}).values()) or "-"
            lines.append(f"| {target} | {c} | {r['throughput_ratio']:.2f}x | {rounds} | {r['p50_e2e_speedup']:.2f}x | "
                         f"{r['p95_e2e_speedup']:.2f}x |")
    if speed.get("speculative_against"):
        lines += ["", "The speculative model against each compared one (its throughput over theirs: pooled, each "
                  "round's within that round, and the median of the rounds', which drift between rounds does not move; "
                  "and the same requests' end-to-end speed-up, the geometric mean over the pairs of requests that "
                  "asked both the same prompt in the same round, user and turn, which the prompts drawn do not move):", "",
                  "| against | concurrency | throughput | by round | median of rounds | same requests' e2e (pairs) |",
                  "|---|---|---|---|---|---|"]
        for target, rows in speed["speculative_against"].items():
            for c, r in rows.items():
                rounds = " / ".join(f"{x:.2f}" for x in r["throughput_ratio_by_round"].values()) or "-"
                median = "-" if r["median_by_round"] is None else f"{r['median_by_round']:.2f}x"
                paired = "-" if r.get("paired_e2e_speedup") is None else f"{r['paired_e2e_speedup']:.2f}x ({r['pairs']})"
                lines.append(f"| {target} | {c} | {r['throughput_ratio']:.2f}x | {rounds} | {median} | {paired} |")
    if BASELINE_REPEAT in speed["by_target"]:
        lines += ["", f"The {BASELINE_REPEAT} rows are the same baseline measured again: their distance from 1.00x "
                  "is this machine's noise."]
    cross = speed["crossover_concurrency"]
    lines += ["", f"Crossover (speculation stops paying): {'none within the tested range' if cross is None else f'concurrency {cross}'}."]
    if plan:
        lines += ["", f"## Capacity for P95 end-to-end latency <= {plan['slo_p95_e2e_s']} s", "",
                  "| target | max concurrency within SLO | requests/s per replica | replicas for "
                  f"{plan['target_requests_per_s']} req/s |", "|---|---|---|---|"]
        for target, p in plan["targets"].items():
            lines.append(f"| {target} | {p['max_concurrency_within_slo']} | {p['requests_per_s_per_replica']:.2f} | "
                         f"{p['replicas_for_target']} |")
        lines += ["", "### Autoscaling", "",
                  "Per model, for its `deployment_config` (target_ongoing_requests: the highest concurrency within "
                  "the SLO; max_ongoing_requests: 1.5x that, head room while a replica starts; max_replicas: "
                  "replicas for the target rate):", ""]
        for target, p in plan["targets"].items():
            a = p.get("autoscaling")
            lines.append(f"- {target}: " + ("no tested concurrency met the SLO" if a is None else
                         f"`max_ongoing_requests: {a['max_ongoing_requests']}, autoscaling_config: "
                         f"{{min_replicas: {a['min_replicas']}, max_replicas: {a['max_replicas']}, "
                         f"target_ongoing_requests: {a['target_ongoing_requests']}}}`"))
    lines += ["", "Charts: speedup.png (the speed-ups, read this first), latency.png, tpot.png, throughput.png", ""]
    return "\n".join(lines)


def chart_title(extra: dict) -> str:
    """What was measured, in one line: models, K policy, output length, time per point."""
    parts = [extra.get("models_label") or "specserve", f"K policy {extra.get('k_policy', '?')}"]
    parts.append(f"{extra.get('max_tokens', '?')} output tokens, temperature {extra.get('temperature', '?')}")
    rounds = extra.get("rounds") or 1
    parts.append(f"{extra.get('duration_s', '?')} s per point" + (f" x {rounds} rounds" if rounds > 1 else ""))
    return " · ".join(str(p) for p in parts)


def _concurrency_axis(ax, levels) -> None:
    """Concurrency on a log-2 axis, ticked with the plain numbers measured (1, 2, 4, not 2^0, 2^1)."""
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(sorted(levels)))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("concurrency (requests in flight)")


def _charts(out_dir: Path, summary: dict, speed: dict, extra: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    title = chart_title(extra or {})
    levels = sorted({c for target in summary.values() for c in target})

    def plot(name, ylabel, series):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, xs, ys, style in series:
            ax.plot(xs, ys, style, marker="o", label=label)
        _concurrency_axis(ax, levels)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=8)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
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

    # The speed-up chart: one panel per measure, one line per target, break-even at 1.
    measures = (("throughput_ratio", "throughput"), ("p50_e2e_speedup", "P50 end-to-end"),
                ("p95_e2e_speedup", "P95 end-to-end"))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), sharey=True)
    noise = speed["by_target"].get(BASELINE_REPEAT, {}).get("by_concurrency", {})
    for ax, (key, label) in zip(axes, measures):
        if noise:
            band = max(abs(r[key] - 1.0) for r in noise.values())
            ax.axhspan(1 - band, 1 + band, color="grey", alpha=0.15, label=f"noise band (±{band:.2f})")
        ax.axhline(1.0, color="black", linestyle=":", linewidth=1.2, label="break-even (baseline)")
        for target, result in speed["by_target"].items():
            if target == BASELINE_REPEAT:
                continue
            xs = sorted(result["by_concurrency"])
            ax.plot(xs, [result["by_concurrency"][c][key] for c in xs], marker="o",
                    linewidth=2.5 if target == "speculative" else 1.2, label=target)
        _concurrency_axis(ax, levels)
        ax.set_title(f"{label} speed-up over the baseline")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("speed-up (x), above 1 is better")
    axes[-1].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out_dir / "speedup.png", dpi=100)
    plt.close(fig)
