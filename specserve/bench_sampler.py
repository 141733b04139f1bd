"""`specserve bench-sampler`: time of one verification step against plain sampling of the same logits.

Both sides get target logits [batch, K + 1, vocab]. Plain sampling is softmax + multinomial over all of
them (what a non-speculative sampler does with that many positions); the exact sampler processes them
into p (temperature) and runs `rejection_sample` against real draft distributions q.
"""

import json
import time

import torch

from plugin.sampling import processed_probs, rejection_sample


def timed(fn, iters: int, device: torch.device = torch.device("cpu")) -> float:
    """Mean seconds per call after one warm-up call (the device synchronised around the loop)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - start) / iters


def measure(batch: int, k: int, vocab: int, iters: int, device: str = "cpu") -> dict:
    device = torch.device(device)
    gen = torch.Generator().manual_seed(batch)
    target_logits = (torch.randn(batch, k + 1, vocab, generator=gen) * 3).to(device)
    draft_probs = torch.softmax(torch.randn(batch, k, vocab, generator=gen) * 3, -1).to(device)
    drafts = torch.multinomial(draft_probs.view(-1, vocab), 1).view(batch, k)
    temperature = torch.full((batch * (k + 1),), 0.8, device=device)
    greedy = torch.zeros(batch, dtype=torch.bool, device=device)

    def plain():
        probs = torch.softmax(target_logits.view(-1, vocab) / 0.8, dim=-1)
        return torch.multinomial(probs, 1)

    def exact():
        p = processed_probs(target_logits.view(-1, vocab), temperature).view(batch, k + 1, vocab)
        return rejection_sample(drafts, draft_probs, p, greedy)

    plain_s, exact_s = timed(plain, iters, device), timed(exact, iters, device)
    return {"batch": batch, "k": k, "vocab": vocab, "plain_ms": plain_s * 1e3, "exact_ms": exact_s * 1e3,
            "ratio": exact_s / plain_s}


def main(args) -> int:
    torch.manual_seed(0)
    rows = [measure(b, args.k, args.vocab, args.iters) for b in args.batch_sizes]
    print(f"exact rejection sampler vs softmax+multinomial, K={args.k}, vocab={args.vocab}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'batch':>6} {'plain ms':>10} {'exact ms':>10} {'ratio':>7}")
    for r in rows:
        print(f"{r['batch']:>6} {r['plain_ms']:>10.3f} {r['exact_ms']:>10.3f} {r['ratio']:>6.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0
