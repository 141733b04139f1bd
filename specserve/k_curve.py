"""`specserve k-curve`: on one adaptive engine, the adaptive choice against every fixed K, on the same
prompts, beside what the policy's step-cost model expects of each K.

Separate engines (`specserve bench --configs specserve,specserve-fixed:3,...`) differ in more than K:
each warms up, calibrates and is scheduled by the machine on its own. Here one engine runs every K in
turn (`specserve_force_k`), each round in a shuffled order on that round's prompts, with prefix
caching off so that no K finds another's prompts already cached. The table shows where the measured
curve peaks, how flat it is near the top, and whether the model's curve has the same shape.
"""

import json
import random
import sys

from deployment.defaults import DEMO_NUM_SPECULATIVE_TOKENS
from loadtest import load_prompts
from specserve.arguments import positive_ints
from specserve.bench import configurations, measure_point, requests_at, start_engine
from specserve.engines import shutdown_llm

ADAPTIVE = "adaptive"


def run(batch_sizes: list[int], k_max: int, rounds: int, temperature: float, new_tokens: int, log, seed: int = 0) -> list[dict]:
    prompts = [p["prompt"] for p in load_prompts()]
    llm = start_engine(configurations(k_max)["specserve"] | {"enable_prefix_caching": False}, prompts)
    order_rng, rows, first = random.Random(seed), [], 0
    try:
        for r in range(rounds):
            for batch in batch_sizes:
                ks = [None, *range(k_max + 1)]
                order_rng.shuffle(ks)
                for k in ks:  # every K on the same prompts: this round's, from `first`
                    llm.collective_rpc("specserve_force_k", args=(k,))
                    point = measure_point(llm, "specserve", prompts, batch, temperature, new_tokens, 0, first)
                    row = {"k": ADAPTIVE if k is None else k, "batch": batch, "round": r,
                           "tokens_per_s": point["tokens_per_s"],
                           "mean_acceptance_length": point["mean_acceptance_length"]}
                    rows.append(row)
                    log(row)
                model = llm.collective_rpc("specserve_model_curve", args=(batch,))[0]
                rows += [{"k": m["k"], "batch": batch, "round": r, "model_step_ms": m["step_ms"],
                          "model_tokens_per_s": m["tokens_per_s"]} for m in model]
                first += requests_at(batch)
    finally:
        llm.collective_rpc("specserve_force_k", args=(None,))
        shutdown_llm(llm)
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    """Per batch size and K: median tokens/s over rounds, its ratio to the best fixed K's within each
    round (median), the mean acceptance length, and the model's expectation (its last round)."""
    from statistics import median

    out = []
    for batch in sorted({r["batch"] for r in rows}):
        measured = [r for r in rows if r["batch"] == batch and "tokens_per_s" in r]
        rounds = sorted({r["round"] for r in measured})
        best = {rd: max(r["tokens_per_s"] for r in measured if r["round"] == rd and r["k"] != ADAPTIVE) for rd in rounds}
        model = {r["k"]: r for r in rows if r["batch"] == batch and "model_step_ms" in r}
        model_best = max((m["model_tokens_per_s"] for m in model.values()), default=None)
        for k in [ADAPTIVE, *sorted(k for k in {r["k"] for r in measured} if k != ADAPTIVE)]:
            points = [r for r in measured if r["k"] == k]
            lengths = [r["mean_acceptance_length"] for r in points if r["mean_acceptance_length"]]
            m = model.get(k)
            out.append({"batch": batch, "k": k, "tokens_per_s": median(r["tokens_per_s"] for r in points),
                        "of_best_fixed": median(r["tokens_per_s"] / best[r["round"]] for r in points),
                        "mean_acceptance_length": sum(lengths) / len(lengths) if lengths else None,
                        "model_step_ms": m and m["model_step_ms"],
                        "model_of_best": m and model_best and m["model_tokens_per_s"] / model_best})
    return out


def print_summary(summary: list[dict]) -> None:
    print(f"{'batch':>5} {'K':>9} {'tok/s':>8} {'of best fixed':>14} {'accept len':>11} "
          f"{'model step ms':>14} {'model of best':>14}")
    for s in summary:
        fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
        print(f"{s['batch']:>5} {s['k']!s:>9} {s['tokens_per_s']:>8.1f} {s['of_best_fixed']:>13.2f}x "
              f"{fmt(s['mean_acceptance_length'], '.2f'):>11} {fmt(s['model_step_ms'], '.2f'):>14} "
              f"{fmt(s['model_of_best'], '.2f'):>14}")
    print("tok/s: median over rounds; of best fixed: within each round, median; model: the policy's step-cost "
          "model at each K with the engine's acceptance (step ms of a decode step, tokens/s relative to its best K)")


def add_arguments(p) -> None:
    p.add_argument("--batch-sizes", type=positive_ints, default="1,4,16", help="requests in flight")
    p.add_argument("--k", type=int, default=DEMO_NUM_SPECULATIVE_TOKENS, help="K_max: fixed K runs 0..K_max")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--json", metavar="PATH")


def main(args) -> int:
    if args.k < 1 or args.rounds < 1:
        print("specserve k-curve: need --k >= 1 and --rounds >= 1", file=sys.stderr)
        return 2
    log = lambda r: print(f"[k-curve] {r}", file=sys.stderr, flush=True)  # noqa: E731
    rows = run(args.batch_sizes, args.k, args.rounds, args.temperature, args.new_tokens, log)
    summary = summarise(rows)
    print_summary(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"k_max": args.k, "temperature": args.temperature, "rows": rows, "summary": summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit("run it as `specserve k-curve`")
