"""The shipped demo pair, tokenizer and held-out prompts: offline loading, quality guards, no leakage."""

import json
import os

import pytest
import torch

from deployment.defaults import MODELS_DIR
from loadtest import PROMPTS_FILE, load_prompts
from plugin.speculation_math import acceptance_rate
from specserve.demo.corpus import is_held_out, read_source, source_files, split_files
from specserve.demo.prompts import CATEGORIES

TARGET, DRAFT = MODELS_DIR / "target", MODELS_DIR / "draft"
# Set from the shipped pair on this slice (target loss 4.24 nats/token, draft alpha 0.74), with a
# margin: random weights give a loss of 8.4 (about ln 4096), and an untrained draft a far lower alpha.
MAX_TARGET_LOSS = 4.6
MIN_DRAFT_ALPHA = 0.65
EVAL_SLICE_TOKENS = 4096


@pytest.fixture(scope="module", autouse=True)
def offline():
    old = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TARGET)


@pytest.fixture(scope="module")
def models():
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(DRAFT, dtype=torch.float32).eval()
    return target, draft


def test_files_and_size():
    for model in (TARGET, DRAFT):
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            assert (model / name).is_file(), model / name
        assert json.loads((model / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    total = sum(f.stat().st_size for f in MODELS_DIR.rglob("*") if f.is_file())
    assert total <= 60 * 2**20, f"models/ is {total / 2**20:.1f} MiB"


def test_weights_are_bfloat16_and_draft_is_at_most_a_twentieth(models):
    from safetensors import safe_open

    for model in (TARGET, DRAFT):
        with safe_open(model / "model.safetensors", "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    target, draft = models
    n_target = sum(p.numel() for p in target.parameters())
    n_draft = sum(p.numel() for p in draft.parameters())
    assert 20e6 <= n_target <= 30e6 and n_draft * 20 <= n_target


def test_tokenizer_round_trips_held_out_text(tokenizer):
    _, held_out = split_files()
    for rel in held_out:
        text = read_source(rel)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text, rel
    assert tokenizer.eos_token == "<|endoftext|>" and 4000 <= len(tokenizer) <= 8192


def held_out_slice(tokenizer) -> torch.Tensor:
    _, held_out = split_files()
    ids = tokenizer(read_source(held_out[0]) + read_source(held_out[1]), add_special_tokens=False)["input_ids"]
    return torch.tensor(ids[:EVAL_SLICE_TOKENS]).view(8, -1)


@torch.no_grad()
def test_quality_guard(tokenizer, models):
    """Target loss and draft acceptance on a fixed held-out slice of 4,096 tokens."""
    target, draft = models
    x = held_out_slice(tokenizer)
    logits_p = target(input_ids=x).logits[:, :-1]
    loss = torch.nn.functional.cross_entropy(logits_p.flatten(0, 1), x[:, 1:].flatten()).item()
    p = torch.softmax(logits_p, -1)
    q = torch.softmax(draft(input_ids=x).logits[:, :-1], -1)
    alpha = acceptance_rate(p, q).mean().item()
    assert loss < MAX_TARGET_LOSS, f"target held-out loss {loss:.3f}"
    assert alpha > MIN_DRAFT_ALPHA, f"draft alpha {alpha:.3f}"


def test_prompts_file():
    prompts = load_prompts()
    assert len(prompts) >= 200
    assert len({p["id"] for p in prompts}) == len(prompts)
    assert {p["category"] for p in prompts} == set(CATEGORIES)
    train_files, _ = split_files()
    training_text = "\n".join(read_source(f) for f in train_files)
    for p in prompts:
        assert set(p) >= {"id", "category", "prompt"}
        assert is_held_out(p["source"]) and p["prompt"] in read_source(p["source"])
        assert p["prompt"] not in training_text, p["id"]
    assert PROMPTS_FILE.read_text().count("\n") == len(prompts)


def test_split_is_the_model_cards_and_stable():
    """The model card's promise: a file is held out when sha1(its stdlib-relative path) mod 20 == 0
    (computed here independently), no held-out file is in the training list, and the split is the one
    the shipped pair was trained on (models/training_stats.json's file counts)."""
    import hashlib

    train, held_out = split_files()
    rule = {f for f in source_files() if int.from_bytes(hashlib.sha1(f.encode()).digest()[:4], "big") % 20 == 0}
    assert set(held_out) == rule and not rule & set(train)
    assert set(train) | set(held_out) == set(source_files())
    stats = json.loads((MODELS_DIR / "training_stats.json").read_text())
    assert (len(train), len(held_out)) == (stats["train_files"], stats["held_out_files"])
    assert "asyncio/events.py" in train and split_files() == (train, held_out)


@pytest.mark.parametrize("argv", [["--draft-steps", "0"], ["--target-steps", "-1"], ["--draft-steps", "1,2"],
                                  ["--draft-only", "--target-steps", "5"]])
def test_train_demo_refuses_step_counts_it_cannot_use(argv, capsys):
    """A step count below 1 would save an untrained model; --target-steps with --draft-only would be
    ignored: both are refused by the parser (usage, a reason, exit 2), before any training."""
    from specserve.cli import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["train-demo", *argv])
    assert exit_.value.code == 2
    assert "error: argument --" in capsys.readouterr().err

