"""Exact speculative sampling: pure PyTorch, batched, on any device.

Vocabulary (the same words as vLLM's rejection sampler):

- draft tokens:     the K tokens (at most) the draft proposed for a request, sampled from the draft's
                    processed distribution q. Rows are ragged; padding is -1.
- target probs:     the target's processed distribution p at each draft position plus one more, from
                    a single target forward pass over the last accepted token and the drafts.
- accepted tokens:  draft token x at position j is accepted with probability min(1, p_j(x) / q_j(x)),
                    and only while every earlier draft token of the request was accepted.
- recovered token:  at the first rejected position j, a token drawn from normalise(max(0, p_j - q_j)).
- bonus token:      when every draft token is accepted, a token drawn from the target's next
                    distribution p_n, n the number of draft tokens.

Each step therefore emits the accepted tokens plus one recovered or bonus token, and the emitted
sequence has exactly the target's distribution (Leviathan et al. 2022, Theorem 1; Chen et al. 2023).

Greedy requests (temperature 0) accept while the draft token equals the target's argmax and emit the
target's argmax at the first mismatch (or as the bonus), so the text equals plain greedy decoding.

Seeded requests carry their own torch.Generator; every random number they consume is drawn from it in
a fixed order (one uniform per draft position, then one for the recovered or bonus token), so a
seeded request is reproducible whatever else shares its batch.
"""

from typing import Optional, Sequence

import torch

PLACEHOLDER_TOKEN_ID = -1
_EPS = 1e-10


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor]
) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p nucleus with -inf (vLLM's convention:
    top_k <= 0 or >= vocab and top_p >= 1 switch a row's filter off; ties at the k-th value stay)."""
    if top_k is None and top_p is None:
        return logits
    vocab = logits.size(-1)
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        k = torch.where(top_k <= 0, vocab, top_k).clamp(1, vocab).to(torch.long)
        kth = sorted_logits.gather(-1, (vocab - k).unsqueeze(-1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        outside = cumulative <= (1 - top_p.to(cumulative.dtype)).unsqueeze(-1)
        outside[:, -1] = False  # the most likely token always stays
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(sorted_logits).scatter_(-1, order, sorted_logits)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1), the first index on ties as torch's; on the CPU through numpy, which took 8 us for 16
    rows of 4,096 float32 logits and 45 for 112 here, where torch's took 70 and 480 (every greedy draft
    position, and a greedy verification's target argmax, pay it)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous():
        return torch.from_numpy(x.numpy().argmax(-1))
    return x.argmax(-1)


def apply_min_p(logits: torch.Tensor, min_p: Optional[torch.Tensor]) -> torch.Tensor:
    """Mask the tokens of each row whose probability is below min_p [N] times the row's largest (vLLM's
    min-p; 0 switches a row's filter off)."""
    if min_p is None or not bool((min_p > 0).any()):
        return logits
    probs = logits.softmax(dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * min_p.to(probs.dtype).unsqueeze(-1)
    return logits.masked_fill(probs < floor, float("-inf"))


def processed_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: Optional[torch.Tensor] = None,
    top_p: Optional[torch.Tensor] = None,
    min_p: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Logits [N, V] after temperature, then min-p, then top-k, then top-p (filtered tokens -inf), float32,
    vLLM's plain sampler's order: what each row samples from, before the softmax, and what vLLM's
    processed logprobs are of. Rows with temperature 0 (greedy) are divided by 1."""
    logits = logits.float()
    greedy = temperature <= _EPS
    # Filters that no row uses are skipped: the sort they need is the costliest step here.
    if top_k is not None and not bool((top_k > 0).logical_and(top_k < logits.size(-1)).any()):
        top_k = None
    if top_p is not None and not bool((top_p < 1).any()):
        top_p = None
    scaled = logits / torch.where(greedy, 1.0, temperature.float()).unsqueeze(-1)
    return apply_top_k_top_p(apply_min_p(scaled, min_p), top_k, top_p)


def processed_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: Optional[torch.Tensor] = None,
    top_p: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Logits [N, V] to the distribution each row samples from: temperature, then top-k, then top-p.
    Rows with temperature 0 are greedy and get a one-hot at their argmax."""
    return probs_of(processed_logits(logits, temperature, top_k, top_p), logits, temperature)


def probs_of(processed: torch.Tensor, logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """`processed_probs` from the rows' processed logits [N, V] (`processed_logits`) and their logits [N, V]."""
    probs = processed.softmax(dim=-1)
    greedy = temperature <= _EPS
    if greedy.any():
        one_hot = torch.zeros_like(probs).scatter_(-1, argmax(logits.float()).unsqueeze(-1), 1.0)
        probs = torch.where(greedy.unsqueeze(-1), one_hot, probs)
    return probs


def _uniform(shape, device, generators: Sequence[Optional[torch.Generator]], lengths=None) -> torch.Tensor:
    """Uniform [0, 1) noise [B, N], float64. A row with a generator draws its first lengths[row] values
    (all N by default) from it, so what a seeded request consumes does not depend on its batch. Float64
    because a float32 uniform is a multiple of 2^-24: every token's chance of being drawn, and every
    acceptance chance, would be rounded to that grid (a token of mass 1e-9 drawn never or at 6e-8)."""
    noise = torch.rand(shape, device=device, dtype=torch.float64)
    for row, gen in enumerate(generators):
        if gen is not None:
            n = shape[1] if lengths is None else int(lengths[row])
            noise[row, :n] = torch.rand(n, device=device, generator=gen, dtype=torch.float64)
    return noise


def sample_from(probs: torch.Tensor, generators: Sequence[Optional[torch.Generator]] = ()) -> torch.Tensor:
    """One token per row of probs [B, V] (need not be normalised), by inversion: the first x whose
    cumulative mass exceeds u * total, with one uniform u per row. The cumulative sums are float64, so
    rounding moves no token's mass by more than about V * 1e-16 (float32 sums over a 152k vocabulary
    could move 1e-2); a token of zero mass is never drawn. One uniform per row instead of one
    exponential per vocabulary entry: on a CPU the random numbers were most of a draw's cost. The
    uniform is float64 too (`_uniform`)."""
    cdf = probs.double().cumsum(dim=-1)  # [B, V]
    u = _uniform((len(probs), 1), probs.device, generators or [None] * len(probs))  # [B, 1]
    token = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)  # [B]
    return token.clamp_max(probs.size(-1) - 1)  # only a row with no mass at all reaches V


def greedy_verify(draft_token_ids: torch.Tensor, target_argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Verification of greedy requests: drafts [B, K] (padded -1) are accepted while they equal the
    target's argmax [B, K + 1]; then the argmax at the first mismatch (or the bonus position) follows.
    Returns (output_token_ids [B, K + 1] padded with -1, num_accepted [B])."""
    batch, k = draft_token_ids.shape
    matches = (draft_token_ids == target_argmax[:, :k]) & (draft_token_ids >= 0)
    num_accepted = matches.long().cumprod(dim=1).sum(dim=1)
    positions = torch.arange(k + 1, device=draft_token_ids.device).unsqueeze(0)
    output = torch.where(positions <= num_accepted.unsqueeze(-1), target_argmax, PLACEHOLDER_TOKEN_ID)
    return output, num_accepted


def rejection_sample(
    draft_token_ids: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    target_probs: torch.Tensor,
    greedy: torch.Tensor,
    generators: Sequence[Optional[torch.Generator]] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a batch of drafts against the target.

    draft_token_ids: [B, K] long; each row's draft tokens, then -1 padding (a row's drafts end at its first -1).
    draft_probs:     [B, K, V], the processed q each draft token was sampled from; None means every
                     draft was deterministic (q is one-hot at the draft token).
    target_probs:    [B, K + 1, V], processed p at each draft position and the one after.
    greedy:          [B] bool, rows that decode greedily.
    generators:      per row, a torch.Generator for seeded requests or None.

    Returns (output_token_ids [B, K + 1] padded with -1, num_accepted [B]); row i emits its
    num_accepted[i] accepted tokens then one recovered or bonus token.
    """
    batch, k = draft_token_ids.shape
    device = target_probs.device
    generators = list(generators) or [None] * batch
    rows = torch.arange(batch, device=device)

    # A row's draft tokens are its leading run of non-negative ids: the first -1 ends them, and nothing
    # after it is a draft (the clamp below only keeps gathers in range; those positions are never used).
    valid = (draft_token_ids >= 0).long().cumprod(dim=1).bool()  # [B, K]
    num_draft = valid.sum(dim=1)  # [B]
    drafts = draft_token_ids.clamp_min(0)  # [B, K]

    # Accepted tokens: u < p(x) / q(x), written as u * q(x) < p(x) so q(x) = 0 needs no division.
    p_x = target_probs[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    u = _uniform((batch, k), device, generators, num_draft.tolist())
    accepted = u * q_x < p_x
    num_accepted = (accepted & valid).long().cumprod(dim=1).sum(dim=1)

    # One more token at position a = num_accepted: recovered from max(0, p_a - q_a) if a draft token
    # was rejected there, bonus from p_a if every draft token was accepted (a == num_draft).
    p_next = target_probs[rows, num_accepted]
    rejected_at = num_accepted.clamp_max(max(k - 1, 0))
    if k == 0:
        q_next = torch.zeros_like(p_next)
    elif draft_probs is None:
        q_next = torch.zeros_like(p_next).scatter_(-1, drafts[rows, rejected_at].unsqueeze(-1), 1.0)
    else:
        q_next = draft_probs[rows, rejected_at]
    was_rejected = (num_accepted < num_draft).unsqueeze(-1)
    residual = torch.where(was_rejected, (p_next - q_next).clamp_min(0), p_next)
    # p = q up to rounding leaves no residual; any draw from p is then exact.
    residual = torch.where(residual.sum(-1, keepdim=True) > _EPS, residual, p_next)
    next_token = sample_from(residual, generators)

    positions = torch.arange(k + 1, device=device).unsqueeze(0)
    output = torch.cat([drafts, drafts.new_zeros(batch, 1)], dim=1)
    output = torch.where(positions < num_accepted.unsqueeze(-1), output, PLACEHOLDER_TOKEN_ID)
    output[rows, num_accepted] = next_token
    if greedy.any():
        greedy_output, greedy_accepted = greedy_verify(draft_token_ids, argmax(target_probs))
        output = torch.where(greedy.unsqueeze(-1), greedy_output, output)
        num_accepted = torch.where(greedy, greedy_accepted, num_accepted)
    return output, num_accepted


def pad_ragged(flat: torch.Tensor, lengths: Sequence[int], width: int, fill: float = 0) -> torch.Tensor:
    """Rows of a flat [sum(lengths), ...] tensor, padded to [len(lengths), width, ...] with fill."""
    batch = len(lengths)
    lengths_t = torch.as_tensor(list(lengths), device=flat.device)
    starts = torch.cumsum(lengths_t, 0) - lengths_t
    positions = torch.arange(width, device=flat.device)
    valid = positions.unsqueeze(0) < lengths_t.unsqueeze(1)
    index = (starts.unsqueeze(1) + positions).clamp_max(max(len(flat) - 1, 0))
    if len(flat) == 0:
        return flat.new_full((batch, width, *flat.shape[1:]), fill)
    padded = flat[index]
    mask = valid.view(batch, width, *([1] * (flat.dim() - 1)))
    return torch.where(mask, padded, torch.as_tensor(fill, dtype=flat.dtype, device=flat.device))
