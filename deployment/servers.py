"""Ray Serve LLM's OpenAI ingress and LLM server, with what serving engineers expect on top:
OpenAI-style errors for unknown models, a `/health` route that asks every model's replicas, a count of
the engine's unfinished requests (for drain checks and tests), and the speculator's counters (the
chosen-K histogram, the share of steps and requests that drafted, the step-cost model) as JSON on
`/v1/specserve/stats` and as Prometheus metrics through Ray's metrics export."""

import asyncio
import logging

from fastapi import HTTPException
from ray.serve.llm import LLMServer

from deployment._ray_internals import IngressInternals, OpenAIHTTPException, engine_client


class SpecServeIngress(IngressInternals):
    def unknown_model(self, exc: HTTPException) -> Exception:
        return OpenAIHTTPException(
            status_code=exc.status_code,
            message=f"{exc.detail} Available models: {self.model_ids()}",
            type="NotFoundError" if exc.status_code == 404 else "BadRequestError",
        )

    async def health(self) -> dict:
        """200 once every model answers its engine health check; 503 otherwise."""
        for model_id, handle in self.model_handles().items():
            try:
                await handle.check_health.remote()
            except Exception as exc:  # noqa: BLE001 - any failure means not ready
                raise OpenAIHTTPException(503, f"model {model_id} is not healthy: {exc}", "ServiceUnavailable")
        return {"status": "ok", "models": self.model_ids()}

    async def speculation_stats(self) -> dict:
        """Each model's speculator counters (one replica each asked); {"enabled": false} for the baseline."""
        return {model_id: await handle.speculation_stats.remote()
                for model_id, handle in self.model_handles().items()}

    async def unfinished_requests(self) -> dict:
        """Unfinished requests in each model's engine (one replica each asked): drain checks, tests."""
        return {model_id: await handle.num_unfinished_requests.remote()
                for model_id, handle in self.model_handles().items()}


class SpecServeLLMServer(LLMServer):
    async def num_unfinished_requests(self) -> int:
        """Requests the engine of this replica still holds (running or waiting)."""
        return engine_client(self).output_processor.get_num_unfinished_requests()

    async def speculation_stats(self) -> dict:
        """The speculator's counters from this replica's engine (`SpeculativeWorker.specserve_stats`)."""
        config = await self.llm_config()
        if not (config and config.engine_kwargs.get("speculative_config")):
            return {"enabled": False}
        return (await self.collective_rpc("specserve_stats"))[0]

    async def start(self):
        await super().start()
        self._metrics_task = asyncio.get_running_loop().create_task(publish_speculation_metrics(self))


PUBLISH_INTERVAL_S = 10.0


async def publish_speculation_metrics(server: SpecServeLLMServer, interval_s: float = PUBLISH_INTERVAL_S) -> None:
    """Export the speculator's counters as Prometheus counters (Ray prefixes them with `ray_`):
    specserve_chosen_k{k} (request-steps by chosen draft length), specserve_steps{drafted} and
    specserve_finished_requests{drafted}. Polled from the engine; a replica without a speculator
    publishes nothing."""
    from ray.util.metrics import Counter

    if not (await server.speculation_stats()).get("enabled"):
        return
    model = (await server.llm_config()).model_id
    chosen_k = Counter("specserve_chosen_k", "request-steps by the draft length the policy chose", ("model", "k"))
    steps = Counter("specserve_steps", "engine steps, by whether any request drafted", ("model", "drafted"))
    finished = Counter("specserve_finished_requests", "finished requests, by whether they ever drafted", ("model", "drafted"))
    seen: dict = {}
    while True:
        try:
            stats = await server.speculation_stats()
            for k, count in enumerate(stats["chosen_k_histogram"]):
                _inc(chosen_k, seen, ("k", str(k)), count, model)
            _inc(steps, seen, ("drafted", "true"), stats["steps_drafted"], model)
            _inc(steps, seen, ("drafted", "false"), stats["steps"] - stats["steps_drafted"], model)
            _inc(finished, seen, ("drafted", "true"), stats["finished_requests_drafted"], model)
            _inc(finished, seen, ("drafted", "false"), stats["finished_requests"] - stats["finished_requests_drafted"], model)
        except Exception as exc:  # noqa: BLE001 - metrics must never take the replica down
            logging.getLogger("specserve.metrics").warning("speculation metrics not published: %s", exc)
        await asyncio.sleep(interval_s)


def _inc(counter, seen: dict, tag: tuple[str, str], total: int, model: str) -> None:
    """Counters only go up: add what the engine's running total gained since the last poll."""
    key = (counter.info["name"], *tag)
    delta = total - seen.get(key, 0)
    if delta > 0:
        counter.inc(delta, tags={"model": model, tag[0]: tag[1]})
    seen[key] = total
