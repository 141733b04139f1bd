"""`specserve`: the project's command line. Each subcommand imports what it needs when it runs."""

import argparse
import importlib
import json
import sys
from pathlib import Path

from deployment.defaults import MODELS_DIR
from loadtest import PROMPTS_FILE
from specserve.arguments import positive_int, positive_ints, temperatures


def _cmd_math(args) -> int:
    from plugin.speculation_math import expected_tokens, optimal_k, optimal_k_table

    if args.table:
        rows = optimal_k_table(args.max_k)
    elif args.alpha is None or args.c is None:
        print("specserve math: give --alpha and --c, or --table", file=sys.stderr)
        return 2
    else:
        if not 0.0 <= args.alpha < 1.0 or args.c <= 0:
            print("specserve math: need 0 <= alpha < 1 and c > 0", file=sys.stderr)
            return 2
        k, s = optimal_k(args.alpha, args.c, args.max_k)
        rows = [{"alpha": args.alpha, "c": args.c, "k": k, "speedup": round(s, 4),
                 "expected_tokens": round(expected_tokens(args.alpha, k), 4)}]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'alpha':>6} {'c':>6} {'optimal k':>10} {'speed-up':>9}")
    for r in rows:
        print(f"{r['alpha']:>6.2f} {r['c']:>6g} {r['k']:>10d} {r['speedup']:>8.2f}x")
    return 0


def _run(module: str):
    """A subcommand whose module's main(args) runs it, imported only when it runs."""
    def run(args) -> int:
        return importlib.import_module(module).main(args)

    return run


def _cmd_make_prompts(args) -> int:
    from specserve.demo.prompts import write_prompts

    prompts = write_prompts(Path(args.out))
    print(f"wrote {len(prompts)} prompts to {args.out}")
    return 0


def _cmd_train_demo(args) -> int:
    from specserve.demo.train import DRAFT_STEPS, TARGET_STEPS, distil_draft, train_demo

    draft_steps = DRAFT_STEPS if args.draft_steps is None else args.draft_steps
    if args.draft_only:
        distil_draft(Path(args.out), draft_steps=draft_steps, seed=args.seed)
    else:
        target_steps = TARGET_STEPS if args.target_steps is None else args.target_steps
        train_demo(Path(args.out), vocab_size=args.vocab_size, target_steps=target_steps,
                   draft_steps=draft_steps, seed=args.seed)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("math", help="optimal draft length and speed-up from alpha and cost ratio c")
    p.add_argument("--alpha", type=float, help="acceptance rate, sum(min(p, q))")
    p.add_argument("--c", type=float, help="cost ratio: target step time / draft step time")
    p.add_argument("--max-k", type=int, default=20)
    p.add_argument("--table", action="store_true", help="the seeds' table: alpha 0.6-0.9 x c 10/20/50")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_math)

    p = sub.add_parser("bench-sampler", help="time the exact rejection sampler against plain sampling")
    p.add_argument("--batch-sizes", type=positive_ints, default="1,8,32,64")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(func=_run("specserve.bench_sampler"))

    p = sub.add_parser("bench", help="plain vLLM vs this plugin vs vLLM's draft_model and ngram methods")
    p.add_argument("--k", type=int, default=6, help="num_speculative_tokens: K_max for adaptive K (the demo pair's default)")
    p.add_argument("--batch-sizes", type=positive_ints, default="1,4,16,32")
    p.add_argument("--temperatures", type=temperatures, default="0,0.7")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--requests", type=int, default=0,
                   help="requests per (batch size, temperature) point (default: max(16, 3 x batch size))")
    p.add_argument("--configs", help="comma-separated subset of plain, specserve (adaptive K), specserve-fixed, "
                   "specserve-off (K = 0 always), specserve-nofloor (adaptive, no request speed floor), specserve-anygain (adaptive, acting on any modelled gain over K_max), specserve-compiled, specserve-eager (no native draft forward), vllm-draft_model, vllm-ngram, each optionally "
                   "with its own K (specserve-fixed:3) (default: plain, specserve, specserve-fixed, "
                   "vllm-draft_model, vllm-ngram)")
    p.add_argument("--profile", action="store_true", help="time each phase of specserve's draft step")
    p.add_argument("--rounds", type=int, default=1,
                   help="N >= 2: every engine started at once and the points measured round-robin N times, "
                        "ratios taken within each round (median [min-max]); for a machine whose speed drifts")
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(func=_run("specserve.bench"))

    p = sub.add_parser("measure-pair", help="alpha, greedy match and cost ratio c of the demo pair")
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(func=_run("specserve.demo.measure"))

    p = sub.add_parser("make-prompts", help="cut the held-out prompts file from held-out stdlib files")
    p.add_argument("--out", default=str(PROMPTS_FILE))
    p.set_defaults(func=_cmd_make_prompts)

    p = sub.add_parser("loadtest", help="Locust, headless: speculative vs baseline at each concurrency")
    from specserve.loadtest_runner import add_arguments

    add_arguments(p)
    p.set_defaults(func=_run("specserve.loadtest_runner"))

    p = sub.add_parser("soak", help="mixed traffic for a chosen time: failures, latency over time, replica memory; "
                       "optionally an engine killed mid-run and the recovery timeline")
    from specserve.soak import add_arguments as soak_arguments

    soak_arguments(p)
    p.set_defaults(func=_run("specserve.soak"))

    p = sub.add_parser("bench-serve", help="speculative vs baseline on the running application, measured by vLLM's "
                       "own bench serve client on prompts the demo pair never saw")
    from specserve.bench_serve import add_arguments as bench_serve_arguments

    bench_serve_arguments(p)
    p.set_defaults(func=_run("specserve.bench_serve"))

    p = sub.add_parser("burst", help="N simultaneous streams at once: how the application pushes back")
    from specserve.burst import add_arguments as burst_arguments

    burst_arguments(p)
    p.set_defaults(func=_run("specserve.burst"))

    p = sub.add_parser("trace", help="one speculative request's steps, coloured: accepted, rejected, recovered, bonus")
    from specserve.trace import add_arguments as trace_arguments

    trace_arguments(p)
    p.set_defaults(func=_run("specserve.trace"))

    p = sub.add_parser("bench-trace", help="what the per-step trace costs: the worker's hooks off and on, and end to end")
    from specserve.bench_trace import add_arguments as bench_trace_arguments

    bench_trace_arguments(p)
    p.set_defaults(func=_run("specserve.bench_trace"))

    p = sub.add_parser("k-curve", help="one adaptive engine: the adaptive choice against every fixed K on the same "
                       "prompts, beside the step-cost model's curve")
    from specserve.k_curve import add_arguments as k_curve_arguments

    k_curve_arguments(p)
    p.set_defaults(func=_run("specserve.k_curve"))

    p = sub.add_parser("verify", help="prove a target/draft pair lossless on this machine and size it")
    from specserve.verify import add_arguments as verify_arguments

    verify_arguments(p)
    p.set_defaults(func=_run("specserve.verify"))

    p = sub.add_parser("train-demo", help="train the shipped demo tokenizer, target and draft")
    p.add_argument("--out", default=str(MODELS_DIR))
    p.add_argument("--vocab-size", type=int, default=4096)
    stages = p.add_mutually_exclusive_group()  # --draft-only trains no target: its steps would be ignored
    stages.add_argument("--target-steps", type=positive_int, help="default: specserve.demo.train.TARGET_STEPS")
    stages.add_argument("--draft-only", action="store_true",
                        help="distil a new draft from the target already in OUT/target (stage 3 alone)")
    p.add_argument("--draft-steps", type=positive_int, help="default: specserve.demo.train.DRAFT_STEPS")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_train_demo)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
