"""`specserve bench`: plain vLLM, this plugin (adaptive K, fixed K, and "off": speculation configured
but no request ever drafting, which measures what the plumbing costs), vLLM's own `draft_model` and
`ngram` methods, in one process and one run, on the held-out prompts: output tokens/s, mean acceptance
length, acceptance rate and (ours) the chosen-K histogram per configuration, batch size and temperature.

vLLM's own methods are measured as shipped. On the CPU build their output at temperature > 0 does not
follow the target's distribution (see the README), so their tokens/s there is not a like-for-like
comparison; it is reported anyway, marked.

Batch size B means B requests in flight, a new one joining as soon as one finishes (as on a server),
over max(16, 3 B) requests per point unless `--requests` says otherwise.

A configuration may name its K: `specserve-fixed:3` is fixed K = 3 beside `--k` for the others.
`--rounds N` (N >= 2) starts every configuration's engine at once and measures the points round-robin,
in a shuffled order per point, N times: this machine's speed drifts by 10-30% over minutes, which makes
configurations measured one after another incomparable, while within a round they share the drift.
Ratios are then taken within each round and reported as the median and range over the rounds.
"""

import itertools
import json
import random
import statistics
import time

from deployment.defaults import DEMO_DRAFT, DEMO_TARGET
from loadtest import load_prompts
from specserve.engines import engine_kwargs, shutdown_llm, start_llm

# After its last message an engine's worker process spins on sched_yield for this long, waiting for the
# next (vLLM's shared-memory queue, busy_loop_s): with every engine up at once, the next point waits it
# out rather than share this machine's two cores with the engine measured before it.
WORKER_SPIN_S = 1.0


def configurations(k: int, profile: bool = False, target: str = DEMO_TARGET, draft: str = DEMO_DRAFT) -> dict[str, dict]:
    pair = {"target": target, "draft": draft}
    # Acceptance is read from each request's own summary (as ours gives it): the process-wide Prometheus
    # registry would mix the engines of an interleaved run.
    vllm_own = {"per_request_spec_decode_metrics": "summary"}
    return {
        "plain": engine_kwargs(False, target=target),
        "specserve": engine_kwargs(True, k, **pair, profile_steps=profile),
        "specserve-fixed": engine_kwargs(True, k, **pair, profile_steps=profile, k_policy="fixed"),
        "specserve-off": engine_kwargs(True, k, **pair, profile_steps=profile, k_policy="off"),
        "specserve-nofloor": engine_kwargs(True, k, **pair, profile_steps=profile, request_speed_floor=None),
        "specserve-anygain": engine_kwargs(True, k, **pair, profile_steps=profile, k_max_unless_sure=False),
        "specserve-compiled": engine_kwargs(True, k, **pair, profile_steps=profile, compile_draft="on"),
        "specserve-eager": engine_kwargs(True, k, **pair, profile_steps=profile, native_draft="off"),
        "specserve-f32cache": engine_kwargs(True, k, **pair, profile_steps=profile, draft_cache_dtype="float32"),
        "vllm-draft_model": engine_kwargs(False, target=target) | vllm_own | {"speculative_config": {
            "method": "draft_model", "model": str(draft), "num_speculative_tokens": k}},
        "vllm-ngram": engine_kwargs(False, target=target) | vllm_own | {"speculative_config": {
            "method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 5}},
    }


def _draft_stats(llm, ours: bool) -> dict | None:
    """The speculator's counters and phase times (only our worker answers specserve_stats)."""
    return llm.collective_rpc("specserve_stats")[0] if ours else None


def step_profile(before: dict, after: dict, seconds: float) -> dict:
    """Per engine step: ms in each phase (the target's forward with its logits, verification, the draft's
    phases), in all drafting, and in the rest (the runner's input preparation and bookkeeping, the engine's
    scheduling and output processing); drafting's share of the wall time."""
    steps = max(after["steps"] - before["steps"], 1)
    phases = {name: (after["profile_seconds"][name] - before["profile_seconds"][name]) * 1e3 / steps
              for name in after["profile_seconds"]}
    draft_s = after["draft_seconds"] - before["draft_seconds"]
    step_ms, draft_ms = seconds * 1e3 / steps, draft_s * 1e3 / steps
    rest_ms = step_ms - draft_ms - phases["target_forward"] - phases["verify"]
    return {"steps": steps, "step_ms": step_ms, "draft_ms": draft_ms, "rest_ms": rest_ms,
            "draft_share": draft_s / seconds, "phases_ms": phases}


def config_kwargs(spec: str, k: int, profile: bool) -> dict:
    """Engine kwargs for a configuration name, optionally with its own K after a colon (specserve-fixed:3)."""
    name, _, own_k = spec.partition(":")
    return configurations(int(own_k) if own_k else k, profile=profile)[name]


_request_ids = itertools.count()


def run_concurrently(llm, prompts: list[str], params, concurrency: int) -> dict[str, int]:
    """Every prompt through the engine with `concurrency` requests in flight, a new one joining as soon as
    one finishes, as on a server. (Batches of `concurrency` prompts, each waiting for its slowest request,
    would charge every configuration for its spread of request speeds: a speculator that lets some
    requests finish early would leave its batch part-empty until the last one ends.) Returns output
    tokens and, summed over the requests' speculation summaries, the steps that verified drafts, the
    draft tokens and the accepted ones."""
    engine = llm.llm_engine
    waiting, in_flight = list(prompts), 0
    totals = dict.fromkeys(("tokens", "spec_steps", "draft_tokens", "accepted"), 0)
    while waiting or in_flight:
        while waiting and in_flight < concurrency:
            engine.add_request(f"bench-{next(_request_ids)}", waiting.pop(0), params)
            in_flight += 1
        for output in engine.step():
            if output.finished:
                in_flight -= 1
                totals["tokens"] += len(output.outputs[0].token_ids)
                if (spec := getattr(output.outputs[0], "spec_decode_metrics", None)) is not None:
                    summary = spec.to_dict()
                    totals["spec_steps"] += summary["num_spec_steps"]
                    totals["draft_tokens"] += summary["num_draft_tokens"]
                    totals["accepted"] += summary["num_accepted_draft_tokens"]
    return totals


def requests_at(batch: int, requests_per_point: int = 0) -> int:
    """Requests per point: as asked, or enough for the batch to stay full but for the last wave."""
    return requests_per_point or max(16, 3 * batch)


def measure_point(llm, name, prompts, batch, temperature, new_tokens, requests_per_point, first_prompt=0) -> dict:
    """Tokens/s, acceptance and (ours) K histogram and step profile of one (batch, temperature) point."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=temperature, max_tokens=new_tokens, ignore_eos=True, seed=None)
    requests = requests_at(batch, requests_per_point)
    ours = name.startswith("specserve")
    draft_before = _draft_stats(llm, ours)
    start = time.perf_counter()
    totals = run_concurrently(llm, [prompts[(first_prompt + i) % len(prompts)] for i in range(requests)], params, batch)
    seconds = time.perf_counter() - start
    draft_after = _draft_stats(llm, ours)
    tokens, drafts, drafted, accepted = (totals[c] for c in ("tokens", "spec_steps", "draft_tokens", "accepted"))
    row = {
        "config": name, "batch": batch, "temperature": temperature,
        "requests": requests, "output_tokens": tokens, "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 2),
        "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
        "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
    }
    if draft_before:
        row["k_histogram"] = [a - b for a, b in zip(draft_after["chosen_k_histogram"], draft_before["chosen_k_histogram"])]
    if draft_before and draft_after.get("profile_enabled"):
        row["profile"] = step_profile(draft_before, draft_after, seconds)
    return row


def start_engine(kwargs, prompts):
    """An offline engine from these kwargs, warmed up on two prompts."""
    from vllm import SamplingParams

    llm = start_llm(seed=0, **kwargs)
    llm.generate(prompts[:2], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    return llm


def run_config(name, kwargs, prompts, batch_sizes, temperatures, new_tokens, requests_per_point, log):
    llm = start_engine(kwargs, prompts)
    rows = []
    try:
        for temperature in temperatures:
            for batch in batch_sizes:
                rows.append(measure_point(llm, name, prompts, batch, temperature, new_tokens, requests_per_point))
                log(rows[-1])
    finally:
        shutdown_llm(llm)
    return rows


def run_interleaved(specs: dict[str, dict], prompts, batch_sizes, temperatures, new_tokens, requests_per_point,
                    rounds, log, seed=0):
    """Every configuration's engine at once; each point measured round-robin in a shuffled order, rounds
    times, each round on the next prompts. Rows carry their round."""
    engines = {}
    order_rng = random.Random(seed)
    rows = []
    try:
        for name, kwargs in specs.items():
            log({"starting": name})
            engines[name] = start_engine(kwargs, prompts)
        first_prompt = 0
        for r in range(rounds):
            for temperature in temperatures:
                for batch in batch_sizes:
                    order = list(engines)
                    order_rng.shuffle(order)
                    for name in order:
                        time.sleep(WORKER_SPIN_S)
                        row = measure_point(engines[name], name, prompts, batch, temperature, new_tokens,
                                            requests_per_point, first_prompt) | {"round": r}
                        rows.append(row)
                        log(row)
                    first_prompt += requests_at(batch, requests_per_point)
    finally:
        for llm in engines.values():
            shutdown_llm(llm)
    return rows


def summarise_rounds(rows: list[dict], baseline: str) -> list[dict]:
    """Per configuration and point: median tokens/s over the rounds, and the ratio to the baseline
    taken within each round (both measured under the same drift), as median, min and max."""
    by_key: dict[tuple, dict[int, dict]] = {}
    for r in rows:
        by_key.setdefault((r["config"], r["batch"], r["temperature"]), {})[r.get("round", 0)] = r
    out = []
    for (config, batch, temperature), per_round in by_key.items():
        base = by_key.get((baseline, batch, temperature), {})
        ratios = [row["tokens_per_s"] / base[rnd]["tokens_per_s"] for rnd, row in per_round.items() if rnd in base]
        histograms = [r["k_histogram"] for r in per_round.values() if r.get("k_histogram")]
        out.append({"config": config, "batch": batch, "temperature": temperature, "rounds": len(per_round),
                    "tokens_per_s": statistics.median(r["tokens_per_s"] for r in per_round.values()),
                    "ratio": statistics.median(ratios) if ratios else None,
                    "ratio_range": (min(ratios), max(ratios)) if ratios else None,
                    "k_histogram": [sum(h) for h in zip(*histograms)] if histograms else None})
    return out


NOT_LIKE_FOR_LIKE = ("* vLLM's own speculation at temperature > 0 on the CPU build does not reproduce the target's "
                     "distribution; not like for like.")


def k_shares(histogram: list[int] | None) -> str:
    total = sum(histogram or [])
    return " ".join(f"{n / total:.2f}" for n in histogram) if total else ""


def print_table(rows):
    def by_point(config):
        return {(r["batch"], r["temperature"]): r["tokens_per_s"] for r in rows if r["config"] == config}

    def ratio(value, base):
        return f"{value / base:.2f}x" if base else "-"

    plain, draft_model = by_point("plain"), by_point("vllm-draft_model")
    print(f"{'config':<20}{'batch':>6}{'temp':>6}{'tok/s':>10}{'vs plain':>10}{'vs draft_model':>16}"
          f"{'accept len':>12}{'accept rate':>12}  chosen K: share of request-steps at 0, 1, ...")
    for r in rows:
        point = (r["batch"], r["temperature"])
        mal = "-" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}"
        rate = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        flag = " *" if r["config"].startswith("vllm-") and r["temperature"] > 0 else ""
        print(f"{r['config']:<20}{r['batch']:>6}{r['temperature']:>6.1f}{r['tokens_per_s']:>10.1f}"
              f"{ratio(r['tokens_per_s'], plain.get(point)):>10}{ratio(r['tokens_per_s'], draft_model.get(point)):>16}"
              f"{mal:>12}{rate:>12}{flag}  {k_shares(r.get('k_histogram'))}")
    print(NOT_LIKE_FOR_LIKE)
    print_profile(rows)


def print_profile(rows) -> None:
    """The step profile of every profiled point (ours, with --profile), one line each."""
    from plugin.step_profile import TARGET_PHASES  # imports torch: not at `specserve` start-up

    profiled = [r for r in rows if "profile" in r]
    if profiled:
        draft = [p for p in profiled[0]["profile"]["phases_ms"] if p not in TARGET_PHASES]
        print("\nspecserve step profile, ms per engine step: the target's forward (with its logits) and "
              "verification, drafting (its share of the wall time, then its phases), and the rest (inputs, "
              "bookkeeping, scheduling, outputs)")
        print(f"{'config':<22}{'batch':>6}{'temp':>6}{'round':>6}{'step':>8}" + "".join(f"{p:>16}" for p in TARGET_PHASES)
              + f"{'draft':>8}{'share':>7}" + "".join(f"{p:>14}" for p in draft) + f"{'rest':>8}")
        for r in profiled:
            prof = r["profile"]
            print(f"{r['config']:<22}{r['batch']:>6}{r['temperature']:>6.1f}{r.get('round', '-'):>6}{prof['step_ms']:>8.2f}"
                  + "".join(f"{prof['phases_ms'][p]:>16.3f}" for p in TARGET_PHASES)
                  + f"{prof['draft_ms']:>8.2f}{prof['draft_share']:>7.0%}"
                  + "".join(f"{prof['phases_ms'][p]:>14.3f}" for p in draft) + f"{prof['rest_ms']:>8.2f}")


def print_rounds_table(rows):
    """The interleaved run: median tokens/s, and the within-round ratios to plain and to vLLM's
    draft_model as median [min-max] over the rounds."""
    vs = {base: {(r["config"], r["batch"], r["temperature"]): r for r in summarise_rounds(rows, base)}
          for base in ("plain", "vllm-draft_model")}

    def cell(base, key):
        r = vs[base].get(key)
        if not r or r["ratio"] is None:
            return "-"
        low, high = r["ratio_range"]
        return f"{r['ratio']:.2f}x [{low:.2f}-{high:.2f}]"

    rounds = max(r.get("round", 0) for r in rows) + 1
    print(f"{rounds} interleaved rounds; ratios taken within each round: median [min-max]")
    print(f"{'config':<22}{'batch':>6}{'temp':>6}{'tok/s':>10}{'vs plain':>22}{'vs draft_model':>22}"
          "  chosen K: share of request-steps at 0, 1, ...")
    for key, r in vs["plain"].items():
        flag = " *" if r["config"].startswith("vllm-") and r["temperature"] > 0 else ""
        print(f"{r['config']:<22}{r['batch']:>6}{r['temperature']:>6.1f}{r['tokens_per_s']:>10.1f}"
              f"{cell('plain', key):>22}{cell('vllm-draft_model', key):>22}{flag}  {k_shares(r['k_histogram'])}")
    print(NOT_LIKE_FOR_LIKE)


def main(args) -> int:
    import sys

    prompts = [p["prompt"] for p in load_prompts()]
    batch_sizes, temperatures = args.batch_sizes, args.temperatures
    known = configurations(args.k)
    names = args.configs.split(",") if args.configs else ["plain", "specserve", "specserve-fixed", "vllm-draft_model", "vllm-ngram"]

    def valid(name):
        base, colon, k = name.partition(":")
        return base in known and (not colon or k.isdigit())

    unknown = [n for n in names if not valid(n)]
    if unknown:
        print(f"specserve bench: unknown configs {sorted(unknown)}; choose from {sorted(known)} "
              "(optionally with their own K, as in specserve-fixed:3)", file=sys.stderr)
        return 2
    try:
        specs = {name: config_kwargs(name, args.k, args.profile) for name in names}
    except ValueError as exc:  # a K the speculator refuses (specserve-fixed:0)
        print(f"specserve bench: {exc}", file=sys.stderr)
        return 2
    log = lambda r: print(f"[bench] {r}", file=sys.stderr, flush=True)  # noqa: E731
    if args.rounds > 1:
        rows = run_interleaved(specs, prompts, batch_sizes, temperatures, args.new_tokens, args.requests, args.rounds, log)
        print_rounds_table(rows)
        print_profile(rows)
    else:
        rows = []
        for name, kwargs in specs.items():
            print(f"[bench] {name}: starting engine", file=sys.stderr, flush=True)
            rows += run_config(name, kwargs, prompts, batch_sizes, temperatures, args.new_tokens, args.requests, log)
        print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"k": args.k, "new_tokens": args.new_tokens, "rounds": args.rounds, "rows": rows}, f, indent=2)
    return 0
