"""`specserve bench-trace`: what the per-step trace costs, off and on.

1. The worker's trace hooks alone (`SpeculativeWorker._begin_trace_step` and `_record_trace_step`) per
   engine step, for batches of B decoding requests with K drafts each: none traced (off, what every
   engine pays) and all traced.
2. End to end on a local speculative engine (the demo pair): the same requests untraced and traced,
   over rounds that alternate which goes first, as tokens per second (the median round of each).
"""

import statistics
import time
from types import SimpleNamespace

K = 4


def _step(batch: int) -> tuple[SimpleNamespace, SimpleNamespace]:
    """A decode step's scheduler output and model-runner output, as the worker's hooks read them."""
    ids = [f"req-{i}" for i in range(batch)]
    scheduler_output = SimpleNamespace(
        scheduled_new_reqs=[], num_scheduled_tokens={r: K + 1 for r in ids},
        scheduled_spec_decode_tokens={r: list(range(K)) for r in ids})
    runner_output = SimpleNamespace(req_id_to_index={r: i for i, r in enumerate(ids)},
                                    sampled_token_ids=[[0, 1, 7] for _ in ids])
    return scheduler_output, runner_output


def hook_microseconds(batch: int, traced: bool, steps: int = 20_000) -> float:
    """Mean microseconds per step of the worker's two trace hooks."""
    from plugin.worker import SpeculativeWorker

    worker = object.__new__(SpeculativeWorker)  # the hooks need no engine
    scheduler_output, runner_output = _step(batch)
    if traced:
        for req_id in scheduler_output.num_scheduled_tokens:
            worker.traces.start(req_id, req_id)
        worker.traces.max_steps = steps + 1
    began = time.perf_counter()
    for _ in range(steps):
        worker._begin_trace_step(scheduler_output)
        worker._record_trace_step(runner_output)
    return (time.perf_counter() - began) / steps * 1e6


def end_to_end(requests: int, max_tokens: int, rounds: int) -> dict:
    from vllm import SamplingParams

    from loadtest import load_prompts
    from specserve.engines import build_llm, shutdown_llm
    from specserve.trace import traced_generate

    prompts = [p["prompt"] for p in load_prompts()][:requests]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm = build_llm(speculative=True)
    rates = {"untraced": [], "traced": []}
    try:
        llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up
        runs = {"untraced": lambda: llm.generate(prompts, params, use_tqdm=False),
                "traced": lambda: traced_generate(llm, prompts, params)}
        for i in range(rounds):
            for name in (("untraced", "traced") if i % 2 == 0 else ("traced", "untraced")):
                began = time.perf_counter()
                runs[name]()
                rates[name].append(round(requests * max_tokens / (time.perf_counter() - began), 1))
    finally:
        shutdown_llm(llm)
    return {name: statistics.median(r) for name, r in rates.items()} | {"rounds": rates}


def main(args) -> int:
    print("trace hooks per engine step (microseconds), K =", K)
    print(f"{'batch':>6}{'off':>10}{'all traced':>12}")
    for batch in (1, 8, 32, 64):
        print(f"{batch:>6}{hook_microseconds(batch, False):>10.2f}{hook_microseconds(batch, True):>12.2f}")
    if args.skip_engine:
        return 0
    result = end_to_end(args.requests, args.max_tokens, args.rounds)
    print(f"\nend to end, {args.requests} requests x {args.max_tokens} tokens, median of {args.rounds} alternated rounds:")
    print(f"untraced {result['untraced']:.1f} tok/s, traced {result['traced']:.1f} tok/s "
          f"({result['traced'] / result['untraced']:.3f}x); rounds: {result['rounds']}")
    return 0


def add_arguments(p) -> None:
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--skip-engine", action="store_true", help="the hooks' own cost only")
