"""The prepared device check: what needs a GPU and no vLLM, in one short run that prints one table.

Made for the GPU machine this workplace lends at times (CUDA and PyTorch, no vLLM, no network; the
repository travels, the shipped draft included): `scripts/gpu-check.sh`. It runs on CPU too (`--quick`
shrinks it), which is how the test suite keeps it working.

1. Exactness on the device: the seeds' 10-token example, N draws of one draft token x ~ q verified
   against p; the first emitted token must follow p (max deviation < 0.005 at 1e5 draws, wider as
   1 / sqrt(N) for fewer, chi-square p > 1e-3) and the acceptance rate must be alpha = sum(min(p, q)) =
   0.85 within the same tolerance.
2. The exact sampler's time per verification step (K = 4) against plain softmax + multinomial of the
   same logits, at batch 1 to 64 with a 152k vocabulary (Qwen2.5's).
3. The shipped draft's one-token decode step, eager against compiled (CUDA graphs on CUDA), float32:
   the largest relative logit difference (stated tolerance 1e-4) and the step time at batch 1, 4, 16, 64.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

from plugin.sampling import rejection_sample
from plugin.speculation_math import acceptance_rate

SEED_P = torch.tensor([0.3, 0.25, 0.15, 0.1, 0.08, 0.05, 0.03, 0.02, 0.01, 0.01])
SEED_Q = torch.tensor([0.2, 0.2, 0.2, 0.15, 0.1, 0.05, 0.04, 0.03, 0.02, 0.01])
LOGIT_RTOL = 1e-4


def exactness(device: torch.device, draws: int) -> dict:
    torch.manual_seed(1234)
    p, q = SEED_P.to(device), SEED_Q.to(device)
    drafts = torch.multinomial(q.expand(draws, -1), 1)
    out, accepted = rejection_sample(drafts, q.expand(draws, 1, -1), p.expand(draws, 2, -1).clone(),
                                     torch.zeros(draws, dtype=torch.bool, device=device))
    counts = torch.bincount(out[:, 0], minlength=10).double().cpu()
    deviation = (counts / draws - SEED_P.double()).abs().max().item()
    try:
        from scipy import stats

        expected = SEED_P.double().numpy() / SEED_P.double().sum().item() * draws
        p_value = float(stats.chisquare(counts.numpy(), expected).pvalue)
    except ImportError:
        p_value = float("nan")
    alpha = acceptance_rate(SEED_P, SEED_Q).item()
    acceptance = accepted.float().mean().item()
    bound = tolerance(draws)
    passed = deviation < bound and not p_value < 1e-3 and abs(acceptance - alpha) < bound
    return {"draws": draws, "max_deviation": deviation, "chi2_p": p_value, "acceptance": acceptance,
            "alpha": alpha, "tolerance": bound, "passed": passed}


def tolerance(draws: int) -> float:
    """0.005 at 1e5 draws (3.4 standard deviations of the largest cell, p = 0.3; 4.4 of the acceptance
    rate), widened as 1 / sqrt(draws) for fewer: the same number of standard deviations (0.011 at the
    quick run's 20,000, where 0.005 was 1.5 and failed by chance on some seeds)."""
    return 0.005 * (100_000 / draws) ** 0.5


def sampler_times(device: torch.device, batches: list[int], vocab: int, iters: int) -> list[dict]:
    from specserve.bench_sampler import measure

    return [measure(b, 4, vocab, iters, str(device)) for b in batches]


def decode_times(device: torch.device, batches: list[int], max_len: int, steps: int) -> dict:
    from deployment.defaults import DEMO_DRAFT
    from plugin.compiled_decode import CompiledDecode
    from plugin.draft_model import DraftModel

    max_rows = max(batches)
    model = DraftModel(DEMO_DRAFT, max_rows, max_len, device, torch.float32)
    compiled = CompiledDecode(model, max_rows)
    compiled.warm_up()
    rows = []
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for batch in batches:
        prompt = torch.randint(0, model.vocab_size, (batch, 64), device=device)
        model.forward(prompt, torch.zeros(batch, dtype=torch.long, device=device), torch.full((batch,), 63, device=device))
        token = torch.randint(0, model.vocab_size, (batch, 1), device=device)
        positions = torch.full((batch,), 64, device=device)
        zero = torch.zeros(batch, dtype=torch.long, device=device)
        eager_logits = model.forward(token, positions, zero)
        compiled_logits = compiled(token, positions)  # the same keys and values, written again
        rel = ((compiled_logits - eager_logits).abs().max() / eager_logits.abs().max()).item()

        def per_step(fn):
            times = []
            for i in range(steps):
                sync()
                start = time.perf_counter()
                fn(token, positions + 1 + i % 8)
                sync()
                times.append(time.perf_counter() - start)
            return statistics.median(times[steps // 5:]) * 1e3

        eager_ms = per_step(lambda t, pos: model.forward(t, pos, zero))
        compiled_ms = per_step(compiled)
        rows.append({"batch": batch, "eager_ms": eager_ms, "compiled_ms": compiled_ms, "max_rel_diff": rel,
                     "within_tolerance": rel <= LOGIT_RTOL})
    return {"compile_seconds": compiled.compile_seconds, "compile_failed": compiled.failed, "rows": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="gpu-check", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a CPU smoke run")
    parser.add_argument("--json", metavar="PATH", help="also write the results here ($OUT/gpu_check.json by default when OUT is set)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    quick = args.quick
    started = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"specserve gpu-check on {name}, torch {torch.__version__}{' (quick)' if quick else ''}", flush=True)

    result = {"device": name, "torch": torch.__version__, "quick": quick}
    result["exactness"] = exactness(device, 20_000 if quick else 100_000)
    e = result["exactness"]
    print(f"\n1. exactness, seeds' example, {e['draws']:,} draws: max |freq - p| {e['max_deviation']:.4f}, "
          f"chi-square p {e['chi2_p']:.3g}, acceptance {e['acceptance']:.4f} (alpha {e['alpha']:.2f}; "
          f"tolerance {e['tolerance']:.4f}): "
          f"{'PASS' if e['passed'] else 'FAIL'}", flush=True)

    batches = [1, 4, 16] if quick else [1, 4, 16, 64]
    vocab = 32_000 if quick else 152_064
    result["sampler"] = sampler_times(device, batches, vocab, 5 if quick else 30)
    print(f"\n2. verification step, K=4, vocab {vocab:,}: exact sampler vs softmax+multinomial (ms)")
    print(f"{'batch':>6}{'plain':>10}{'exact':>10}{'ratio':>8}")
    for r in result["sampler"]:
        print(f"{r['batch']:>6}{r['plain_ms']:>10.3f}{r['exact_ms']:>10.3f}{r['ratio']:>7.2f}x")

    result["decode"] = decode_times(device, batches, 256 if quick else 1024, 20 if quick else 200)
    d = result["decode"]
    print(f"\n3. shipped draft, one-token decode step (float32), eager vs compiled "
          f"(compile {d['compile_seconds']:.1f} s{', FAILED: ' + d['compile_failed'] if d['compile_failed'] else ''})")
    print(f"{'batch':>6}{'eager ms':>10}{'compiled ms':>13}{'speed-up':>10}{'max rel diff':>14}")
    for r in d["rows"]:
        print(f"{r['batch']:>6}{r['eager_ms']:>10.3f}{r['compiled_ms']:>13.3f}{r['eager_ms'] / r['compiled_ms']:>9.2f}x"
              f"{r['max_rel_diff']:>14.2e}{'' if r['within_tolerance'] else '  > 1e-4'}")
    result["seconds"] = time.perf_counter() - started
    ok = e["passed"] and all(r["within_tolerance"] for r in d["rows"])
    print(f"\n{'PASS' if ok else 'FAIL'} in {result['seconds']:.0f} s")
    path = args.json or (os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
