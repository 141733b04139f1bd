"""`SpeculativeWorker`: vLLM's own worker for this platform, with the exact verifier swapped in.

Set as `worker_cls` by `plugin.speculative_engine_kwargs`. After the model runner has loaded the
target (and our `DraftProposer` its draft), it replaces the runner's rejection sampler with
`ExactRejectionSampler` and gives the proposer the runner, whose batch rows, sampling parameters and
draft-probability slot it uses. Finished requests' draft state is freed as the scheduler reports them.
"""

from vllm.platforms import current_platform

from plugin.proposer import DraftProposer
from plugin.vllm_rejection_sampler import ExactRejectionSampler

if current_platform.is_cpu():
    from vllm.v1.worker.cpu_worker import CPUWorker as _PlatformWorker
else:
    from vllm.v1.worker.gpu_worker import Worker as _PlatformWorker


class SpeculativeWorker(_PlatformWorker):
    def load_model(self, *args, **kwargs):
        result = super().load_model(*args, **kwargs)
        runner = self.model_runner
        if getattr(runner, "speculative_config", None) is not None:
            runner.rejection_sampler = ExactRejectionSampler(runner.sampler, runner.speculative_config, runner.device)
        if isinstance(self._drafter(), DraftProposer):
            self._drafter().attach(runner)
        return result

    def _drafter(self):
        return getattr(getattr(self, "model_runner", None), "drafter", None)

    def execute_model(self, scheduler_output, *args, **kwargs):
        drafter = self._drafter()
        if isinstance(drafter, DraftProposer) and scheduler_output.finished_req_ids:
            drafter.release(scheduler_output.finished_req_ids)
        return super().execute_model(scheduler_output, *args, **kwargs)

    def specserve_stats(self) -> dict:
        """Draft-side counters, for `LLM.collective_rpc("specserve_stats")` and the serving layer."""
        drafter = self._drafter()
        sampler = getattr(self.model_runner, "rejection_sampler", None)
        if not isinstance(drafter, DraftProposer):
            return {"enabled": False}
        return {
            "enabled": True,
            "exact_rejection_sampler": isinstance(sampler, ExactRejectionSampler),
            "tracked_requests": sorted(drafter.tracked_requests()),
            "runner_requests": sorted(self.model_runner.requests),
            **drafter.stats,
        }
