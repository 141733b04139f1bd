"""Every use of Ray 2.60 internals, in one place, each with the reason no public API serves.

Ray Serve LLM's public surface (`ray.serve.llm`: `LLMConfig`, `LLMServer`, `build_llm_deployment`,
`OpenAiIngress`, `make_fastapi_ingress`) builds an OpenAI app, but adding routes to it, shaping its
errors and asking its engines for counts reaches into `ray.llm._internal`. So the deployment is pinned to
the Ray version it was tested on, and refuses any other at start-up (SPECSERVE_ALLOW_UNTESTED_RAY=1 turns
that into a warning).
"""

import ray
from fastapi import HTTPException
from ray.serve.llm.ingress import OpenAiIngress

from plugin.version_check import refuse_untested


def check_ray_version(version: str) -> None:
    refuse_untested("Ray", version, "2.60.0", "deployment/_ray_internals.py", "ray[serve]==2.60.0")


check_ray_version(ray.__version__)

# The ingress's error type: an HTTP exception that its exception handler renders as an OpenAI error body.
from ray.llm._internal.serve.core.configs.openai_api_models import OpenAIHTTPException  # noqa: E402
# The model card /v1/models lists: built from an LLMConfig by the same function build_openai_app uses.
from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata  # noqa: E402
# The ingress's standard routes, to which make_fastapi_ingress's endpoint_map adds /health and ours.
from ray.llm._internal.serve.core.ingress.ingress import DEFAULT_ENDPOINTS  # noqa: E402
# The ingress's FastAPI app with Ray LLM's error, CORS, metrics and request-id middleware, as
# make_fastapi_ingress builds it when given none: built here so the API-key check can go in front.
from ray.llm._internal.serve.core.ingress.ingress import init as new_ingress_app  # noqa: E402
# The ingress's default deployment options, merged with ours as build_openai_app merges them.
from ray.llm._internal.common.dict_utils import maybe_apply_llm_deployment_config_defaults  # noqa: E402

# What a request to a replica whose vLLM engine died raises (wrapped by Ray in a RayTaskError that is
# also an instance of it): vLLM's engine module is the only place it is defined.
from vllm.v1.engine.exceptions import EngineDeadError  # noqa: E402

__all__ = ["EngineDeadError", "DEFAULT_ENDPOINTS", "IngressInternals", "OpenAIHTTPException", "engine_client",
           "maybe_apply_llm_deployment_config_defaults", "new_ingress_app", "to_model_metadata"]


class IngressInternals(OpenAiIngress):
    """OpenAiIngress with its private state named: the model ids and per-model handles it keeps (no
    accessor exists), and its model lookup, whose unknown-model error is a bare FastAPI 404 unless
    `unknown_model` shapes it."""

    def model_ids(self) -> list[str]:
        return sorted(self._model_cards)

    def model_handles(self) -> dict:
        return dict(self._default_serve_handles)

    def unknown_model(self, exc: HTTPException) -> Exception:
        return exc

    async def _get_model_id(self, model):
        try:
            model_id = await super()._get_model_id(model)
        except HTTPException as exc:
            raise self.unknown_model(exc) from None
        if model_id not in self._model_cards:
            # Ray's lookup passes "<model>:<anything>" as a LoRA adapter of <model>, which fails in the
            # replica as a 500; no model here serves adapters, so such an id is an unknown model.
            raise self.unknown_model(HTTPException(404, f'Could not find model with id "{model_id}".'))
        return model_id


def engine_client(server):
    """The vLLM AsyncLLM inside an LLMServer replica: Ray's engine wrapper keeps it private and exposes
    no request counts."""
    return server.engine._engine_client
