"""`ExactRejectionSampler`: vLLM 0.32's `RejectionSampler` contract on top of `plugin.sampling`.

vLLM's model runner calls `rejection_sampler(spec_decode_metadata, draft_probs, logits,
sampling_metadata) -> SamplerOutput`. This class keeps that contract and vLLM's own handling of what
surrounds verification (penalties, bad words, min-tokens, logprobs, and the bonus token, which vLLM's
plain `Sampler` draws exactly as the non-speculative engine would), adds what vLLM's own verification
leaves out at draft positions (logit bias and min-p, which vLLM therefore refuses with speculation;
`internals.admit_min_p_and_logit_bias` lets them in for ours), and replaces the accept/recover
step with the exact test of `plugin.sampling.rejection_sample`: accept x with min(1, p(x) / q(x))
against the draft's full processed distribution q, recover from normalise(max(0, p - q)).

draft_probs is [num_draft_tokens, vocab] in the flattened order of the metadata, or None, meaning
every draft token was proposed deterministically (q one-hot at it).
"""

from dataclasses import replace

import torch
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.rejection_sampler import RejectionSampler
from vllm.v1.sample.sampler import Sampler
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

from plugin import _vllm_internals as internals
from plugin.sampling import argmax, greedy_verify, pad_ragged, probs_of, processed_logits, rejection_sample

HONOURED_METHODS = ("standard",)


def _per_token(values: torch.Tensor | None, num_draft_tokens: list[int]) -> torch.Tensor | None:
    """Per-request sampling parameters [batch] repeated for each of the request's draft tokens."""
    if values is None:
        return None
    counts = torch.as_tensor(num_draft_tokens, device=values.device)
    return values.repeat_interleave(counts)


def add_logit_bias(logits: torch.Tensor, biases: dict[int, dict[int, float]], num_draft_tokens: list[int]) -> None:
    """Add each request's logit_bias ({batch row: {token id: bias}}) to its draft positions' rows of
    logits [num_draft_tokens, vocab], in place."""
    if not biases:
        return
    first = [0]
    for n in num_draft_tokens[:-1]:
        first.append(first[-1] + n)
    rows, tokens, values = [], [], []
    for request, bias in biases.items():
        if request < len(num_draft_tokens):
            for row in range(first[request], first[request] + num_draft_tokens[request]):
                rows += [row] * len(bias)
                tokens += bias.keys()
                values += bias.values()
    if rows:  # one (row, token) pair at most once: += adds every bias
        logits[rows, tokens] += torch.tensor(values, dtype=logits.dtype, device=logits.device)


class ExactRejectionSampler(RejectionSampler):
    """vLLM's `RejectionSampler` with the exact accept/recover test of `plugin.sampling`.

    Only `speculative_config.rejection_sample_method="standard"` is honoured: "synthetic" (accept at
    configured rates) and "block" (block verification) are different algorithms, so asking for them is
    refused at start-up rather than silently given standard verification.
    """

    def __init__(self, sampler: Sampler, spec_config=None, device: torch.device | None = None):
        method = getattr(spec_config, "rejection_sample_method", "standard")
        if method not in HONOURED_METHODS:
            raise ValueError(
                f"specserve's ExactRejectionSampler implements rejection_sample_method='standard' only; "
                f"speculative_config asks for {method!r}. Remove rejection_sample_method from the "
                f"speculative config, or use vLLM's own speculator for {method!r} verification.")
        super().__init__(sampler, spec_config, device)

    def forward(
        self,
        metadata: SpecDecodeMetadata,
        draft_probs: torch.Tensor | None,  # [num_draft_tokens, vocab] or None (one-hot drafts)
        logits: torch.Tensor,  # [num_draft_tokens + batch, vocab]: each request's draft positions, then its bonus position
        sampling_metadata: SamplingMetadata,
    ) -> SamplerOutput:
        """Verify every request's drafts; returns sampled_token_ids [batch, max_spec_len + 1] int32,
        each row its accepted tokens, then one recovered or bonus token, then -1 padding."""
        num_draft = metadata.num_draft_tokens  # [batch] python ints
        batch, width = len(num_draft), metadata.max_spec_len
        if width == 0:
            # No request drafted (the policy chose K = 0 for all): logits are one row per request, and
            # vLLM's plain sampler does exactly what the non-speculative engine does with them.
            return self.sampler(logits=logits, sampling_metadata=sampling_metadata)

        # Bonus tokens: vLLM's own sampler, from the target's processed next distribution.
        bonus_output = self.sampler(
            logits=logits[metadata.bonus_logits_indices],
            sampling_metadata=replace(sampling_metadata, max_num_logprobs=-1),
            predict_bonus_token=True,
            logprobs_mode_override="processed_logits" if self.is_processed_logprobs_mode else "raw_logits",
        )
        bonus_token_ids = bonus_output.sampled_token_ids.view(-1).long()  # [batch]

        raw_target_logits = logits[metadata.target_logits_indices].to(torch.float32)  # [num_draft_tokens, vocab]
        # The processors work in place; raw logits are kept apart only for raw logprobs. Logit bias goes
        # first, as in vLLM's plain sampler: a repetition penalty scales what it has added.
        keep_raw = sampling_metadata.max_num_logprobs is not None and not self.is_processed_logprobs_mode
        target_logits = raw_target_logits.clone() if keep_raw else raw_target_logits
        add_logit_bias(target_logits, internals.logit_biases(sampling_metadata), num_draft)
        target_logits = self.apply_logits_processors(target_logits, sampling_metadata, metadata)

        rows = torch.arange(batch, device=logits.device)
        bonus_at = torch.as_tensor(num_draft, device=logits.device)
        drafts = pad_ragged(metadata.draft_token_ids.long(), num_draft, width, fill=-1)  # [batch, width]
        all_greedy = sampling_metadata.all_greedy or sampling_metadata.temperature is None
        per_token = None if all_greedy else (  # each request's temperature, top_k, top_p at its draft positions
            _per_token(sampling_metadata.temperature, num_draft),
            _per_token(sampling_metadata.top_k, num_draft),
            _per_token(sampling_metadata.top_p, num_draft))
        if all_greedy:
            # Greedy only: the argmax decides and no distribution is needed; the bonus is vLLM's argmax.
            target_argmax = pad_ragged(argmax(target_logits), num_draft, width + 1)
            target_argmax[rows, bonus_at] = bonus_token_ids
            output_token_ids, _ = greedy_verify(drafts, target_argmax)
        else:
            temperature = sampling_metadata.temperature
            min_p = _per_token(internals.min_p_by_row(sampling_metadata), num_draft)  # after temperature, as vLLM's
            processed = processed_logits(target_logits, *per_token, min_p=min_p)  # [num_draft_tokens, vocab]
            target_probs = probs_of(processed, target_logits, per_token[0])
            # Row i: p at its draft positions, then a one-hot at its bonus token (already drawn from p_n).
            padded_target = pad_ragged(target_probs, num_draft, width + 1)  # [batch, width + 1, vocab]
            padded_target[rows, bonus_at] = torch.nn.functional.one_hot(bonus_token_ids, target_probs.size(-1)).float()
            padded_draft_probs = None if draft_probs is None else pad_ragged(draft_probs.float(), num_draft, width)
            generators = [sampling_metadata.generators.get(i) for i in range(batch)]
            output_token_ids, _ = rejection_sample(drafts, padded_draft_probs, padded_target, temperature <= 0, generators)
        output_token_ids = output_token_ids.to(torch.int32)

        logprobs_tensors = None
        if sampling_metadata.max_num_logprobs is not None:
            if not self.is_processed_logprobs_mode:
                logprob_logits = raw_target_logits
            else:
                # Processed logprobs are of what each position samples from, temperature, top-k and top-p
                # applied, as the bonus token's are and as vLLM's own verification passes them (its
                # `apply_sampling_constraints`, a Triton kernel that a CPU has not); greedy: the logits.
                logprob_logits = target_logits if all_greedy else processed
            logprobs_tensors = internals.logprobs_tensors(
                self,
                sampling_metadata.max_num_logprobs,
                metadata,
                logits,
                logprob_logits,
                bonus_output.logprobs_tensors.logprobs,
                output_token_ids,
            )
        return SamplerOutput(sampled_token_ids=output_token_ids, logprobs_tensors=logprobs_tensors)
