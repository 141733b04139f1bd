"""Ray Serve LLM's OpenAI ingress and LLM server, with what serving engineers expect on top:
OpenAI-style errors for unknown models, a `/health` route that asks every model's replicas, and a
count of the engine's unfinished requests (for drain checks and tests)."""

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

    async def unfinished_requests(self) -> dict:
        """Unfinished requests in each model's engine (one replica each asked): drain checks, tests."""
        return {model_id: await handle.num_unfinished_requests.remote()
                for model_id, handle in self.model_handles().items()}


class SpecServeLLMServer(LLMServer):
    async def num_unfinished_requests(self) -> int:
        """Requests the engine of this replica still holds (running or waiting)."""
        return engine_client(self).output_processor.get_num_unfinished_requests()
