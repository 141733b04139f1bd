"""`SpeculativeWorker`: vLLM's own worker for this platform, with the exact verifier swapped in.

Set as `worker_cls` by `plugin.speculative_engine_kwargs`. After the model runner has loaded the
target (and our `DraftProposer` its draft), it replaces the runner's rejection sampler with
`ExactRejectionSampler` and gives the proposer the runner, whose batch rows, sampling parameters and
draft-probability slot it uses. Finished requests' draft state is freed as the scheduler reports them.
The drafts for the next step go back to the engine core on the step's own output, so the engine core
needs no round trip of its own to fetch them (`internals.attach_draft_token_ids`, and the executor side
in `plugin.engine_plugin`).

For the adaptive speculation policy it also times every decode step: the target's share (the step,
from execute_model to the end of sample_tokens, less the proposer's own time) against the requests,
tokens and drafts the scheduler gave it, and the engine's time from one decode step's end to the
next one's start (the scheduler and the output processing, which handle every draft token); and once
at start-up, after vLLM's warm-up, the target's forward at a range of token counts. Fixed-K and "off"
engines need no costs and skip both. Every step, whatever the policy, goes into a bounded step log
(`plugin.step_log.StepLog`) that the tooling takes with `specserve_take_step_log`.

Requests that ask for a trace (`plugin.trace`) have each step recorded from what the scheduler sent to
verify and what the step emitted; `specserve_take_trace` hands a finished trace over. A step with no
traced request in it does no trace work beyond one empty-dictionary check.
"""

import functools
import logging
import time
from pathlib import Path

from plugin import _vllm_internals as internals
from plugin.proposer import DraftProposer
from plugin.step_log import StepLog
from plugin.trace import TEXT_CONTEXT, TraceBook, trace_key
from plugin.vllm_rejection_sampler import ExactRejectionSampler


logger = logging.getLogger("specserve.worker")
CALIBRATION_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@functools.cache
def runtime_libraries() -> dict[str, bool]:
    """Whether this process runs with tcmalloc and Intel's OpenMP, which vLLM's CPU guide asks to preload
    (from /proc/self/maps; {} where there is none)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return {}
    return {"tcmalloc": "libtcmalloc" in maps, "intel_openmp": "libiomp5" in maps}


class SpeculativeWorker(internals.platform_worker_class()):
    _step_started: tuple | None = None
    # When the last decode step left the worker: the engine's time until the next one (scheduling,
    # output processing) is a step cost too. None after a step with a prompt in it, and while idle.
    _decode_step_ended: float | None = None
    _draft_token_requests = 0  # the engine core's own take_draft_token_ids calls (drafts not on the output)
    _traced_step: dict | None = None  # request id -> the drafts this step verifies, for traced requests

    @property
    def step_log(self) -> StepLog:
        if "_step_log" not in self.__dict__:
            self._step_log = StepLog()
        return self._step_log

    @property
    def traces(self) -> TraceBook:
        if "_traces" not in self.__dict__:
            self._traces = TraceBook()
        return self._traces

    def load_model(self, *args, **kwargs):
        result = super().load_model(*args, **kwargs)
        if internals.install_rejection_sampler(self.model_runner, ExactRejectionSampler):
            internals.restore_min_p_and_logit_bias(self.model_runner)  # verified by ExactRejectionSampler
        if drafter := self._draft_proposer():
            drafter.attach(self.model_runner)
            internals.hook_runner_steps(self.model_runner, self._execute_model, self._sample_tokens)
            if drafter.profile.enabled:
                internals.profile_runner_phases(self.model_runner, drafter.profile)
        return result

    def _draft_proposer(self) -> DraftProposer | None:
        runner = getattr(self, "model_runner", None)
        drafter = internals.runner_drafter(runner) if runner is not None else None
        return drafter if isinstance(drafter, DraftProposer) else None

    def compile_or_warm_up_model(self, *args, **kwargs):
        result = super().compile_or_warm_up_model(*args, **kwargs)
        if (drafter := self._draft_proposer()) and drafter.policy.mode == "adaptive":
            try:
                seconds = internals.time_target_forwards(self.model_runner, CALIBRATION_TOKENS)
                drafter.policy.calibrate_target(seconds)
                logger.info("specserve: target forward %s ms by scheduled tokens %s (step-cost calibration)",
                            [round(s * 1e3, 2) for s in seconds.values()], list(seconds))
            except Exception as exc:  # noqa: BLE001 - the online fit still learns the costs, from a worse start
                logger.warning("specserve: target calibration failed (%s); the step-cost model starts from its prior", exc)
        return result

    # The runner's step calls, hooked at load (`internals.hook_runner_steps`) so that every executor's
    # steps pass here, the Ray executor's included; `run` is the runner's own method.
    def _execute_model(self, run, scheduler_output, *args, **kwargs):
        drafter = self._draft_proposer()
        if scheduler_output.finished_req_ids:
            drafter.release(scheduler_output.finished_req_ids)
            self.traces.finish(scheduler_output.finished_req_ids)
        self._begin_trace_step(scheduler_output)
        drafter.scheduled_drafts = scheduler_output.scheduled_spec_decode_tokens
        self._step_started = None
        if scheduler_output.total_num_scheduled_tokens:
            now = time.perf_counter()
            drafted = scheduler_output.scheduled_spec_decode_tokens.values()
            drafts, longest = sum(map(len, drafted)), max(map(len, drafted), default=0)
            requests, tokens = len(scheduler_output.num_scheduled_tokens), scheduler_output.total_num_scheduled_tokens
            decode_only = tokens == requests + drafts  # a step with a prompt in it says little about decoding
            if drafter.policy.mode == "adaptive" and decode_only and self._decode_step_ended is not None:
                drafter.policy.observe_engine(requests, drafts, now - self._decode_step_ended)
            self._step_started = (now, requests, tokens, drafts, longest, decode_only)
            drafter.last_step_seconds = 0.0
        self._decode_step_ended = None
        output = run(scheduler_output, *args, **kwargs)
        if output is not None:
            self._end_step(drafter, output)
            self._record_trace_step(output)
        return output

    def _sample_tokens(self, run, *args, **kwargs):
        output = run(*args, **kwargs)
        self._end_step(self._draft_proposer(), output)
        self._record_trace_step(output)
        return internals.attach_draft_token_ids(self.model_runner, output)

    def take_draft_token_ids(self):
        """The engine core's own request for the drafts: only where they did not come with the output."""
        self._draft_token_requests += 1
        return super().take_draft_token_ids()

    def _begin_trace_step(self, scheduler_output) -> None:
        """Note the traced requests in this step and the drafts each one has verified."""
        for new in scheduler_output.scheduled_new_reqs:
            params = getattr(new, "sampling_params", None)
            if params is not None and (key := trace_key(params.extra_args, new.req_id)):
                self.traces.start(new.req_id, key, (new.prompt_token_ids or [])[-TEXT_CONTEXT:])
        if not self.traces.live:
            self._traced_step = None
            return
        spec = scheduler_output.scheduled_spec_decode_tokens
        self._traced_step = {req_id: spec.get(req_id, ()) for req_id in self.traces.live
                             if req_id in scheduler_output.num_scheduled_tokens}

    def _record_trace_step(self, output) -> None:
        """Each traced request's emitted tokens this step (accepted drafts, then recovered or bonus)."""
        step, self._traced_step = self._traced_step, None
        index = getattr(output, "req_id_to_index", None)  # None: not a ModelRunnerOutput
        if not step or index is None:
            return
        for req_id, drafted in step.items():
            if (row := index.get(req_id)) is not None and row < len(output.sampled_token_ids):
                self.traces.record(req_id, [int(t) for t in drafted], [int(t) for t in output.sampled_token_ids[row]])

    def specserve_take_trace(self, key: str) -> dict | None:
        """A traced request's steps, removed from the worker (`plugin.trace`), with what the response's
        figures need: K_max and the pair's cost ratio c (`SpeculationPolicy.cost_ratio`)."""
        drafter = self._draft_proposer()
        trace = self.traces.take(key)
        if trace is None or drafter is None:
            return trace
        return trace | {"k_max": drafter.k, "cost_ratio": drafter.policy.cost_ratio()}

    def _end_step(self, drafter: DraftProposer | None, output) -> None:
        """The step into the step log; for the adaptive step-cost model, a decode step's target time
        (the step less the proposer's part) and when it ended, for the engine's time until the next step."""
        if drafter is None or self._step_started is None:
            return
        started, requests, tokens, drafts, longest, decode_only = self._step_started
        self._step_started = None
        ended = time.perf_counter()
        emitted = sum(map(len, getattr(output, "sampled_token_ids", None) or ()))
        self.step_log.append(started, requests, tokens, drafts, longest, emitted, ended - started, drafter.last_step_seconds)
        if drafter.policy.mode == "adaptive" and decode_only:
            self._decode_step_ended = ended
            drafter.policy.observe_target(requests, tokens, drafts > 0, ended - started - drafter.last_step_seconds)

    def specserve_take_step_log(self) -> list[tuple]:
        """The steps recorded since the last take (`plugin.step_log.StepLog`, at most its size),
        removed from the worker: through `LLM.collective_rpc("specserve_take_step_log")`."""
        return self.step_log.take()

    def specserve_force_costs(self, overrides: dict | None) -> None:
        """Pin step-cost coefficients in seconds (`StepCosts` fields), or None to lift the pin: for tests
        and operators, through `LLM.collective_rpc("specserve_force_costs", args=(...,))`."""
        if drafter := self._draft_proposer():
            drafter.policy.force_costs(overrides)

    def specserve_force_k(self, k: int | None) -> None:
        """Every request drafts k tokens (0: none) until forced to None, whatever the K policy but "off";
        the adaptive policy's cost model keeps learning. Through
        `LLM.collective_rpc("specserve_force_k", args=(k,))`."""
        if drafter := self._draft_proposer():
            drafter.policy.force_k(k)

    def specserve_model_curve(self, requests: int) -> list[dict]:
        """The step-cost model's expectation for a batch of this many requests at each fixed K."""
        drafter = self._draft_proposer()
        return drafter.policy.model_curve(requests) if drafter else []

    def specserve_stats(self) -> dict:
        """Draft-side counters, for `LLM.collective_rpc("specserve_stats")` and the serving layer."""
        drafter = self._draft_proposer()
        if drafter is None:
            return {"enabled": False}
        return {
            "enabled": True,
            "exact_rejection_sampler": isinstance(self.model_runner.rejection_sampler, ExactRejectionSampler),
            "tracked_requests": sorted(drafter.tracked_requests()),
            "runner_requests": sorted(internals.runner_request_ids(self.model_runner)),
            "k_max": drafter.k,
            "models": {"target": drafter.target_model, "draft": str(drafter.draft_dir)},
            **drafter.stats,
            "compiled_decode": drafter.decode is not None and drafter.decode.failed is None,
            "profile_enabled": drafter.profile.enabled,
            "profile_seconds": dict(drafter.profile.seconds),
            **drafter.policy.summary(),
            **self.traces.held(),
            "draft_token_round_trips": self._draft_token_requests,
            "runtime_libraries": runtime_libraries(),
        }
