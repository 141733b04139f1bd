"""`plugin.ExactRejectionSampler` driven through vLLM 0.32's own types, with vLLM's own `Sampler`."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.sample.logits_processor import LogitsProcessors  # noqa: E402
from vllm.v1.sample.metadata import SamplingMetadata  # noqa: E402
from vllm.v1.sample.sampler import Sampler  # noqa: E402
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata  # noqa: E402

from plugin import ExactRejectionSampler  # noqa: E402
from plugin.speculation_math import acceptance_rate  # noqa: E402
from tests.test_sampling import P_VALUE_FLOOR, SEED_P, SEED_Q, chi_square_p_value  # noqa: E402


def spec_metadata(draft_token_ids: list[list[int]]) -> SpecDecodeMetadata:
    """The metadata vLLM's model runner builds, for logits laid out request by request as
    [draft positions..., bonus position]."""
    num_draft = np.array([len(d) for d in draft_token_ids])
    num_sampled = num_draft + 1
    cu_sampled = np.cumsum(num_sampled)
    starts = cu_sampled - num_sampled
    target_idx = np.concatenate([s + np.arange(n) for s, n in zip(starts, num_draft)] or [[]]).astype(np.int32)
    return SpecDecodeMetadata(
        draft_token_ids=torch.tensor(sum(draft_token_ids, []), dtype=torch.int32),
        num_draft_tokens=num_draft.tolist(),
        cu_num_draft_tokens=torch.tensor(np.cumsum(num_draft), dtype=torch.int32),
        cu_num_sampled_tokens=torch.tensor(cu_sampled, dtype=torch.int32),
        target_logits_indices=torch.tensor(target_idx, dtype=torch.int32),
        bonus_logits_indices=torch.tensor(cu_sampled - 1, dtype=torch.int32),
        logits_indices=torch.arange(int(cu_sampled[-1]), dtype=torch.int32),
    )


def sampling_metadata(temperatures: list[float], generators: dict | None = None, top_k=None, top_p=None):
    n = len(temperatures)
    temperature = torch.tensor(temperatures, dtype=torch.float32)
    return SamplingMetadata(
        temperature=temperature,
        all_greedy=bool((temperature == 0).all()),
        all_random=bool((temperature > 0).all()),
        top_p=None if top_p is None else torch.tensor(top_p, dtype=torch.float32),
        top_k=None if top_k is None else torch.tensor(top_k, dtype=torch.int32),
        generators=generators or {},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(n),
        presence_penalties=torch.zeros(n),
        repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in range(n)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


@pytest.fixture(scope="module")
def sampler():
    return ExactRejectionSampler(Sampler())


@pytest.mark.parametrize("method", ["synthetic", "block"])
def test_refuses_verification_methods_it_does_not_implement(method):
    """vLLM 0.32's speculative_config.rejection_sample_method: 'synthetic' accepts at configured rates,
    'block' verifies drafts jointly; neither is what this class does, so asking for one fails at start-up."""
    config = SimpleNamespace(rejection_sample_method=method, synthetic_acceptance_rates=[0.5])
    with pytest.raises(ValueError, match=f"rejection_sample_method='standard' only.*{method}"):
        ExactRejectionSampler(Sampler(), config, torch.device("cpu"))
    standard = SimpleNamespace(rejection_sample_method="standard", synthetic_acceptance_rates=None)
    assert ExactRejectionSampler(Sampler(), standard, torch.device("cpu")).synthetic_mode is False


def test_first_token_follows_target_with_real_draft_probs(sampler):
    """30,000 requests with one draft token x ~ q each: the first emitted token follows p (chi-square)."""
    n = 30_000
    torch.manual_seed(21)
    drafts = torch.multinomial(SEED_Q.expand(n, -1), 1)
    logits = SEED_P.log().expand(2 * n, -1).contiguous()  # per request: draft position, bonus position
    out = sampler(spec_metadata(drafts.tolist()), SEED_Q.expand(n, -1).contiguous(), logits,
                  sampling_metadata([1.0] * n)).sampled_token_ids
    assert out.dtype == torch.int32 and out.shape == (n, 2)
    assert chi_square_p_value(out[:, 0].long().numpy(), SEED_P.numpy()) > P_VALUE_FLOOR
    accepted = (out[:, 0] == drafts[:, 0].int()).float().mean().item()
    # A rejected x has p(x) < q(x), so max(0, p - q) never recovers x: acceptance is alpha = 0.85.
    alpha = acceptance_rate(SEED_P, SEED_Q).item()
    assert abs(accepted - alpha) < 0.01


def test_mixed_ragged_batch(sampler):
    """Greedy, sampled and seeded requests with 3, 0 and 2 drafts; greedy follows the argmax."""
    v = 8
    torch.manual_seed(0)
    logits = torch.randn(3 + 1 + 1 + 2 + 1, v) * 3
    greedy_argmax = logits[:4].argmax(-1).tolist()
    drafts = [[greedy_argmax[0], greedy_argmax[1], (greedy_argmax[2] + 1) % v], [], [1, 2]]
    meta = spec_metadata(drafts)

    def run():
        gens = {2: torch.Generator().manual_seed(5)}
        return sampler(meta, None, logits.clone(), sampling_metadata([0.0, 1.0, 0.8], gens)).sampled_token_ids

    out = run()
    assert out.shape == (3, 4)
    # Greedy: two drafts accepted, the third replaced by the target's argmax.
    assert out[0].tolist() == greedy_argmax[:3] + [-1]
    # No drafts: just the bonus token.
    assert out[1, 0] >= 0 and out[1, 1:].tolist() == [-1, -1, -1]
    # Seeded: the same tokens every time.
    assert out[2].tolist() == run()[2].tolist()


def test_all_greedy_batch(sampler):
    """The greedy-only path: accepted while equal to the argmax, then the argmax; the bonus when all pass."""
    v = 6
    torch.manual_seed(1)
    logits = torch.randn(3 + 1 + 2 + 1, v)
    argmax = logits.argmax(-1).tolist()
    drafts = [[argmax[0], (argmax[1] + 1) % v, argmax[2]], [argmax[4], argmax[5]]]
    out = sampler(spec_metadata(drafts), None, logits.clone(), sampling_metadata([0.0, 0.0])).sampled_token_ids
    assert out.tolist() == [[argmax[0], argmax[1], -1, -1], [argmax[4], argmax[5], argmax[6], -1]]


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_logprobs_of_draft_positions_follow_the_logprobs_mode(mode):
    """Top logprobs at every draft position: of the raw logits in raw mode; in processed mode of what the
    position samples from (temperature 0.5, top-k 3), as vLLM's own verification and its bonus token give."""
    from dataclasses import replace

    v, k_top, drafts = 10, 2, [[1, 2, 3], [4]]
    torch.manual_seed(3)
    logits = torch.randn(3 + 1 + 1 + 1, v) * 2
    meta = spec_metadata(drafts)
    exact = ExactRejectionSampler(Sampler(logprobs_mode=mode))
    sampling = replace(sampling_metadata([0.5, 0.5], top_k=[3, 3]), max_num_logprobs=k_top)
    out = exact(meta, None, logits.clone(), sampling)
    # Rows of the logprobs tensors: request by request, max_spec_len + 1 positions each (the sampled
    # token's logprob first, then the top k_top).
    top = out.logprobs_tensors.logprobs.view(len(drafts), meta.max_spec_len + 1, k_top + 1)[..., 1:]
    positions = meta.target_logits_indices.long()
    if mode == "raw_logprobs":
        expected = logits[positions].log_softmax(-1)
    else:
        scaled = logits[positions] / 0.5
        kept = scaled >= scaled.topk(3, dim=-1).values[:, -1:]
        expected = scaled.masked_fill(~kept, float("-inf")).log_softmax(-1)
    expected_top = expected.topk(k_top, dim=-1).values  # [num_draft_tokens, k_top]
    got = torch.cat([top[0, :3], top[1, :1]])  # the draft positions of each request
    torch.testing.assert_close(got, expected_top, rtol=1e-5, atol=1e-5)


def test_each_request_is_verified_against_its_own_temperature_and_top_k(sampler):
    """20,000 requests of two drafts each, alternating between temperature 0.7 and temperature 1.3 with
    top-k 4, each request's drafts drawn from the draft's distribution under its own parameters: each
    request's first emitted token follows the target's distribution under its own parameters (chi-square,
    p-value above 1e-3, seed 8), and not the other group's (the same check would catch parameters laid
    out per token in the wrong order, which gives every odd request its neighbour's)."""
    n, k = 20_000, 2
    groups = [(0.7, 10), (1.3, 4)]  # (temperature, top_k); top-k of the whole vocabulary is none, as vLLM writes it

    def processed(probs: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
        logits = probs.log() / temperature
        if top_k < len(probs):
            logits = logits.masked_fill(logits < logits.topk(top_k).values[-1], float("-inf"))
        return logits.softmax(-1)

    p = [processed(SEED_P, *g) for g in groups]
    q = [processed(SEED_Q, *g) for g in groups]
    group = torch.arange(n) % 2  # [n]
    torch.manual_seed(8)
    q_rows = torch.stack(q)[group]  # [n, V]
    drafts = torch.multinomial(q_rows, k, replacement=True)  # [n, k]: drafts of a context-free target
    draft_probs = q_rows.repeat_interleave(k, dim=0)  # [n * k, V] in the metadata's order
    logits = SEED_P.log().expand(n * (k + 1), -1).contiguous()  # every position: p before processing
    temperatures = [groups[g][0] for g in group.tolist()]
    top_ks = [groups[g][1] for g in group.tolist()]
    out = sampler(spec_metadata(drafts.tolist()), draft_probs, logits,
                  sampling_metadata(temperatures, top_k=top_ks)).sampled_token_ids
    first = out[:, 0].long().numpy()
    for g in (0, 1):
        mine = first[group.numpy() == g]
        assert chi_square_p_value(mine, p[g].numpy()) > P_VALUE_FLOOR, groups[g]
        assert chi_square_p_value(mine, p[1 - g].numpy()) < P_VALUE_FLOOR, groups[g]


def builtin_processors(params: list) -> LogitsProcessors:
    """vLLM's own min-p and logit-bias processors, holding a batch of requests with these SamplingParams
    in rows 0..n-1, as the model runner's persistent batch hands them over."""
    from vllm.v1.sample.logits_processor import BatchUpdateBuilder
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinPLogitsProcessor

    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=len(params)))
    processors = [MinPLogitsProcessor(config, torch.device("cpu"), False),
                  LogitBiasLogitsProcessor(config, torch.device("cpu"), False)]
    update = BatchUpdateBuilder(added=[(row, p, None, []) for row, p in enumerate(params)]).get_and_reset(len(params))
    for processor in processors:
        processor.update_state(update)
    return LogitsProcessors(processors)


def test_draft_positions_are_verified_with_each_requests_min_p_and_logit_bias(sampler):
    """vLLM's own verification applies neither min-p nor logit bias at draft positions (and so vLLM refuses
    both with speculation); ours applies both, in the plain sampler's order. 20,000 requests of two drafts
    each, at temperature 0.8, alternating between min-p 0.3 and a logit bias (+1.5 on token 2, -100 on
    token 0), drafts drawn from q: each group's first emitted token follows the target's distribution
    under its own parameters (chi-square, p-value above 1e-3, seed 9) and not the plain target's."""
    from vllm import SamplingParams

    n, k, temperature = 20_000, 2, 0.8
    group_params = [SamplingParams(temperature=temperature, min_p=0.3),
                    SamplingParams(temperature=temperature, logit_bias={2: 1.5, 0: -100.0})]
    scaled = SEED_P.log() / temperature
    min_p = scaled.softmax(-1)
    min_p = torch.where(min_p >= 0.3 * min_p.max(), min_p, 0.0)
    bias = torch.zeros_like(SEED_P)
    bias[2], bias[0] = 1.5 / temperature, -100.0 / temperature
    expected = [min_p / min_p.sum(), (scaled + bias).softmax(-1)]
    group = torch.arange(n) % 2  # [n]
    torch.manual_seed(9)
    drafts = torch.multinomial(SEED_Q.expand(n, -1), k, replacement=True)  # [n, k]
    draft_probs = SEED_Q.expand(n * k, -1).contiguous()  # [n * k, V]
    logits = SEED_P.log().expand(n * (k + 1), -1).contiguous()
    meta = sampling_metadata([temperature] * n)
    meta.logitsprocs = builtin_processors([group_params[g] for g in group.tolist()])
    out = sampler(spec_metadata(drafts.tolist()), draft_probs, logits, meta).sampled_token_ids
    first = out[:, 0].long().numpy()
    plain = (SEED_P.log() / temperature).softmax(-1)
    for g in (0, 1):
        mine = first[group.numpy() == g]
        assert chi_square_p_value(mine, expected[g].numpy()) > P_VALUE_FLOOR, g
        assert chi_square_p_value(mine, plain.numpy()) < P_VALUE_FLOOR, g
    assert not (first[group.numpy() == 1] == 0).any()  # banned by its bias, though q proposes it a fifth of the time
    assert set(first[group.numpy() == 0].tolist()) <= set(torch.nonzero(min_p).view(-1).tolist())


def test_logit_bias_lands_on_every_draft_position_of_its_request():
    from plugin.vllm_rejection_sampler import add_logit_bias

    logits = torch.zeros(5, 4)
    add_logit_bias(logits, {0: {1: 2.0}, 2: {0: -1.0, 3: 5.0}}, [2, 0, 3])
    expected = torch.zeros(5, 4)
    expected[:2, 1] = 2.0
    expected[2:, 0], expected[2:, 3] = -1.0, 5.0
    assert torch.equal(logits, expected)
    add_logit_bias(logits, {}, [2, 0, 3])
    assert torch.equal(logits, expected)
