"""`specserve measure-pair`: the demo pair's statistics for the model card.

- alpha = mean over held-out positions of sum(min(p, q)) at temperature 1, overall and per prompt
  category; the positions are the real continuation (up to 64 tokens) after each held-out prompt.
- greedy match: how often the draft's argmax equals the target's at those positions.
- c, the cost ratio: the target's vLLM decode step (batch 1) over one batch-1 draft forward with a KV
  cache in plain PyTorch (`plugin.draft_model`, what the proposer runs); and the ratio of the two
  models' vLLM decode steps.
- the speed-up the seeds' formula predicts from alpha and c at the optimal k.
"""

import collections
import json
import statistics
import time

import torch

from deployment.defaults import DEMO_DRAFT, DEMO_ENGINE_KWARGS, DEMO_TARGET
from loadtest import load_prompts
from plugin.speculation_math import acceptance_rate, optimal_k
from specserve.demo.corpus import read_source

CONTINUATION_TOKENS = 64


@torch.no_grad()
def pair_agreement(target_dir=DEMO_TARGET, draft_dir=DEMO_DRAFT) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    sums = collections.defaultdict(lambda: [0.0, 0.0, 0])  # category -> alpha, match, positions
    for row in load_prompts():
        source = read_source(row["source"])
        end = source.find(row["prompt"]) + len(row["prompt"])
        prompt_ids = tok(row["prompt"], add_special_tokens=False)["input_ids"]
        cont_ids = tok(source[end : end + 600], add_special_tokens=False)["input_ids"][:CONTINUATION_TOKENS]
        ids = torch.tensor([prompt_ids + cont_ids])
        span = slice(len(prompt_ids) - 1, len(prompt_ids) - 1 + len(cont_ids))
        p = torch.softmax(target(input_ids=ids).logits[0, span], -1)
        q = torch.softmax(draft(input_ids=ids).logits[0, span], -1)
        for key in (row["category"], "overall"):
            sums[key][0] += acceptance_rate(p, q).sum().item()
            sums[key][1] += (p.argmax(-1) == q.argmax(-1)).sum().item()
            sums[key][2] += len(cont_ids)
    return {k: {"alpha": round(a / n, 4), "greedy_match": round(m / n, 4), "positions": n}
            for k, (a, m, n) in sorted(sums.items())}


def decode_step_ms(llm, prompt: str, tokens: int = 128, repeats: int = 3) -> float:
    """Batch-1 decode step of a running engine: (time for 1 + tokens outputs - time for 1 output) / tokens,
    median of repeats (for a speculative engine: the time per output token)."""
    from vllm import SamplingParams

    def timed(n):
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - start

    timed(8)
    return statistics.median((timed(tokens + 1) - timed(1)) / tokens for _ in range(repeats)) * 1e3


def vllm_decode_step_ms(model_dir, prompt: str, tokens: int = 128, repeats: int = 3) -> float:
    from vllm import LLM

    from specserve.engines import shutdown_llm

    llm = LLM(model=str(model_dir), seed=0, **DEMO_ENGINE_KWARGS)
    try:
        return decode_step_ms(llm, prompt, tokens, repeats)
    finally:
        shutdown_llm(llm)


@torch.no_grad()
def draft_forward_ms(draft_dir, prompt_ids: list[int], steps: int = 200) -> float:
    from plugin.draft_model import DraftModel

    model = DraftModel(draft_dir, max_rows=1, max_len=1024)
    ids = torch.tensor([prompt_ids])
    model.forward(ids, torch.zeros(1, dtype=torch.long), torch.tensor([len(prompt_ids) - 1]))
    token = torch.tensor([[prompt_ids[-1]]])
    pos = len(prompt_ids)
    times = []
    for i in range(steps):
        start = time.perf_counter()
        model.forward(token, torch.tensor([pos + i]), torch.zeros(1, dtype=torch.long))
        times.append(time.perf_counter() - start)
    return statistics.median(times[10:]) * 1e3


def measure(target_dir=DEMO_TARGET, draft_dir=DEMO_DRAFT) -> dict:
    from transformers import AutoTokenizer

    agreement = pair_agreement(target_dir, draft_dir)
    prompt = load_prompts(category="function_body")[0]["prompt"]
    prompt_ids = AutoTokenizer.from_pretrained(target_dir)(prompt, add_special_tokens=False)["input_ids"]
    target_step = vllm_decode_step_ms(target_dir, prompt)
    draft_vllm_step = vllm_decode_step_ms(draft_dir, prompt)
    draft_torch = draft_forward_ms(draft_dir, prompt_ids)
    alpha = agreement["overall"]["alpha"]
    c = target_step / draft_torch
    k, speedup = optimal_k(alpha, c)
    return {
        "agreement": agreement,
        "target_vllm_step_ms": round(target_step, 3),
        "draft_vllm_step_ms": round(draft_vllm_step, 3),
        "draft_torch_forward_ms": round(draft_torch, 3),
        "c": round(c, 2),
        "c_vllm_steps": round(target_step / draft_vllm_step, 2),
        "optimal_k": k,
        "predicted_speedup": round(speedup, 3),
    }


def main(args) -> int:
    result = measure()
    print(f"{'category':<16}{'alpha':>8}{'greedy match':>14}{'positions':>11}")
    for name, row in result["agreement"].items():
        print(f"{name:<16}{row['alpha']:>8.3f}{row['greedy_match']:>14.3f}{row['positions']:>11d}")
    print(f"target vLLM decode step {result['target_vllm_step_ms']:.2f} ms, draft vLLM step "
          f"{result['draft_vllm_step_ms']:.2f} ms, draft plain-PyTorch forward {result['draft_torch_forward_ms']:.2f} ms")
    print(f"c = {result['c']:.1f} (vLLM steps only: {result['c_vllm_steps']:.1f}); optimal k = "
          f"{result['optimal_k']}, predicted speed-up {result['predicted_speedup']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
