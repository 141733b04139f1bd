"""GPT-2-family drafts in the real vLLM engine: a small random GPT-2 target, drafted by a GPT-2 with the
same weights (so that nearly every draft is accepted, which only happens when our decoder computes what
vLLM's GPT-2 computes), gives the plain engine's greedy text."""

import shutil

import pytest

pytest.importorskip("vllm")
from vllm import SamplingParams  # noqa: E402

from deployment.defaults import MODELS_DIR  # noqa: E402
from loadtest import load_prompts  # noqa: E402

pytestmark = pytest.mark.slow
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def gpt2_pair(tmp_path_factory):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    target = tmp_path_factory.mktemp("gpt2-target")
    config = GPT2Config(vocab_size=4096, n_embd=128, n_layer=2, n_head=4, n_positions=512, initializer_range=0.2,
                        bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).eval().save_pretrained(target)
    for name in TOKENIZER_FILES:
        shutil.copy(MODELS_DIR / "target" / name, target / name)
    draft = tmp_path_factory.mktemp("gpt2-draft")
    shutil.copytree(target, draft, dirs_exist_ok=True)
    return str(target), str(draft)


def test_gpt2_draft_greedy_equals_plain_engine(gpt2_pair):
    from specserve.engines import build_llm, shutdown_llm

    target, draft = gpt2_pair
    prompts = [p["prompt"][-300:] for p in load_prompts()[:8]]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    common = dict(target=target, draft=draft, max_model_len=512, dtype="float32", seed=0)
    plain = build_llm(False, **common)
    try:
        expected = [list(o.outputs[0].token_ids) for o in plain.generate(prompts, params)]
    finally:
        shutdown_llm(plain)
    # Fixed K: the pair is a draft as costly as its target, for which the adaptive policy rightly drafts
    # nothing, and then the test would check no draft.
    spec = build_llm(True, k_policy="fixed", **common)
    try:
        outputs = spec.generate(prompts, params)
    finally:
        shutdown_llm(spec)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    metrics = [o.outputs[0].spec_decode_metrics.to_dict() for o in outputs]
    rate = sum(m["num_accepted_draft_tokens"] for m in metrics) / sum(m["num_draft_tokens"] for m in metrics)
    assert rate > 0.9, f"acceptance rate {rate:.2f} with the target's own weights as draft"
