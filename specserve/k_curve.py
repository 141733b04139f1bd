"""`specserve k-curve`: on one adaptive engine, the adaptive choice against every fixed K, on the same
prompts, beside what the policy's step-cost model expects of each K.

Separate engines (`specserve bench --configs specserve,specserve-fixed:3,...`) differ in more than K:
each warms up, calibrates and is scheduled by the machine on its own. Here one engine runs every K in
turn (`specserve_force_k`), each round in a shuffled order on that round's prompts, with prefix
caching off so that no K finds another's prompts already cached. The table shows where the measured
curve peaks, how flat it is near the top, and whether the model's curve has the same shape.

It shows each K twice: over the whole point, and over its decode steps alone (the whole batch decoding,
no prompt: `plugin.step_log.decode_goodput`, from the worker's step log). The second is what the
policy decides about: with every finished request replaced at once, steps that prefill a prompt took
about half of a batch-16 point here and cost the same whatever K, which dilutes the point's differences
between K and adds the noise of where the prompts fall.
"""

import json
import random
import sys

from deployment.defaults import DEMO_NUM_SPECULATIVE_TOKENS
from loadtest import load_prompts
from plugin.step_log import decode_goodput
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
                    llm.collective_rpc("specserve_take_step_log")  # start the point's log empty
                    point = measure_point(llm, "specserve", prompts, batch, temperature, new_tokens, 0, first)
                    decode = decode_goodput(llm.collective_rpc("specserve_take_step_log")[0], batch)
                    row = {"k": ADAPTIVE if k is None else k, "batch": batch, "round": r,
                           "tokens_per_s": point["tokens_per_s"],
                           "decode_tokens_per_s": decode["tokens_per_s"], "decode_step_ms": decode["step_ms"],
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
    round (median), the same for decode steps alone (`decode_goodput`: the steps with the whole batch
    decoding and no prompt), the mean acceptance length, and the model's expectation (its last round)."""
    from statistics import median

    def of_best(points, key):
        ratios = [r[key] / best[key][r["round"]] for r in points if r.get(key) and best[key].get(r["round"])]
        return median(ratios) if ratios else None

    out = []
    for batch in sorted({r["batch"] for r in rows}):
        measured = [r for r in rows if r["batch"] == batch and "tokens_per_s" in r]
        rounds = sorted({r["round"] for r in measured})
        best = {key: {rd: max((r.get(key) or 0.0 for r in measured if r["round"] == rd and r["k"] != ADAPTIVE), default=0.0)
                      for rd in rounds} for key in ("tokens_per_s", "decode_tokens_per_s")}
        model = {r["k"]: r for r in rows if r["batch"] == batch and "model_step_ms" in r}
        model_best = max((m["model_tokens_per_s"] for m in model.values()), default=None)
        for k in [ADAPTIVE, *sorted(k for k in {r["k"] for r in measured} if k != ADAPTIVE)]:
            points = [r for r in measured if r["k"] == k]
            lengths = [r["mean_acceptance_length"] for r in points if r["mean_acceptance_length"]]
            decode_ms = [r["decode_step_ms"] for r in points if r.get("decode_step_ms")]
            m = model.get(k)
            out.append({"batch": batch, "k": k, "tokens_per_s": median(r["tokens_per_s"] for r in points),
                        "of_best_fixed": of_best(points, "tokens_per_s"),
                        "decode_of_best_fixed": of_best(points, "decode_tokens_per_s"),
                        "decode_step_ms": median(decode_ms) if decode_ms else None,
                        "mean_acceptance_length": sum(lengths) / len(lengths) if lengths else None,
                        "model_step_ms": m and m["model_step_ms"],
                        "model_of_best": m and model_best and m["model_tokens_per_s"] / model_best})
    return out


def print_summary(summary: list[dict]) -> None:
    print(f"{'batch':>5} {'K':>9} {'tok/s':>8} {'of best fixed':>14} {'decode: of best':>16} {'step ms':>8} "
          f"{'accept len':>11} {'model step ms':>14} {'model of best':>14}")
    for s in summary:
        fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
        print(f"{s['batch']:>5} {s['k']!s:>9} {s['tokens_per_s']:>8.1f} {fmt(s['of_best_fixed'], '.2f'):>13}x "
              f"{fmt(s['decode_of_best_fixed'], '.2f'):>15}x {fmt(s['decode_step_ms'], '.1f'):>8} "
              f"{fmt(s['mean_acceptance_length'], '.2f'):>11} {fmt(s['model_step_ms'], '.2f'):>14} "
              f"{fmt(s['model_of_best'], '.2f'):>14}")
    print("tok/s: median over rounds; of best fixed: within each round, median; decode: the same over the steps "
          "in which the whole batch decoded (no prompt), with their measured step ms; model: the policy's step-cost "
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
