"""Ray Serve LLM's OpenAI ingress and LLM server, with what serving engineers expect on top:
the API key on `/v1` and OpenAI-shaped back-pressure (`deployment.admission`), OpenAI-style errors for
unknown models, a `/health` route that asks every model's replicas, each model's replica counts, a count
of the engine's unfinished requests (for drain checks and tests), and the speculator's counters (the
chosen-K histogram, the share of steps and requests that drafted, the step-cost model) with the
replica's memory as JSON on `/v1/specserve/stats` and as Prometheus metrics through Ray's metrics export.
A speculative request that asks for a trace (`"vllm_xargs": {"specserve_trace": 1}`) gets its per-step
trace in the response's "specserve_trace" field (on a stream: the final usage chunk), taken from the
engine's worker when the request ends; the ingress also serves the playground (`deployment.playground`)."""

import asyncio
import functools
import json
import logging
import math
import os
import time
import uuid
from typing import AsyncGenerator, Optional

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.llm import LLMServer
from ray.serve.llm.openai_api_models import ChatCompletionRequest, CompletionRequest, ErrorResponse

from deployment._ray_internals import EngineDeadError, IngressInternals, OpenAIHTTPException, engine_client
from deployment.admission import api_key_check, engine_restarting, openai_error, overloaded, within_queue_grace
from deployment.defaults import CPU_ENGINE_ENV
from deployment.playground import PlaygroundRoutes
from plugin.trace import TRACE_ARG, trace_document, wants_trace


HEALTH_CHECK_TIMEOUT_S = 5.0
# A model whose health check cannot get a place (its replicas at capacity, its queue full) is busy, not
# broken, if it started answering a request this recently (`SpecServeIngress.health`).
BUSY_ANSWERED_WITHIN_S = 30.0


class SpecServeIngress(PlaygroundRoutes, IngressInternals):
    def __init__(self, *args, api_key_sha256: Optional[str] = None, playground_settings: Optional[dict] = None, **kwargs):
        super().__init__(*args, **kwargs)
        api_key_check.require(api_key_sha256)
        self.playground_settings = playground_settings or {}
        self.answered_at: dict[str, float] = {}  # model -> when it last started a successful response (`health`)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        return await self.admitted(functools.partial(super().completions, body, request), body.model)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        return await self.admitted(functools.partial(super().chat, body, request), body.model)

    async def admitted(self, respond, model: str) -> Response:
        """respond()'s response, or the OpenAI-style reply a client can act on when the model cannot
        take the request: 429 when its queue is still full after the grace (`within_queue_grace`), 503
        while its engine is being replaced (both with Retry-After) instead of a bare 500."""
        try:
            response = await within_queue_grace(respond)
        except BackPressureError as exc:
            return overloaded(model, exc.status_code, exc.retry_after_s)
        except EngineDeadError:  # Ray raises RayTaskError(EngineDeadError), an instance of both
            return engine_restarting(model)
        if response.status_code < 400:  # a stream returns once its first chunk has come: the engine moves
            self.answered_at[model] = time.monotonic()
        return response

    def unknown_model(self, exc: HTTPException) -> Exception:
        return OpenAIHTTPException(
            status_code=exc.status_code,
            message=f"{exc.detail} Available models: {self.model_ids()}",
            type="NotFoundError" if exc.status_code == 404 else "BadRequestError",
        )

    async def health(self) -> Response:
        """200 once every model has a running replica whose engine passes its health check; 503 otherwise,
        at once: a request to a model without a running replica would wait for one. The models are asked
        at the same time, each for up to HEALTH_CHECK_TIMEOUT_S. The 503 is returned, not raised: Ray
        Serve LLM logs every exception a route raises as an ERROR with its traceback, and a readiness
        probe polling through an engine's start (a minute or two) would fill the log with them.

        The check goes through the model's handle, which queues it like a request, so a busy model can
        keep it waiting past the timeout or refuse it (its queue full). That is load, not a fault, when the
        model has started answering a request within BUSY_ANSWERED_WITHIN_S: a probe on /health must not
        take a node out of service for being busy. A model that neither takes the check nor answers
        requests is stuck (an engine that hangs without dying stays RUNNING to Serve's own checks)."""
        replicas = await self.replicas()
        handles = self.model_handles()
        failures = await asyncio.gather(*(self._unhealthy(model_id, handle, replicas[model_id])
                                          for model_id, handle in handles.items()))
        for model_id, failure in zip(handles, failures):
            if failure:
                return openai_error(503, f"model {model_id} is not healthy: {failure}", "service_unavailable",
                                    "model_unhealthy")
        return JSONResponse({"status": "ok", "models": self.model_ids()})

    async def _unhealthy(self, model_id: str, handle, replicas: dict) -> Optional[str]:
        """Why the model is not healthy (`health`), or None."""
        if not replicas.get("RUNNING"):
            return f"no running replica ({replicas})"
        try:
            await asyncio.wait_for(handle.check_health.remote(), HEALTH_CHECK_TIMEOUT_S)
        except (BackPressureError, asyncio.TimeoutError) as exc:
            if time.monotonic() - self.answered_at.get(model_id, -math.inf) < BUSY_ANSWERED_WITHIN_S:
                return None  # busy
            return (f"its health check found no place ({type(exc).__name__}) and it answered no request in the "
                    f"last {BUSY_ANSWERED_WITHIN_S:.0f} s")
        except Exception as exc:  # noqa: BLE001 - any failure means not ready
            return repr(exc)
        return None

    async def speculation_stats(self, model: Optional[str] = None, every_replica: bool = False) -> dict:
        """Each model's speculator counters, from one of its replicas ({"enabled": false} for the
        baseline); `?model=` asks that model alone, and wakes no other engine's worker. With
        `?every_replica=true`, each model's running replicas by their tag ({model: {tag: counters}}):
        counters are per engine, and an autoscaled model's work is spread over several."""
        if model is not None:
            await self._get_model_id(model)  # the ingress's own lookup: an unknown model is its OpenAI-style 404
        handles = {model_id: handle for model_id, handle in self.model_handles().items() if model in (None, model_id)}
        if not every_replica:
            return {model_id: await handle.speculation_stats.remote() for model_id, handle in handles.items()}
        replicas = await self.replicas()
        return {model_id: await _every_replica(handle.speculation_stats.remote, replicas[model_id].get("RUNNING", 0))
                for model_id, handle in handles.items()}

    async def replicas(self) -> dict:
        """Each model's replicas by state (RUNNING, STARTING, STOPPING, ...), from Serve's status."""
        status = await asyncio.to_thread(serve.status)  # a blocking call to the controller
        counts = {}
        for model_id, handle in self.model_handles().items():
            deployment = status.applications[handle.app_name].deployments[handle.deployment_name]
            counts[model_id] = {str(getattr(state, "value", state)): n for state, n in deployment.replica_states.items()}
        return counts

    async def unfinished_requests(self, every_replica: bool = False) -> dict:
        """Unfinished requests in each model's engines, summed over its running replicas ({model: n}), for
        drain checks: under autoscaling a model's requests are spread over several engines. With
        `?every_replica=true`, by replica tag ({model: {tag: n}})."""
        replicas = await self.replicas()
        counts = {model_id: await _every_replica(handle.replica_unfinished_requests.remote,
                                                 replicas[model_id].get("RUNNING", 0))
                  for model_id, handle in self.model_handles().items()}
        by_tag = {model_id: {tag: answer["unfinished"] for tag, answer in answers.items()}
                  for model_id, answers in counts.items()}
        return by_tag if every_replica else {model_id: sum(n.values()) for model_id, n in by_tag.items()}


class SpecServeLLMServer(LLMServer):
    requests_started = 0  # completions and chats this replica has taken (the metrics poll skips idle spells)

    async def completions(self, request: CompletionRequest, raw_request_info=None) -> AsyncGenerator:
        return await self._run_traced(request, super().completions, raw_request_info)

    async def chat(self, request: ChatCompletionRequest, raw_request_info=None) -> AsyncGenerator:
        return await self._run_traced(request, super().chat, raw_request_info)

    async def _run_traced(self, request, run, raw_request_info) -> AsyncGenerator:
        """The request run by LLMServer's `run`, with its trace added when it asks for one."""
        self.requests_started += 1
        key = await self._trace_key(request)
        if isinstance(key, ErrorResponse):
            return _one(key)
        stream = await run(request, raw_request_info)
        return stream if key is None else self._with_trace(stream, key)

    async def _trace_key(self, request) -> Optional[str] | ErrorResponse:
        """For a request that asks for a trace, the key its trace is kept under in the engine, set in its
        vllm_xargs (unique, so that the client's value cannot collide); None when it asks for none or
        the model does not speculate (its response has no trace); an error when it cannot be traced."""
        xargs = request.vllm_xargs or {}
        if TRACE_ARG not in xargs:
            return None
        config = await self.llm_config()
        if not wants_trace(xargs[TRACE_ARG]) or not (config and config.engine_kwargs.get("speculative_config")):
            request.vllm_xargs = {k: v for k, v in xargs.items() if k != TRACE_ARG}
            return None
        if (getattr(request, "n", None) or 1) > 1 or _several_prompts(getattr(request, "prompt", None)):
            return ErrorResponse(error={"message": f"{TRACE_ARG} traces one sequence: use n=1 and one prompt",
                                        "type": "BadRequestError", "param": "n", "code": 400})
        key = f"http-{uuid.uuid4().hex}"
        request.vllm_xargs = xargs | {TRACE_ARG: key}
        return key

    async def _with_trace(self, stream: AsyncGenerator, key: str) -> AsyncGenerator:
        """The response stream with the trace added: to a whole response, or to the final usage chunk
        of a stream (lists of "data: {...}" lines). A trace no response took (a client gone, an error)
        is taken anyway, so that the engine holds nothing for it."""
        attached = False
        try:
            async for item in stream:
                if isinstance(item, list):
                    for i, line in enumerate(item):
                        if (chunk := _usage_chunk(line)) is not None:
                            chunk[TRACE_ARG] = await self.trace(key, chunk["usage"]["completion_tokens"])
                            item[i] = f"data: {json.dumps(chunk)}\n\n"
                            attached = True
                elif getattr(item, "usage", None) is not None:
                    setattr(item, TRACE_ARG, await self.trace(key, item.usage.completion_tokens))
                    attached = True
                yield item
        finally:
            if not attached:  # a task: awaiting in a cancelled generator's cleanup is not safe
                task = asyncio.get_running_loop().create_task(self.collective_rpc("specserve_take_trace", args=(key,)))
                _background.add(task)
                task.add_done_callback(_background.discard)

    async def trace(self, key: str, completion_tokens: int) -> Optional[dict]:
        """The request's trace document (`plugin.trace.trace_document`), taken from the engine; None
        when there is none or it failed (the completion is delivered either way)."""
        try:
            trace = (await self.collective_rpc("specserve_take_trace", args=(key,)))[0]
            if trace is None:
                return None
            tokenizer = engine_client(self).get_tokenizer()

            def decode(ids):
                return tokenizer.decode(ids, skip_special_tokens=True)  # as the response's text

            # Decoding a long trace takes milliseconds: off the event loop that serves the other streams.
            return await asyncio.to_thread(trace_document, trace, completion_tokens, decode)
        except Exception as exc:  # noqa: BLE001 - a trace must never cost the response
            logging.getLogger("specserve.trace").warning("trace %s not delivered: %r", key, exc)
            return None

    async def num_unfinished_requests(self) -> int:
        """Requests the engine of this replica still holds (running or waiting)."""
        return engine_client(self).output_processor.get_num_unfinished_requests()

    async def replica_unfinished_requests(self) -> dict:
        """`num_unfinished_requests` with this replica's tag, for the ingress's sum over replicas."""
        return {"replica": serve.get_replica_context().replica_tag, "unfinished": await self.num_unfinished_requests()}

    async def speculation_stats(self) -> dict:
        """The speculator's counters from this replica's engine (`SpeculativeWorker.specserve_stats`),
        and the resident memory of the replica with its engine processes, and of the engine alone."""
        config = await self.llm_config()
        stats = {"enabled": False}
        if config and config.engine_kwargs.get("speculative_config"):
            stats = (await self.collective_rpc("specserve_stats"))[0]
        return stats | {"replica": serve.get_replica_context().replica_tag} | replica_processes()

    async def check_health(self) -> None:
        """Serve's health check. A dead vLLM engine never comes back in this process, and Serve replaces
        a replica after three failed checks in a row but at once when its actor has crashed: so a
        replica whose engine died ends its own process, and is replaced within one check period."""
        try:
            await super().check_health()
        except EngineDeadError:
            logging.getLogger("specserve.health").error("the vLLM engine died: ending this replica so Serve replaces it now")
            os._exit(1)

    async def start(self):
        await super().start()
        self._metrics_task = asyncio.get_running_loop().create_task(publish_speculation_metrics(self))


EVERY_REPLICA_WAVES = 8


async def _every_replica(call, running: int) -> dict:
    """The answers of each of a model's running replicas to `call` (a handle method's `remote`, whose
    answer names its "replica"), by replica tag. Serve routes a call to
    a replica of its router's choosing and offers no public call to a named one; calls made at once
    spread over the replicas (its router sends each to the shorter of two queues), so they go out in
    waves of one more than the replicas running until every one has answered, at most
    EVERY_REPLICA_WAVES waves (a replica that started meanwhile may answer too; one that never did is
    missing, as the caller can tell from the count)."""
    seen: dict = {}
    for _ in range(EVERY_REPLICA_WAVES):
        answers = await asyncio.gather(*(call() for _ in range(running + 1)))
        seen |= {answer["replica"]: answer for answer in answers}
        if len(seen) >= running:
            break
    return seen


_background: set = set()  # tasks that must not be garbage-collected before they run


async def _one(item) -> AsyncGenerator:
    yield item


def _several_prompts(prompt) -> bool:
    """A completion prompt that is a list of prompts (texts, or lists of token ids), not one."""
    return isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(t, int) for t in prompt)


def _usage_chunk(line) -> Optional[dict]:
    """The final chunk of a stream, parsed (no choices, and the usage, which the engine always adds);
    None for any other line."""
    if not isinstance(line, str) or not line.startswith("data: {") or '"usage"' not in line:
        return None
    chunk = json.loads(line[len("data: "):])
    return chunk if not chunk.get("choices") and chunk.get("usage") is not None else None


def replica_processes() -> dict:
    """Resident memory of this replica's process and of the processes under it (the vLLM engine core
    and its worker): {"replica_memory_bytes": both together, "engine_memory_bytes": those under it},
    and the engine environment they run with (`deployment.defaults.CPU_ENGINE_ENV`'s variables as the
    engine processes hold them: {"engine_env": {name: value, or None where unset}})."""
    import psutil

    def rss(process) -> int:
        try:
            return process.memory_info().rss
        except psutil.Error:  # a child that ended meanwhile
            return 0

    def environ(process) -> dict:
        try:
            return process.environ()
        except psutil.Error:
            return {}

    me = psutil.Process(os.getpid())
    children = me.children(recursive=True)
    engine = sum(rss(child) for child in children)
    env = environ(children[0]) if children else {}  # the engine's processes all inherit the replica's
    return {"replica_memory_bytes": rss(me) + engine, "engine_memory_bytes": engine,
            "engine_env": {name: env.get(name) for name in CPU_ENGINE_ENV}}


PUBLISH_INTERVAL_S = 10.0


async def publish_speculation_metrics(server: SpecServeLLMServer, interval_s: float = PUBLISH_INTERVAL_S) -> None:
    """Export the speculator's counters as Prometheus counters (Ray prefixes them with `ray_`):
    specserve_chosen_k{k} (request-steps by chosen draft length), specserve_steps{drafted} and
    specserve_finished_requests{drafted}. Polled from the engine; a replica without a speculator
    publishes nothing.

    Only while requests come or run: the counters change only then, and each poll is an RPC that
    wakes the engine's worker process, which then spins for a second (vLLM's message queue polls
    for the next one that long): on this 2-core machine an idle speculative replica polled every
    10 s took 11% of a core."""
    from ray.util.metrics import Counter

    if not (await server.speculation_stats()).get("enabled"):
        return
    model = (await server.llm_config()).model_id
    chosen_k = Counter("specserve_chosen_k", "request-steps by the draft length the policy chose", ("model", "k"))
    steps = Counter("specserve_steps", "engine steps, by whether any request drafted", ("model", "drafted"))
    finished = Counter("specserve_finished_requests", "finished requests, by whether they ever drafted", ("model", "drafted"))
    seen: dict = {}
    started, unfinished = -1, 0  # requests started, and unfinished, at the last poll
    while True:
        unfinished_now = await server.num_unfinished_requests()
        if server.requests_started != started or unfinished or unfinished_now:
            started, unfinished = server.requests_started, unfinished_now
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
