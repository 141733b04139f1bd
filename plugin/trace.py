"""Per-step traces of speculative requests: what the draft proposed at each engine step and what the
target kept of it.

Vocabulary, as in vLLM's rejection sampler. Each engine step of a request verifies k drafted tokens
(k = 0 when the policy chose not to draft, and at the prompt's step). The target accepts a prefix of
them (the accepted tokens) and emits one token more: the recovered token, resampled from
normalise(max(0, p - q)) at the first rejection, or the bonus token, drawn from p when all k passed (a
k = 0 step emits only a bonus token). So a step emits accepted + 1 tokens; the drafts after the first
rejection are never tested.

Opt-in per request: `SamplingParams.extra_args["specserve_trace"]` (over HTTP, `"vllm_xargs"`). A string
value is the key the trace is taken with (`SpeculativeWorker.specserve_take_trace(key)`); any other true
value keys it by the engine's request id (false: 0, "0", "false", "no", any case). A request without it never enters the book, so tracing costs
an untraced request one dictionary lookup when it arrives and nothing after. The book is bounded: at
most MAX_STEPS steps per trace, at most MAX_UNCLAIMED finished traces kept for their taker (oldest
dropped first).

`trace_document` turns the steps into what a response carries: cut to the completion's tokens (the last
step may be cut short by max_tokens or a stop condition), with token texts, and the figures the seeds'
formula predicts from them.
"""

from collections import OrderedDict
from typing import Callable, Optional

TRACE_ARG = "specserve_trace"
MAX_STEPS = 4096
MAX_UNCLAIMED = 64
TEXT_CONTEXT = 6  # prompt tokens kept with a trace, so that its first token decodes as in the text


def wants_trace(value) -> bool:
    return bool(value) and str(value).strip().lower() not in ("0", "false", "no")


def trace_key(extra_args: Optional[dict], req_id: str) -> Optional[str]:
    """The key a request's trace is kept under, or None when the request asked for no trace."""
    value = (extra_args or {}).get(TRACE_ARG)
    if not wants_trace(value):
        return None
    return value if isinstance(value, str) and value.strip().lower() not in ("1", "true", "yes") else req_id


def step_record(drafted: list[int], emitted: list[int]) -> dict:
    """One verify step of one request: k drafted tokens, the emitted ones (accepted, then one recovered
    or bonus token)."""
    accepted = len(emitted) - 1
    last = emitted[-1]
    return {"k": len(drafted), "drafted": list(drafted), "accepted": accepted, "emitted": list(emitted),
            "recovered": last if accepted < len(drafted) else None,
            "bonus": last if accepted == len(drafted) else None}


class TraceBook:
    """The worker's traces: live requests by engine request id, and per trace key its record (steps,
    whether MAX_STEPS cut it, the prompt's last tokens) until taken."""

    def __init__(self, max_steps: int = MAX_STEPS, max_unclaimed: int = MAX_UNCLAIMED):
        self.max_steps, self.max_unclaimed = max_steps, max_unclaimed
        self.live: dict[str, str] = {}  # request id -> key, while the request runs
        self.traces: dict[str, dict] = {}  # key -> {"steps", "truncated", "context"}, until taken
        self.unclaimed: OrderedDict[str, None] = OrderedDict()  # keys of finished, untaken traces, oldest first

    def start(self, req_id: str, key: str, context: Optional[list[int]] = None) -> None:
        self.live[req_id] = key
        self.traces[key] = {"steps": [], "truncated": False, "context": list(context or ())}

    def record(self, req_id: str, drafted: list[int], emitted: list[int]) -> None:
        trace = self.traces.get(self.live.get(req_id, ""))
        if trace is None or not emitted:  # taken already, or a prompt chunk that emitted nothing
            return
        if len(trace["steps"]) >= self.max_steps:
            trace["truncated"] = True
            return
        trace["steps"].append(step_record(drafted, emitted))

    def finish(self, req_ids) -> None:
        for req_id in req_ids:
            key = self.live.pop(req_id, None)
            if key in self.traces:
                self.unclaimed[key] = None
        while len(self.unclaimed) > self.max_unclaimed:
            self._drop(next(iter(self.unclaimed)))

    def take(self, key: str) -> Optional[dict]:
        """The trace's record (steps, truncated, context), removed from the book; None if unknown."""
        return self._drop(key)

    def _drop(self, key: str) -> Optional[dict]:
        self.unclaimed.pop(key, None)
        return self.traces.pop(key, None)

    def held(self) -> dict:
        return {"trace_live_requests": len(self.live), "trace_held": len(self.traces),
                "trace_held_steps": sum(len(t["steps"]) for t in self.traces.values())}


def cut_to_completion(steps: list[dict], completion_tokens: int) -> list[dict]:
    """The steps whose tokens the completion holds: the engine drops what a step emitted past max_tokens
    or a stop token, so the last step kept may be cut short ("cut": true) and later ones go."""
    kept, total = [], 0
    for step in steps:
        if total >= completion_tokens:
            break
        room = completion_tokens - total
        if len(step["emitted"]) > room:
            step = step | {"emitted": step["emitted"][:room], "cut": True}
        kept.append(step)
        total += len(step["emitted"])
    return kept


def token_texts(decode: Callable[[list[int]], str], ids: list[int], prefix: Optional[list[int]] = None) -> list[str]:
    """Each token's text within the sequence, so that concatenated they read as the whole: decoded after
    a few tokens of context (prefix: the prompt's last tokens, for the first ones; a tokenizer may spell
    a token differently at the start of a text), and a token that ends inside a multi-byte character
    gets its text with the one that completes it."""
    prefix = list(prefix or ())[-TEXT_CONTEXT:]
    tokens = prefix + list(ids)
    texts, pending = [], len(prefix)  # tokens[pending:] have no text yet
    for i in range(len(prefix), len(tokens)):
        lo = max(0, pending - TEXT_CONTEXT)
        whole = decode(tokens[lo: i + 1])
        if whole.endswith("\ufffd"):
            texts.append("")
            continue
        texts.append(whole[len(decode(tokens[lo:pending])):])
        pending = i + 1
    return texts


def summarize(steps: list[dict], cost_ratio: Optional[float]) -> dict:
    """Tokens per step and acceptance of a trace, and the speed-up the seeds' formula predicts for them.

    acceptance_rate is accepted / drafted; alpha is accepted / (accepted + rejections), the per-token
    acceptance of the formula (drafts after a rejection are never tested, so they are not counted
    against it). Both count what the target did, a cut last step included; tokens count what the
    completion holds. The prediction is speedup(alpha, k, c) at the trace's mean k rounded
    (predicted_k), with the optimal k.
    """
    from plugin.speculation_math import optimal_k, speedup

    tokens = sum(len(s["emitted"]) for s in steps)
    drafted = sum(s["k"] for s in steps)
    accepted = sum(s["accepted"] for s in steps)
    rejections = sum(s["recovered"] is not None for s in steps)
    drafting_steps = sum(s["k"] > 0 for s in steps)
    alpha = accepted / (accepted + rejections) if accepted + rejections else None
    figures = {
        "steps": len(steps), "tokens": tokens, "drafting_steps": drafting_steps,
        "tokens_per_step": round(tokens / len(steps), 4) if steps else None,
        "drafted": drafted, "accepted": accepted, "recovered": rejections,
        "bonus": sum(s["bonus"] is not None for s in steps),
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "alpha": None if alpha is None else round(alpha, 4),
        "mean_k": round(drafted / drafting_steps, 3) if drafting_steps else 0.0,
        "cost_ratio": None if cost_ratio is None else round(cost_ratio, 3),
        "predicted_speedup": None, "predicted_k": None, "optimal_k": None, "optimal_speedup": None,
    }
    if alpha is not None and cost_ratio and drafting_steps:
        k = max(1, round(drafted / drafting_steps))
        best_k, best = optimal_k(min(alpha, 0.999), cost_ratio)
        figures |= {"predicted_speedup": round(speedup(alpha, k, cost_ratio), 4), "predicted_k": k,
                    "optimal_k": best_k, "optimal_speedup": round(best, 4)}
    return figures


def trace_document(trace: dict, completion_tokens: int, decode: Optional[Callable[[list[int]], str]] = None) -> dict:
    """What a response carries under "specserve_trace": the steps cut to the completion, each with its
    tokens' texts when a decoder is given (ids -> text, special tokens skipped as in the response's
    text), and the summary figures.

    trace: `SpeculativeWorker.specserve_take_trace`'s reply: {"steps", "truncated", "context", "k_max",
    "cost_ratio"}.
    """
    steps = cut_to_completion(trace["steps"], completion_tokens)
    if decode is not None:
        all_emitted = [t for s in steps for t in s["emitted"]]
        texts = iter(token_texts(decode, all_emitted, trace.get("context")))
        steps = [s | {"emitted_text": [next(texts) for _ in s["emitted"]],
                      "drafted_text": [decode([t]) for t in s["drafted"]]} for s in steps]
    return {"steps": steps, "truncated": trace.get("truncated", False), "k_max": trace.get("k_max"),
            "summary": summarize(steps, trace.get("cost_ratio"))}
