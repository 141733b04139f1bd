"""`specserve bench`: plain vLLM, this plugin (adaptive K, fixed K, and "off": speculation configured
but no request ever drafting, which measures what the plumbing costs), vLLM's own `draft_model` and
`ngram` methods, in one process and one run, on the held-out prompts: output tokens/s, mean acceptance
length, acceptance rate and (ours) the chosen-K histogram per configuration, batch size and temperature.

vLLM's own methods are measured as shipped. On the CPU build their output at temperature > 0 does not
follow the target's distribution (see the README), so their tokens/s there is not a like-for-like
comparison; it is reported anyway, marked.
"""

import json
import time

from deployment.defaults import DEMO_DRAFT, DEMO_TARGET
from loadtest import load_prompts
from specserve.engines import engine_kwargs, shutdown_llm, start_llm

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")


def configurations(k: int, profile: bool = False, target: str = DEMO_TARGET, draft: str = DEMO_DRAFT) -> dict[str, dict]:
    pair = {"target": target, "draft": draft}
    return {
        "plain": engine_kwargs(False, target=target),
        "specserve": engine_kwargs(True, k, **pair, profile_steps=profile),
        "specserve-fixed": engine_kwargs(True, k, **pair, profile_steps=profile, k_policy="fixed"),
        "specserve-off": engine_kwargs(True, k, **pair, profile_steps=profile, k_policy="off"),
        "specserve-compiled": engine_kwargs(True, k, **pair, profile_steps=profile, compile_draft="on"),
        "vllm-draft_model": engine_kwargs(False, target=target) | {"speculative_config": {
            "method": "draft_model", "model": str(draft), "num_speculative_tokens": k}},
        "vllm-ngram": engine_kwargs(False, target=target) | {"speculative_config": {
            "method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 5}},
    }


def _counters(llm) -> dict[str, float]:
    totals = dict.fromkeys(SPEC_COUNTERS, 0.0)
    for metric in llm.get_metrics():
        if metric.name in totals:
            totals[metric.name] += metric.value
    return totals


def _draft_stats(llm, ours: bool) -> dict | None:
    """The speculator's counters and phase times (only our worker answers specserve_stats)."""
    return llm.collective_rpc("specserve_stats")[0] if ours else None


def step_profile(before: dict, after: dict, seconds: float) -> dict:
    """Per draft step: ms in each phase and in all drafting, and drafting's share of the wall time."""
    steps = max(after["steps"] - before["steps"], 1)
    phases = {name: (after["profile_seconds"][name] - before["profile_seconds"][name]) * 1e3 / steps
              for name in after["profile_seconds"]}
    draft_s = after["draft_seconds"] - before["draft_seconds"]
    return {"steps": steps, "step_ms": seconds * 1e3 / steps, "draft_ms": draft_s * 1e3 / steps,
            "draft_share": draft_s / seconds, "phases_ms": phases}


def run_config(name, kwargs, prompts, batch_sizes, temperatures, new_tokens, requests_per_point, log):
    from vllm import SamplingParams

    llm = start_llm(seed=0, **kwargs)
    rows = []
    try:
        llm.generate(prompts[:2], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
        for temperature in temperatures:
            for batch in batch_sizes:
                params = SamplingParams(temperature=temperature, max_tokens=new_tokens, ignore_eos=True, seed=None)
                n_batches = max(1, requests_per_point // batch)
                before, draft_before = _counters(llm), _draft_stats(llm, name.startswith("specserve"))
                start = time.perf_counter()
                tokens = 0
                for b in range(n_batches):
                    chunk = [prompts[(b * batch + i) % len(prompts)] for i in range(batch)]
                    outs = llm.generate(chunk, params, use_tqdm=False)
                    tokens += sum(len(o.outputs[0].token_ids) for o in outs)
                seconds = time.perf_counter() - start
                after, draft_after = _counters(llm), _draft_stats(llm, name.startswith("specserve"))
                drafts, drafted, accepted = (after[c] - before[c] for c in SPEC_COUNTERS)
                row = {
                    "config": name, "batch": batch, "temperature": temperature,
                    "requests": n_batches * batch, "output_tokens": tokens, "seconds": round(seconds, 3),
                    "tokens_per_s": round(tokens / seconds, 2),
                    "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
                    "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
                }
                if draft_before:
                    row["k_histogram"] = [a - b for a, b in zip(draft_after["chosen_k_histogram"],
                                                                draft_before["chosen_k_histogram"])]
                if draft_before and draft_after.get("profile_enabled"):
                    row["profile"] = step_profile(draft_before, draft_after, seconds)
                rows.append(row)
                log(row)
    finally:
        shutdown_llm(llm)
    return rows


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
    print("* vLLM's own speculation at temperature > 0 on the CPU build does not reproduce the target's "
          "distribution; not like for like.")
    profiled = [r for r in rows if "profile" in r]
    if profiled:
        phases = list(profiled[0]["profile"]["phases_ms"])
        print("\nspecserve draft step profile, ms per engine step (draft share = drafting / wall time)")
        print(f"{'batch':>6}{'temp':>6}{'step':>8}{'draft':>8}{'share':>7}" + "".join(f"{p:>14}" for p in phases))
        for r in profiled:
            prof = r["profile"]
            print(f"{r['batch']:>6}{r['temperature']:>6.1f}{prof['step_ms']:>8.2f}{prof['draft_ms']:>8.2f}"
                  f"{prof['draft_share']:>7.0%}" + "".join(f"{prof['phases_ms'][p]:>14.3f}" for p in phases))


def main(args) -> int:
    import sys

    prompts = [p["prompt"] for p in load_prompts()]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    configs = configurations(args.k, profile=args.profile)
    names = args.configs.split(",") if args.configs else ["plain", "specserve", "specserve-fixed", "vllm-draft_model", "vllm-ngram"]
    unknown = set(names) - set(configs)
    if unknown:
        print(f"specserve bench: unknown configs {sorted(unknown)}; choose from {sorted(configs)}", file=sys.stderr)
        return 2
    rows = []
    for name in names:
        print(f"[bench] {name}: starting engine", file=sys.stderr, flush=True)
        rows += run_config(name, configs[name], prompts, batch_sizes, temperatures, args.new_tokens,
                           args.requests, lambda r: print(f"[bench] {r}", file=sys.stderr, flush=True))
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"k": args.k, "new_tokens": args.new_tokens, "rows": rows}, f, indent=2)
    return 0
