"""`SpeculativeWorker`: vLLM's own worker for this platform, with the exact verifier swapped in.

Set as `worker_cls` by `plugin.speculative_engine_kwargs`. After the model runner has loaded the
target (and our `DraftProposer` its draft), it replaces the runner's rejection sampler with
`ExactRejectionSampler` and gives the proposer the runner, whose batch rows, sampling parameters and
draft-probability slot it uses. Finished requests' draft state is freed as the scheduler reports them.
"""

from plugin import _vllm_internals as internals
from plugin.proposer import DraftProposer
from plugin.vllm_rejection_sampler import ExactRejectionSampler


class SpeculativeWorker(internals.platform_worker_class()):
    def load_model(self, *args, **kwargs):
        result = super().load_model(*args, **kwargs)
        internals.install_rejection_sampler(self.model_runner, ExactRejectionSampler)
        if drafter := self._draft_proposer():
            drafter.attach(self.model_runner)
        return result

    def _draft_proposer(self) -> DraftProposer | None:
        runner = getattr(self, "model_runner", None)
        drafter = internals.runner_drafter(runner) if runner is not None else None
        return drafter if isinstance(drafter, DraftProposer) else None

    def execute_model(self, scheduler_output, *args, **kwargs):
        drafter = self._draft_proposer()
        if drafter and scheduler_output.finished_req_ids:
            drafter.release(scheduler_output.finished_req_ids)
        return super().execute_model(scheduler_output, *args, **kwargs)

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
            **drafter.stats,
            "compiled_decode": drafter.decode is not None and drafter.decode.failed is None,
            "profile_enabled": drafter.profile.enabled,
            "profile_seconds": dict(drafter.profile.seconds),
        }
