"""The application builder: the target with the exact speculator and the same target without it,
side by side behind one OpenAI-compatible route, as two model ids (and, for comparisons, more
speculative variants of the same pair: fixed K, another K_max).

`serve run serve_config.yaml` calls `build_app` with the YAML's `args`, validated into `SpecServeArgs`.
"""

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from deployment.defaults import (
    BASELINE_MODEL_ID,
    DEMO_DRAFT,
    DEMO_ENGINE_KWARGS,
    DEMO_NUM_SPECULATIVE_TOKENS,
    DEMO_TARGET,
    REPO_ROOT,
    SPECULATIVE_MODEL_ID,
    cpu_engine_env,
)
from plugin.config import speculative_engine_kwargs


class SpecServeArgs(BaseModel):
    """The application's arguments; every default is the embedded default (`deployment.defaults`)."""

    model_config = ConfigDict(extra="forbid")  # a misspelt key in the YAML is an error, not a no-op

    target_model: str = Field(DEMO_TARGET, description="path or hub id of the target")
    draft_model: str = Field(DEMO_DRAFT, description="path or hub id of the draft (same tokenizer)")
    num_speculative_tokens: int = Field(DEMO_NUM_SPECULATIVE_TOKENS, ge=1, le=16)
    speculative_model_id: str = Field(SPECULATIVE_MODEL_ID, min_length=1)
    baseline_model_id: str = Field(BASELINE_MODEL_ID, min_length=1)
    accelerator: Literal["cpu", "gpu"] = "cpu"
    accelerator_type: Optional[str] = Field(None, description="e.g. H100; GPU only")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, validate_default=True,
                                          description="vLLM engine arguments shared by both models: on cpu "
                                                      "over the embedded default's (DEMO_ENGINE_KWARGS: eager, "
                                                      "a KV cache in bytes, no chunked prefill, the dtype), "
                                                      "which a key given here replaces one by one; on gpu "
                                                      "as given")
    speculative_options: dict[str, Any] = Field(default_factory=dict,
                                                description="extra speculative_engine_kwargs options "
                                                            "(k_policy: adaptive, the default; fixed; off; request_speed_floor: "
                                                            "a share of a request's plain speed none falls below)")
    speculative_variants: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="more speculative model ids on the same target and draft, each with its own "
                    "speculative_engine_kwargs options over speculative_options (num_speculative_tokens "
                    "included), e.g. {specserve-k4: {k_policy: fixed, num_speculative_tokens: 4}}")
    deployment_config: dict[str, Any] = Field(default_factory=dict,
                                              description="Ray Serve options per model: autoscaling_config, "
                                                          "max_ongoing_requests, ray_actor_options")
    engine_env: Optional[dict[str, str]] = Field(
        None, description="environment variables of the model replicas and their vLLM engines; default: "
                          "deployment.defaults.CPU_ENGINE_ENV on cpu (oneDNN's primitive cache bounded), "
                          "none on gpu")
    placement_bundles: Optional[list[dict[str, float]]] = Field(
        None, description="resources of each replica's engine; default 1 CPU (cpu) or 1 GPU (gpu)")
    ingress_deployment_config: dict[str, Any] = Field(default_factory=dict)
    api_key_file: Optional[str] = Field(
        None, description="a file on the node that builds the application holding the API key; "
                          "SPECSERVE_API_KEY in that node's environment takes precedence")
    require_api_key: bool = Field(False, description="refuse to start without an API key (profiles that "
                                                     "listen beyond loopback)")
    reports_dir: str = Field("reports", validate_default=True, description="where the charts page looks for the latest `specserve "
                                                    "loadtest --out` report and measure-pair.json (on the "
                                                    "ingress's node; relative: to the repository)")
    playground_race: Optional[Literal["one_after_the_other", "side_by_side"]] = Field(
        None, description="how the playground races the two models: one after the other where they share "
                          "cores (the default on cpu), side by side where each has its own accelerator (gpu)")

    @field_validator("engine_kwargs")
    @classmethod
    def _cpu_engine_defaults(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        """On cpu a YAML that sets one engine argument (the dtype, say) keeps the other CPU settings, each
        there for a reason (`deployment.defaults`); a GPU profile's are its own."""
        return DEMO_ENGINE_KWARGS | value if info.data.get("accelerator") == "cpu" else value

    @field_validator("reports_dir")
    @classmethod
    def _reports_under_repo(cls, value: str) -> str:
        return value if value.startswith("/") else str(REPO_ROOT / value)

    @field_validator("target_model", "draft_model")
    @classmethod
    def _repo_relative(cls, value: str) -> str:
        """Relative paths mean the repository's (Ray workers do not share the caller's cwd)."""
        local = REPO_ROOT / value
        return str(local) if not value.startswith("/") and local.exists() else value

    @model_validator(mode="after")
    def _distinct_model_ids(self) -> "SpecServeArgs":
        if self.baseline_model_id == self.speculative_model_id:
            raise ValueError(f"baseline_model_id must differ from speculative_model_id (both are "
                             f"{self.baseline_model_id!r}): one id cannot name two models")
        taken = set(self.speculative_variants) & {self.baseline_model_id, self.speculative_model_id}
        if taken:
            raise ValueError(f"speculative_variants may not reuse the model ids {sorted(taken)}")
        for model_id, options in self.speculative_variants.items():
            options = self.speculative_options | options
            speculative_engine_kwargs(self.draft_model, options.pop("num_speculative_tokens", self.num_speculative_tokens),
                                      **options)  # refuses an unknown or invalid option now, not in a replica
        return self


def llm_configs(args: SpecServeArgs) -> list:
    from ray.serve.llm import LLMConfig

    from deployment.servers import SpecServeLLMServer

    common: dict[str, Any] = {
        "deployment_config": args.deployment_config,
        "server_cls": SpecServeLLMServer,
        "log_engine_metrics": True,
    }
    if args.accelerator == "cpu":
        common["accelerator_config"] = {"kind": "cpu"}
    elif args.accelerator_type:
        common["accelerator_type"] = args.accelerator_type
    if args.placement_bundles:
        common["placement_group_config"] = {"bundles": args.placement_bundles}
    env = cpu_engine_env() if args.engine_env is None and args.accelerator == "cpu" else args.engine_env
    if env:  # Serve starts the replica with it; vLLM's engine processes inherit it from the replica
        # An LLMConfig's runtime_env replaces the application's env_vars for its replicas: keep those.
        common["runtime_env"] = {"env_vars": application_env_vars() | env}

    # Streaming responses end with a usage chunk, which carries the speculation summary.
    engine = args.engine_kwargs | {"enable_force_include_usage": True}

    def speculative(options: dict[str, Any]) -> dict[str, Any]:
        options = args.speculative_options | options
        k = options.pop("num_speculative_tokens", args.num_speculative_tokens)
        return engine | speculative_engine_kwargs(args.draft_model, k, **options)

    models = {args.speculative_model_id: speculative({}), args.baseline_model_id: engine}
    models |= {model_id: speculative(options) for model_id, options in args.speculative_variants.items()}
    return [LLMConfig(model_loading_config={"model_id": model_id, "model_source": args.target_model},
                      engine_kwargs=kwargs, **common) for model_id, kwargs in models.items()]


def application_env_vars() -> dict[str, str]:
    """The env_vars of the application's runtime_env, where the builder runs inside Ray (serve run)."""
    import ray

    if not ray.is_initialized():
        return {}
    return dict((ray.get_runtime_context().runtime_env or {}).get("env_vars") or {})


def api_key_sha256(args: SpecServeArgs) -> Optional[str]:
    """The digest the ingress checks keys against (None: no key, /v1 open); refuses a profile that
    requires a key and has none."""
    from deployment.admission import API_KEY_ENV, key_digest, read_api_key

    digest = key_digest(read_api_key(args.api_key_file))
    if digest is None and args.require_api_key:
        raise ValueError(f"this profile requires an API key (require_api_key: true): set {API_KEY_ENV} in the "
                         f"environment of the process that builds the application, or api_key_file in its args")
    return digest


def playground_settings(args: SpecServeArgs, api_key_required: bool) -> dict:
    """What the playground page is told (`deployment.playground.PlaygroundRoutes`)."""
    race = args.playground_race or ("one_after_the_other" if args.accelerator == "cpu" else "side_by_side")
    return {"speculative_model": args.speculative_model_id, "baseline_model": args.baseline_model_id,
            "num_speculative_tokens": args.num_speculative_tokens, "accelerator": args.accelerator,
            "api_key_required": api_key_required, "race": race, "reports_dir": args.reports_dir}


def build_app(args: SpecServeArgs):
    """Both models behind one OpenAI ingress: /v1/completions, /v1/chat/completions, /v1/models,
    /health (open without a key), /v1/specserve/unfinished_requests (per model over its replicas, for drain checks),
    /v1/specserve/replicas (per model, by state) and /v1/specserve/stats (per model: the speculator's
    chosen-K histogram, drafted shares and step-cost model, the replica's memory); the playground at
    /playground (/ redirects there) and the charts at /playground/charts."""
    from ray import serve
    from ray.serve.llm import build_llm_deployment
    from ray.serve.llm.ingress import make_fastapi_ingress

    from deployment._ray_internals import (DEFAULT_ENDPOINTS, maybe_apply_llm_deployment_config_defaults,
                                           new_ingress_app, to_model_metadata)
    from deployment.admission import check_api_key
    from deployment.playground import ENDPOINTS as PLAYGROUND_ENDPOINTS
    from deployment.servers import SpecServeIngress

    configs = llm_configs(args)
    digest = api_key_sha256(args)
    endpoints = {k: v for k, v in DEFAULT_ENDPOINTS.items() if k in ("models", "model_data", "completions", "chat")}
    endpoints["health"] = lambda app: app.get("/health")
    endpoints["unfinished_requests"] = lambda app: app.get("/v1/specserve/unfinished_requests")
    endpoints["replicas"] = lambda app: app.get("/v1/specserve/replicas")
    endpoints["speculation_stats"] = lambda app: app.get("/v1/specserve/stats")
    endpoints |= PLAYGROUND_ENDPOINTS
    app = new_ingress_app()
    app.middleware("http")(check_api_key)  # added last, so it runs first
    ingress = make_fastapi_ingress(SpecServeIngress, endpoint_map=endpoints, app=app)
    options = maybe_apply_llm_deployment_config_defaults(
        SpecServeIngress.get_deployment_options(configs), args.ingress_deployment_config)
    return serve.deployment(ingress, **options).bind(
        llm_deployments={c.model_id: build_llm_deployment(c) for c in configs},
        model_cards={c.model_id: to_model_metadata(c.model_id, c) for c in configs},
        api_key_sha256=digest,
        playground_settings=playground_settings(args, digest is not None),
    )
