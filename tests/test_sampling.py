"""The exact sampling core: losslessness tested statistically, with fixed seeds and stated sizes."""

import numpy as np
import pytest
import torch
from scipy import stats

from plugin.speculation_math import acceptance_rate
from plugin.sampling import (
    apply_top_k_top_p,
    greedy_verify,
    pad_ragged,
    processed_probs,
    rejection_sample,
    sample_from,
)

SEED_P = torch.tensor([0.3, 0.25, 0.15, 0.1, 0.08, 0.05, 0.03, 0.02, 0.01, 0.01])
SEED_Q = torch.tensor([0.2, 0.2, 0.2, 0.15, 0.1, 0.05, 0.04, 0.03, 0.02, 0.01])
P_VALUE_FLOOR = 1e-3


def one_step(p: torch.Tensor, q: torch.Tensor, n: int, seed: int):
    """n independent single-draft steps: draft x ~ q, verify against p; returns the first emitted token."""
    torch.manual_seed(seed)
    drafts = torch.multinomial(q.expand(n, -1), 1)
    target = p.expand(n, 2, -1).clone()
    out, accepted = rejection_sample(drafts, q.expand(n, 1, -1), target, torch.zeros(n, dtype=torch.bool))
    return out[:, 0], accepted


def chi_square_p_value(samples: np.ndarray, expected_probs: np.ndarray) -> float:
    """Chi-square goodness of fit; cells expecting fewer than 5 samples are pooled into one."""
    n = len(samples)
    expected_probs = np.asarray(expected_probs, dtype=np.float64)
    observed = np.bincount(samples, minlength=len(expected_probs)).astype(np.float64)
    expected = expected_probs / expected_probs.sum() * n
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def test_seed_example_matches_target_within_0_005():
    n = 100_000
    tokens, accepted = one_step(SEED_P, SEED_Q, n, seed=1234)
    empirical = torch.bincount(tokens, minlength=10).double() / n
    assert (empirical - SEED_P.double()).abs().max() < 0.005, empirical
    assert chi_square_p_value(tokens.numpy(), SEED_P.numpy()) > P_VALUE_FLOOR
    # And the acceptance rate is alpha = sum(min(p, q)) = 0.85.
    alpha = acceptance_rate(SEED_P, SEED_Q).item()
    assert alpha == pytest.approx(0.85)
    assert abs(accepted.float().mean().item() - alpha) < 0.005


def test_sample_from_draws_each_token_with_its_share_of_the_mass():
    """200,000 draws from one unnormalised distribution over 64 tokens (masses from 0.13 down to 4e-13,
    every fourth token 0): chi-square p-value above 1e-3, no zero-mass token ever drawn, seed 21."""
    torch.manual_seed(21)
    weights = torch.rand(64).pow(6) * 7.3  # unnormalised; a sixth power spreads the masses over decades
    weights[::4] = 0.0
    draws = sample_from(weights.expand(200_000, -1)).numpy()
    assert weights[draws].min() > 0
    assert chi_square_p_value(draws, weights.numpy()) > P_VALUE_FLOOR
    # The same check rejects a sampler that ignores the small masses (a vacuous test would not).
    flattened = torch.where(weights > 0, weights.clamp_min(weights.max() / 10), weights)
    assert chi_square_p_value(sample_from(flattened.expand(200_000, -1)).numpy(), weights.numpy()) < P_VALUE_FLOOR


def test_a_token_far_below_two_to_the_minus_24_can_be_drawn():
    """A float32 uniform is a multiple of 2^-24 (6e-8), so a token of mass 1e-9 whose interval lies
    between two of its values could never be drawn. Here token 1's interval, 1e-9 wide and off that grid,
    is put around the uniform a seeded row draws (seed 7): sample_from must return it."""
    u = torch.rand(1, generator=torch.Generator().manual_seed(7), dtype=torch.float64).item()
    grid = 2.0 ** -24
    assert (u / grid) % 1 > 0.01  # the uniform itself lies off the float32 grid
    start = u - 5e-10
    probs = torch.tensor([[start, 1e-9, 1.0 - start - 1e-9]], dtype=torch.float64)
    assert sample_from(probs, [torch.Generator().manual_seed(7)]).item() == 1


def test_sample_from_a_seeded_row_reproduces_from_its_own_generator():
    probs = torch.softmax(torch.randn(3, 4096, generator=torch.Generator().manual_seed(3)), -1)
    first = sample_from(probs, [None, torch.Generator().manual_seed(5), None])
    torch.manual_seed(123)  # the unseeded rows change, the seeded one does not
    again = sample_from(probs, [None, torch.Generator().manual_seed(5), None])
    assert first[1] == again[1]
    alone = sample_from(probs[1:2], [torch.Generator().manual_seed(5)])
    assert alone[0] == first[1]


# --- multi-token exactness on Markov chains ---------------------------------------------------------

VOCAB, K, START = 20, 4, 0


def markov_chain(seed: int, concentration: float) -> torch.Tensor:
    """Logits of a random Markov chain: row s holds the next-token logits after token s."""
    torch.manual_seed(seed)
    probs = torch.distributions.Dirichlet(torch.full((VOCAB,), concentration)).sample((VOCAB,))
    return probs.log()


def speculative_generate(target_logits, draft_logits, n, num_tokens, temperature, top_k=None, top_p=None,
                         greedy=False, seed=0):
    """n sequences from START, decoded by draft-and-verify until each has num_tokens tokens."""
    torch.manual_seed(seed)
    temp = torch.full((n,), 0.0 if greedy else temperature)
    tk = None if top_k is None else torch.full((n,), top_k)
    tp = None if top_p is None else torch.full((n,), top_p)

    def chain_probs(logits, tokens):  # [n, m] tokens -> [n, m, V] processed next distributions
        m = tokens.shape[1]
        rows = logits[tokens.reshape(-1)]
        rep = lambda t: None if t is None else t.repeat_interleave(m)
        return processed_probs(rows, rep(temp), rep(tk), rep(tp)).view(n, m, VOCAB)

    sequences = torch.full((n, 1), START)
    lengths = torch.ones(n, dtype=torch.long)  # tokens so far, START included
    while lengths.min() < num_tokens + 1:
        last = sequences[torch.arange(n), lengths - 1]
        drafts, qs, token = [], [], last
        for _ in range(K):
            q = chain_probs(draft_logits, token.unsqueeze(1))[:, 0]
            token = sample_from(q) if not greedy else q.argmax(-1)
            drafts.append(token)
            qs.append(q)
        drafts = torch.stack(drafts, 1)
        p = chain_probs(target_logits, torch.cat([last.unsqueeze(1), drafts], 1))
        out, num_accepted = rejection_sample(drafts, torch.stack(qs, 1), p, temp <= 0)
        sequences = torch.cat([sequences, torch.full((n, K + 1), -1)], 1)
        for j in range(K + 1):
            keep = j <= num_accepted
            sequences[keep, lengths[keep] + j] = out[keep, j]
        lengths = lengths + num_accepted + 1
    return sequences[:, 1 : num_tokens + 1]


def exact_joint(target_logits, temperature, top_k, top_p):
    rows = torch.arange(VOCAB)
    n = VOCAB
    p = processed_probs(
        target_logits[rows], torch.full((n,), temperature),
        None if top_k is None else torch.full((n,), top_k),
        None if top_p is None else torch.full((n,), top_p),
    ).double()
    # P(a, b, c) = P(a | START) P(b | a) P(c | b)
    joint = p[START][:, None, None] * p[:, :, None] * p[None, :, :]
    return joint.reshape(-1).numpy()


@pytest.fixture(scope="module")
def chains():
    target = markov_chain(7, 0.5)
    draft = markov_chain(8, 0.5)
    # The draft is a different chain that shares part of the target's mass, as a real draft would.
    draft = torch.log(0.5 * target.exp() + 0.5 * draft.exp())
    return target, draft


SETTINGS = [
    pytest.param(dict(temperature=1.0), id="temperature-1"),
    pytest.param(dict(temperature=0.7, top_p=0.9), id="temperature-0.7-top-p-0.9"),
    pytest.param(dict(temperature=1.0, top_k=5), id="top-k-5"),
]


@pytest.mark.parametrize("setting", SETTINGS)
def test_joint_distribution_of_three_tokens_matches_target_chain(chains, setting):
    """60,000 sequences; chi-square over the 8,000 cells of (t1, t2, t3), sparse cells pooled."""
    target, draft = chains
    n = 60_000
    seqs = speculative_generate(target, draft, n, 3, seed=11, **setting)
    cells = (seqs[:, 0] * VOCAB * VOCAB + seqs[:, 1] * VOCAB + seqs[:, 2]).numpy()
    expected = exact_joint(target, setting.get("temperature"), setting.get("top_k"), setting.get("top_p"))
    assert chi_square_p_value(cells, expected) > P_VALUE_FLOOR
    # Tokens outside the target's top-k/top-p support never appear.
    assert expected[cells].min() > 0


def test_draft_distribution_is_not_what_comes_out(chains):
    """Guard against a vacuous test: emitting the drafts unverified is rejected by the same check."""
    target, draft = chains
    n = 60_000
    seqs = speculative_generate(draft, draft, n, 3, temperature=1.0, seed=11)
    cells = (seqs[:, 0] * VOCAB * VOCAB + seqs[:, 1] * VOCAB + seqs[:, 2]).numpy()
    assert chi_square_p_value(cells, exact_joint(target, 1.0, None, None)) < P_VALUE_FLOOR


def test_greedy_equals_argmax_decoding(chains):
    target, draft = chains
    seqs = speculative_generate(target, draft, 4, 40, temperature=0.0, greedy=True)
    token, expected = START, []
    for _ in range(40):
        token = int(target[token].argmax())
        expected.append(token)
    for row in seqs.tolist():
        assert row == expected


# --- degenerate cases --------------------------------------------------------------------------------

def verify_one(p_rows, q_rows, drafts, greedy=False, generators=()):
    p = torch.tensor(p_rows, dtype=torch.float32).unsqueeze(0)
    q = None if q_rows is None else torch.tensor(q_rows, dtype=torch.float32).unsqueeze(0)
    d = torch.tensor([drafts])
    return rejection_sample(d, q, p, torch.tensor([greedy]), generators)


def test_draft_token_with_zero_draft_probability_is_handled():
    """q(x) = 0 < p(x): always accepted (u * q(x) < p(x) needs no division), then the bonus follows p.
    3,000 rows; the bonus frequencies within 0.04 of p = [0.2, 0.3, 0.5]."""
    n = 3000
    torch.manual_seed(4)
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]).expand(n, -1, -1).clone()
    q = torch.tensor([[1.0, 0.0, 0.0]]).expand(n, -1, -1).clone()
    out, accepted = rejection_sample(torch.ones(n, 1, dtype=torch.long), q, p, torch.zeros(n, dtype=torch.bool))
    assert accepted.eq(1).all() and out[:, 0].eq(1).all()
    bonus = torch.bincount(out[:, 1], minlength=3).float() / n
    assert (bonus - p[0, 1]).abs().max() < 0.04, bonus


def test_equal_distributions_always_accept():
    p = [0.1, 0.2, 0.3, 0.4]
    torch.manual_seed(0)
    for draft in range(4):
        out, n = verify_one([p, p, p], [p, p], [draft, (draft + 1) % 4])
        assert n.item() == 2 and out[0, :2].tolist() == [draft, (draft + 1) % 4]


def test_disjoint_supports_always_reject_and_recover_from_target():
    torch.manual_seed(0)
    for _ in range(200):
        out, n = verify_one([[0.6, 0.4, 0, 0], [0.25] * 4], [[0, 0, 0.5, 0.5]], [2])
        assert n.item() == 0 and out[0, 0].item() in (0, 1) and out[0, 1].item() == -1


def test_zero_residual_falls_back_to_target():
    """p = q, and a draft token with p(x) = q(x) = 0: rejected, and max(0, p - q) is all zeros, so the
    recovered token is drawn from p itself: 2,000 rows, token 0's share within 0.05 of 0.5."""
    n = 2000
    torch.manual_seed(0)
    p = torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]]).expand(n, -1, -1).clone()
    q = torch.tensor([[0.5, 0.5, 0.0]]).expand(n, -1, -1).clone()
    out, accepted = rejection_sample(torch.full((n, 1), 2), q, p, torch.zeros(n, dtype=torch.bool))
    assert accepted.eq(0).all() and out[:, 1].eq(-1).all()
    assert out[:, 0].lt(2).all()
    assert abs(out[:, 0].eq(0).float().mean().item() - 0.5) < 0.05


def test_one_hot_drafts_when_draft_probs_is_none():
    """draft_probs=None: accept x with probability p(x); the recovered token is never x."""
    torch.manual_seed(3)
    n = 50_000
    p = SEED_P
    drafts = torch.full((n, 1), 2)
    out, accepted = rejection_sample(drafts, None, p.expand(n, 2, -1).clone(), torch.zeros(n, dtype=torch.bool))
    assert abs(accepted.float().mean().item() - p[2].item()) < 0.01
    assert (out[accepted == 0, 0] != 2).all()
    # and the first token is still exactly p
    assert chi_square_p_value(out[:, 0].numpy(), p.numpy()) > P_VALUE_FLOOR


def test_ragged_rows_and_bonus_token():
    """Row 0 has two drafts, row 1 none, row 2 three; every accepted row ends with its bonus token."""
    v = 5
    p = torch.zeros(3, 4, v)
    drafts = torch.tensor([[1, 2, -1], [-1, -1, -1], [3, 3, 3]])
    for row, n in enumerate([2, 0, 3]):
        for j in range(n):
            p[row, j, drafts[row, j]] = 1.0  # the target agrees with every draft
        p[row, n, 4] = 1.0  # bonus distribution: all mass on token 4
    out, accepted = rejection_sample(drafts, None, p, torch.zeros(3, dtype=torch.bool))
    assert accepted.tolist() == [2, 0, 3]
    assert out.tolist() == [[1, 2, 4, -1], [4, -1, -1, -1], [3, 3, 3, 4]]


# --- seeds and mixed batches -------------------------------------------------------------------------

def _random_case(batch, k=4, v=50, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(batch, k + 1, v, generator=gen) * 2, -1)
    q = torch.softmax(torch.randn(batch, k, v, generator=gen) * 2, -1)
    drafts = torch.multinomial(q.view(-1, v), 1, generator=gen).view(batch, k)
    return drafts, q, p


def test_seeded_rows_reproduce_whatever_their_batch():
    drafts, q, p = _random_case(6)
    greedy = torch.tensor([True, False, False, False, True, False])

    def seeded(seed):
        return torch.Generator().manual_seed(seed)

    gens = [None, seeded(1), None, seeded(2), None, seeded(3)]
    out1, _ = rejection_sample(drafts, q, p, greedy, gens)
    gens = [None, seeded(1), None, seeded(2), None, seeded(3)]
    torch.manual_seed(999)  # unseeded rows change; seeded rows must not
    out2, _ = rejection_sample(drafts, q, p, greedy, gens)
    for row in (1, 3, 5):
        assert out1[row].tolist() == out2[row].tolist()
    # Seeded row 3 alone, in a batch of one with a shorter padding width, gives the same tokens.
    alone, _ = rejection_sample(drafts[3:4], q[3:4], p[3:4], greedy[3:4], [seeded(2)])
    assert alone[0].tolist() == out1[3].tolist()


def test_mixed_batch_greedy_rows_follow_target_argmax():
    drafts, q, p = _random_case(8, seed=5)
    greedy = torch.tensor([True, False] * 4)
    drafts[0] = p[0, :4].argmax(-1)  # row 0's drafts are the target's argmax: all accepted
    out, accepted = rejection_sample(drafts, q, p, greedy, [None] * 8)
    assert accepted[0].item() == 4 and out[0].tolist() == p[0].argmax(-1).tolist()
    for row in (2, 4, 6):
        a = accepted[row].item()
        assert out[row, :a].tolist() == drafts[row, :a].tolist()
        assert out[row, a].item() == p[row, a].argmax().item()
        if a < 4:
            assert drafts[row, a].item() != p[row, a].argmax().item()


# --- logits processing -------------------------------------------------------------------------------

def test_top_k_top_p_and_greedy_processing():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 4))
    probs = processed_probs(
        logits,
        temperature=torch.tensor([1.0, 1.0, 0.0, 1.0]),
        top_k=torch.tensor([2, 0, 0, 0]),
        top_p=torch.tensor([1.0, 0.6, 1.0, 1.0]),
    )
    torch.testing.assert_close(probs[0], torch.tensor([4 / 7, 3 / 7, 0, 0]))
    torch.testing.assert_close(probs[1], torch.tensor([4 / 7, 3 / 7, 0, 0]))
    torch.testing.assert_close(probs[2], torch.tensor([1.0, 0, 0, 0]))
    torch.testing.assert_close(probs[3], torch.tensor([0.4, 0.3, 0.2, 0.1]))
    hot = processed_probs(logits[:1], torch.tensor([0.5]))
    torch.testing.assert_close(hot[0], torch.softmax(logits[0] / 0.5, -1))
    assert apply_top_k_top_p(logits, None, None) is logits


def test_pad_ragged():
    flat = torch.arange(5).float()
    assert pad_ragged(flat, [2, 0, 3], 3, fill=-1).tolist() == [[0, 1, -1], [-1, -1, -1], [2, 3, 4]]


def greedy_reference(drafts: list[int], argmax: list[int]) -> list[int]:
    """The greedy rule, one token at a time: keep each draft while it is the target's argmax; at the first
    mismatch (or after the last draft) emit the argmax there. Padded with -1 to len(argmax)."""
    out = []
    for j, x in enumerate(drafts):
        if x < 0 or x != argmax[j]:
            break
        out.append(x)
    out.append(argmax[len(out)])
    return out + [-1] * (len(argmax) - len(out))


def test_greedy_verification_follows_the_argmax_rule():
    """greedy_verify, and rejection_sample on greedy rows, against the one-token-at-a-time rule, on
    rows that accept all, none, some, and end early with a -1."""
    drafts, q, p = _random_case(8, seed=9)
    argmax = p.argmax(-1)
    drafts[1] = argmax[1, :4]  # all accepted
    drafts[2, :2] = argmax[2, :2]  # two accepted, then most likely a mismatch
    drafts[3, :2], drafts[3, 2:] = argmax[3, :2], -1  # ragged: two drafts, both accepted
    drafts[4, 0] = (argmax[4, 0] + 1) % 50  # rejected at once
    expected = [greedy_reference(d, a) for d, a in zip(drafts.tolist(), argmax.tolist())]
    out, n = greedy_verify(drafts, argmax)
    assert out.tolist() == expected
    assert n.tolist() == [sum(t >= 0 for t in row) - 1 for row in expected]
    assert n[1].item() == 4 and n[3].item() == 2 and n[4].item() == 0
    sampled_out, _ = rejection_sample(drafts, q, p, torch.ones(8, dtype=torch.bool))
    assert sampled_out.tolist() == expected


def test_a_placeholder_ends_a_rows_drafts():
    """Row [3, -1, 5] has one draft (3), not two: what follows its first -1 is no draft. With the target
    sure of 3, the bonus is drawn from p at position 1 (0.5/0.5 over tokens 0 and 6); 2,000 rows, token 6's
    share within 0.05 of 0.5. (Counting 5 as a draft once made every row recover 6.)"""
    n = 2000
    drafts = torch.tensor([[3, -1, 5]]).expand(n, -1)
    p = torch.zeros(n, 4, 8)
    p[:, 0, 3] = 1.0
    p[:, 1, 0] = p[:, 1, 6] = 0.5
    p[:, 2:, 1] = 1.0
    torch.manual_seed(0)
    out, accepted = rejection_sample(drafts, None, p, torch.zeros(n, dtype=torch.bool))
    assert accepted.eq(1).all() and out[:, 0].eq(3).all() and out[:, 2:].eq(-1).all()
    assert abs(out[:, 1].eq(6).float().mean().item() - 0.5) < 0.05


def test_argmax_is_torchs_first_index_on_ties_for_any_layout():
    """The CPU fast path (numpy) and the fallback (a transposed, non-contiguous view; bfloat16) give
    torch's own argmax, ties to the first index, for 2-D and 3-D inputs."""
    from plugin.sampling import argmax

    generator = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (5, 3, 64), generator=generator).float()  # many ties
    for tensor in (x, x[0], x.transpose(0, 1), x.bfloat16()):
        assert torch.equal(argmax(tensor), tensor.argmax(-1))
    assert argmax(torch.tensor([[1.0, 3.0, 3.0]])).tolist() == [1]
