"""Turning the speculator on: `speculative_engine_kwargs`, and the checks made at start-up."""

from pathlib import Path
from typing import Any

from plugin.speculation_policy import DEFAULT_SPEED_FLOOR, POLICIES, check_speed_floor

PROPOSER_CLASS = "plugin.proposer.DraftProposer"
WORKER_CLASS = "plugin.worker.SpeculativeWorker"
CONFIG_KEY = "specserve"
SWITCH = ("auto", "on", "off")  # the values of compile_draft and native_draft
CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")  # the values of draft_cache_dtype


def check_switch(name: str, value: str) -> None:
    if value not in SWITCH:
        raise ValueError(f"{name} must be 'auto', 'on' or 'off', not {value!r}")


def resolve_model_dir(model: str | Path) -> Path:
    """A local directory as is; a hub id through the Hugging Face cache (offline if HF_HUB_OFFLINE=1)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(model), allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))


def _vocab(model_dir: Path) -> dict[str, int] | None:
    if not any((model_dir / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).get_vocab()


def check_shared_vocabulary(target: str | Path, draft: str | Path) -> None:
    """Refuse a draft whose tokenizer differs from the target's: its tokens would mean other text."""
    from plugin.draft_model import read_config

    target_dir, draft_dir = resolve_model_dir(target), resolve_model_dir(draft)
    target_vocab, draft_vocab = _vocab(target_dir), _vocab(draft_dir)
    if target_vocab is not None and draft_vocab is not None:
        if target_vocab != draft_vocab:
            only_target = len(set(target_vocab.items()) - set(draft_vocab.items()))
            raise ValueError(
                f"draft model {draft} does not share the target's vocabulary ({target}): "
                f"{len(target_vocab)} vs {len(draft_vocab)} tokens, {only_target} target entries differ")
        return
    target_size = read_config(target_dir)["vocab_size"]
    draft_size = read_config(draft_dir)["vocab_size"]
    if target_size != draft_size:
        raise ValueError(f"draft model {draft} has vocab_size {draft_size}, the target {target} has "
                         f"{target_size}; speculation needs one shared vocabulary")


def speculative_engine_kwargs(
    draft_model: str | Path,
    num_speculative_tokens: int = 4,
    *,
    target_model: str | Path | None = None,
    max_draft_rows: int | None = None,
    max_draft_len: int | None = None,
    draft_dtype: str = "auto",
    draft_cache_dtype: str = "auto",
    fault_injection_rate: float = 0.0,
    profile_steps: bool = False,
    compile_draft: str = "auto",
    native_draft: str = "auto",
    per_request_metrics: str = "summary",
    k_policy: str = "adaptive",
    request_speed_floor: float | None = DEFAULT_SPEED_FLOOR,
    k_max_unless_sure: bool = True,
) -> dict[str, Any]:
    """Keyword arguments that turn the exact speculator on, for `vllm.LLM(...)`, `AsyncEngineArgs`
    and Ray Serve LLM's `engine_kwargs`.

    draft_model: path or hub id of a Llama-family or GPT-2 draft sharing the target's vocabulary.
    num_speculative_tokens: K_max, the most draft tokens a request gets in one step.
    k_policy: "adaptive" (default: each request's K in 0..K_max chosen every step for the most tokens per
        second, from its live acceptance and the step costs measured in the engine; K = 0 runs no draft
        work), "fixed" (K_max for every request, every step) or "off" (no drafting at all).
    request_speed_floor: with the adaptive policy, a share f in (0, 1] of a request's speed without
        speculation that no request's expected tokens per second may fall below (1: none slower than
        plain). 0.8 by default: the step's goodput alone is paid for by a request the draft predicts
        badly, since its step is as long as the others' drafts make it, and such requests are the
        slowest (P95); None maximises the step's goodput alone.
    k_max_unless_sure: with the adaptive policy, every request drafts K_max unless the choice is expected
        to beat that by more than the step-cost model's own recent error on a step's time (default); False
        takes the model's best choice however small its expected gain.
    target_model: when given, the vocabulary check runs here, before any engine starts; the engine
        checks again at start-up either way.
    max_draft_rows / max_draft_len: bound the draft's KV cache (rows = concurrent requests drafted
        for; default min(max_num_seqs, 64) rows of max_model_len positions).
    draft_dtype: "auto" (float32 on CPU, the target's dtype elsewhere) or a torch dtype name.
    draft_cache_dtype: the draft's KV cache: "auto" (bfloat16 under a float32 draft on CPU, where reading
        the cache is most of a draft forward at a large batch; the draft's dtype elsewhere), "float32",
        "bfloat16" or "float16".
    fault_injection_rate: share of steps whose drafting fails on purpose (tests only).
    compile_draft: "auto" (compiled one-token draft decode on CUDA, eager on CPU), "on" or "off"; a compile
        failure falls back to eager.
    native_draft: "auto" (a Llama-style float32 draft on CPU runs its forward as one native call,
        `plugin/native_draft.cpp`, built once with the machine's C++ compiler; eager where that does not
        apply or the build fails), "on" (the same, but an engine whose draft cannot use it fails to start)
        or "off" (eager PyTorch).
    profile_steps: time each phase of the engine step, the target's forward and verification beside the
        draft's phases (specserve_stats' profile_seconds; `specserve bench --profile`); off by default,
        since on a GPU it synchronises the device per phase.
    """
    if num_speculative_tokens < 1:
        raise ValueError("num_speculative_tokens must be at least 1")
    check_switch("compile_draft", compile_draft)
    check_switch("native_draft", native_draft)
    if draft_cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"draft_cache_dtype must be one of {CACHE_DTYPES}, not {draft_cache_dtype!r}")
    if k_policy not in POLICIES:
        raise ValueError(f"k_policy must be one of {POLICIES}, not {k_policy!r}")
    check_speed_floor(request_speed_floor)
    if not isinstance(k_max_unless_sure, bool):
        raise ValueError(f"k_max_unless_sure must be true or false, not {k_max_unless_sure!r}")
    if target_model is not None:
        check_shared_vocabulary(target_model, draft_model)
    options = {
        "draft_model": str(draft_model),
        "max_draft_rows": max_draft_rows,
        "max_draft_len": max_draft_len,
        "draft_dtype": draft_dtype,
        "draft_cache_dtype": draft_cache_dtype,
        "fault_injection_rate": fault_injection_rate,
        "profile_steps": profile_steps,
        "compile_draft": compile_draft,
        "native_draft": native_draft,
        "k_policy": k_policy,
        "request_speed_floor": request_speed_floor,
        "k_max_unless_sure": k_max_unless_sure,
    }
    return {
        "speculative_config": {
            "method": "custom_class",
            "model": PROPOSER_CLASS,
            "num_speculative_tokens": num_speculative_tokens,
        },
        "worker_cls": WORKER_CLASS,
        "additional_config": {CONFIG_KEY: options},
        "per_request_spec_decode_metrics": per_request_metrics,
    }
