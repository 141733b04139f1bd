"""The arithmetic of speculative decoding (Leviathan et al. 2022; Chen et al. 2023).

alpha: the acceptance rate, the chance that the target keeps one draft token, sum_x min(p(x), q(x)).
k:     draft tokens proposed per step.
c:     cost ratio, the time of one target step divided by the time of one draft step.

One step drafts k tokens (cost k/c target steps) and verifies them in one target pass (cost 1); it
emits the accepted prefix plus one recovered or bonus token, (1 - alpha^(k+1)) / (1 - alpha) tokens on
average, against one token per target step without speculation.
"""

import torch


def acceptance_rate(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """alpha = sum(min(p, q)) over the last dimension: 1 - total variation distance."""
    return torch.minimum(p, q).sum(-1)


def expected_tokens(alpha: float, k: int) -> float:
    """Mean tokens emitted by one draft-and-verify step with k draft tokens."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def speedup(alpha: float, k: int, c: float) -> float:
    """Tokens per unit of target time, relative to plain decoding."""
    return expected_tokens(alpha, k) / (1.0 + k / c)


def optimal_k(alpha: float, c: float, max_k: int = 20) -> tuple[int, float]:
    """The draft length in 1..max_k with the highest speed-up (the smallest k on a tie)."""
    best_k = max(range(1, max_k + 1), key=lambda k: (speedup(alpha, k, c), -k))
    return best_k, speedup(alpha, best_k, c)


TABLE_ALPHAS = (0.6, 0.7, 0.8, 0.9)
TABLE_COSTS = (10, 20, 50)


def optimal_k_table(max_k: int = 20) -> list[dict]:
    """The seeds' table: optimal k and speed-up for alpha 0.6-0.9 and c 10/20/50."""
    rows = []
    for alpha in TABLE_ALPHAS:
        for c in TABLE_COSTS:
            k, s = optimal_k(alpha, c, max_k)
            rows.append({"alpha": alpha, "c": c, "k": k, "speedup": round(s, 4)})
    return rows
