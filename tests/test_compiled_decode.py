"""The compiled one-token draft decode against the eager one (float32, within 1e-4 relative), at batch
sizes on and between the fixed sizes, through the KV cache it writes; and its fallback to eager."""

import pytest
import torch

from deployment.defaults import DEMO_DRAFT
from plugin.compiled_decode import CompiledDecode
from plugin.draft_model import DraftModel

MAX_ROWS, MAX_LEN = 5, 128  # fixed sizes 1, 2, 4, 5: batch 3 sits between two of them


def prefilled_pair(batch: int, prompt: int = 20):
    """Two copies of the shipped draft whose rows 0..batch-1 hold the same random prompts."""
    gen = torch.Generator().manual_seed(batch)
    tokens = torch.randint(0, 4096, (batch, prompt), generator=gen)
    models = [DraftModel(DEMO_DRAFT, MAX_ROWS, MAX_LEN) for _ in range(2)]
    for model in models:
        model.forward(tokens, torch.zeros(batch, dtype=torch.long), torch.full((batch,), prompt - 1))
    return models, gen


@pytest.mark.slow
def test_compiled_decode_equals_eager_through_its_own_cache_writes():
    for batch in (1, 3, 5):
        (eager_model, compiled_model), gen = prefilled_pair(batch)
        compiled = CompiledDecode(compiled_model, MAX_ROWS)
        positions = torch.full((batch,), 20)
        for _ in range(3):  # each step reads what the previous one wrote
            token = torch.randint(0, 4096, (batch, 1), generator=gen)
            expected = eager_model.forward(token, positions, torch.zeros(batch, dtype=torch.long))
            got = compiled(token, positions)
            assert compiled.failed is None, compiled.failed
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
            positions = positions + 1


def test_a_failing_compile_falls_back_to_eager(monkeypatch):
    def broken(fn, **kwargs):
        def step(*args):
            raise RuntimeError("inductor exploded")
        return step

    monkeypatch.setattr(torch, "compile", broken)
    (eager_model, model), _ = prefilled_pair(2)
    decode = CompiledDecode(model, MAX_ROWS)
    token, positions = torch.tensor([[5], [7]]), torch.tensor([20, 20])
    got = decode(token, positions)
    assert decode.failed == "RuntimeError: inductor exploded"
    torch.testing.assert_close(got, eager_model.forward(token, positions, torch.zeros(2, dtype=torch.long)))
