"""specserve's speculator: exact draft-and-verify speculative decoding for vLLM 0.32.

`plugin.sampling` is the pure-PyTorch core; `plugin.ExactRejectionSampler` is its drop-in for vLLM's
`RejectionSampler` and is imported lazily, so the core works without vLLM installed.
"""

from plugin.config import speculative_engine_kwargs

__all__ = ["ExactRejectionSampler", "speculative_engine_kwargs"]


def __getattr__(name):
    if name == "ExactRejectionSampler":
        from plugin.vllm_rejection_sampler import ExactRejectionSampler

        return ExactRejectionSampler
    raise AttributeError(f"module 'plugin' has no attribute {name!r}")
