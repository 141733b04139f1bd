"""`specserve trace "PROMPT"`: one speculative request's steps in the terminal, coloured by what the
target did with each drafted token (accepted, rejected and struck through, recovered, bonus), with the
step count, tokens per step and acceptance at the end.

Against a running application (--url, the default; the response's "specserve_trace" field) or, with
--local or when nothing answers there, a local engine on the demo pair (the same trace, taken from the
worker with `specserve_take_trace`).
"""

import json
import sys
import uuid

from plugin.trace import TRACE_ARG, trace_document  # no torch: the command starts fast

# ANSI styles per token kind; a step starts with a dim bar so that steps can be told apart.
STYLES = {"accepted": "32", "rejected": "9;31", "recovered": "33", "bonus": "36", "target": "0"}
LEGEND = ("accepted", "rejected", "recovered", "bonus", "target")


def traced_generate(llm, prompts: list, params) -> list[tuple[object, dict]]:
    """Generate completions on an offline speculative `vllm.LLM`, each with its trace: per prompt, (its
    RequestOutput, the trace document as a response would carry it)."""
    keys = [f"trace-{uuid.uuid4().hex}" for _ in prompts]
    per_prompt = [params.clone() for _ in prompts]
    for p, key in zip(per_prompt, keys):
        p.extra_args = (p.extra_args or {}) | {TRACE_ARG: key}
    outputs = llm.generate(prompts, per_prompt, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    results = []
    for output, key in zip(outputs, keys):
        trace = llm.collective_rpc("specserve_take_trace", args=(key,))[0]
        if trace is None:
            raise RuntimeError("the engine kept no trace: is it a speculative engine (plugin.speculative_engine_kwargs)?")
        document = trace_document(trace, len(output.outputs[0].token_ids),
                                  lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        results.append((output, document))
    return results


def http_trace(url: str, prompt: str, temperature: float, max_tokens: int, model: str | None) -> dict:
    """The response of a traced completion on a running application (raises on an HTTP error, with the
    API's message)."""
    import httpx

    from loadtest import auth_headers

    headers = auth_headers()
    if model is None:
        models = httpx.get(f"{url}/v1/models", headers=headers, timeout=10).json()["data"]
        model = next(m["id"] for m in models if m["id"].endswith("speculative"))
    reply = httpx.post(f"{url}/v1/completions", headers=headers, timeout=600, json={
        "model": model, "prompt": prompt, "temperature": temperature, "max_tokens": max_tokens,
        "vllm_xargs": {TRACE_ARG: 1}})
    body = reply.json()
    if reply.status_code != 200:
        raise RuntimeError(f"HTTP {reply.status_code}: {body.get('error', {}).get('message', body)}")
    if TRACE_ARG not in body:
        raise RuntimeError(f"model {model} returned no trace: only speculative models trace")
    return body


def local_trace(prompt: str, temperature: float, max_tokens: int) -> dict:
    from vllm import SamplingParams

    from specserve.engines import build_llm, shutdown_llm

    llm = build_llm(speculative=True)
    try:
        [(output, document)] = traced_generate(llm, [prompt], SamplingParams(temperature=temperature, max_tokens=max_tokens))
        return {"choices": [{"text": output.outputs[0].text}], TRACE_ARG: document}
    finally:
        shutdown_llm(llm)


def _paint(text: str, kind: str, colour: bool) -> str:
    return f"\x1b[{STYLES[kind]}m{text}\x1b[0m" if colour else text


def render(document: dict, colour: bool = True) -> str:
    """The trace as text: per step, its accepted tokens, its rejected drafts struck through (in brackets
    when not in colour), then its recovered or bonus token; then the summary lines."""
    out = []
    for step in document["steps"]:
        texts = step.get("emitted_text") or [f"<{t}>" for t in step["emitted"]]
        drafted_texts = step.get("drafted_text") or [f"<{t}>" for t in step["drafted"]]
        accepted = min(step["accepted"], len(texts))
        out.append(_paint("\u258f", "target", colour) if colour else "|")
        out.extend(_paint(t, "accepted", colour) for t in texts[:accepted])
        rejected = "".join(drafted_texts[step["accepted"]:])
        if rejected and not step.get("cut"):
            out.append(_paint(rejected, "rejected", colour) if colour else f"[-{rejected}-]")
        if len(texts) > accepted:
            kind = "recovered" if step["recovered"] is not None else "bonus" if step["k"] else "target"
            out.append(_paint(texts[accepted], kind, colour))
    s = document["summary"]
    lines = ["".join(out), ""]
    if colour:
        lines.append("  ".join(_paint(kind, kind, True) for kind in LEGEND))
    lines.append(f"steps {s['steps']}  tokens {s['tokens']}  tokens/step {s['tokens_per_step']}  "
                 f"drafted {s['drafted']}  accepted {s['accepted']}  acceptance {s['acceptance_rate']}  "
                 f"alpha {s['alpha']}  mean K {s['mean_k']}")
    if s["predicted_speedup"] is not None:
        lines.append(f"c {s['cost_ratio']}  predicted speed-up {s['predicted_speedup']}x at K {round(s['mean_k'])}; "
                     f"optimal K {s['optimal_k']} ({s['optimal_speedup']}x)")
    if document.get("truncated"):
        lines.append("(trace truncated: the engine keeps at most plugin.trace.MAX_STEPS steps)")
    return "\n".join(lines)


def main(args) -> int:
    from specserve.serve_process import is_ready

    if not args.prompt.strip():
        print("specserve trace: the prompt is empty", file=sys.stderr)
        return 2
    try:
        if args.local or not is_ready(args.url):
            if not args.local:
                print(f"specserve trace: nothing answers at {args.url}; using a local engine", file=sys.stderr)
            body = local_trace(args.prompt, args.temperature, args.max_tokens)
        else:
            body = http_trace(args.url, args.prompt, args.temperature, args.max_tokens, args.model)
    except RuntimeError as exc:
        print(f"specserve trace: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(body[TRACE_ARG], indent=1))
        return 0
    colour = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    print(_paint(args.prompt, "target", colour) if colour else args.prompt, end="")
    print(render(body[TRACE_ARG], colour))
    return 0


def add_arguments(p) -> None:
    from specserve.serve_process import DEFAULT_URL

    p.add_argument("prompt")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--url", default=DEFAULT_URL, help="a running application (SPECSERVE_API_KEY sends its key)")
    p.add_argument("--model", help="speculative model id (default: the one whose id ends in 'speculative')")
    p.add_argument("--local", action="store_true", help="a local engine on the demo pair, even if --url answers")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    p.add_argument("--json", action="store_true", help="print the trace document instead")
