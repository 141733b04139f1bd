"""The draft decoder against transformers' own forward (float32, logits within 1e-4), with a ragged
batched catch-up, one-token steps from the KV cache, and rows that move: in plain PyTorch, and for
Llama-style drafts as the native call (`plugin/native_draft.cpp`), which also matches the eager forward's
logits and cache writes for named rows and catch-up chunks."""

import pytest
import torch

from plugin.draft_model import DraftModel


def save_random(tmp_path, kind, bf16_values=False):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=128)
    if kind == "gpt2":  # learned positions, LayerNorm with biases, GELU (tanh), fused c_attn, tied head
        model = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=128))
        with torch.no_grad():  # non-zero biases and norms, so that loading each one is checked
            for name, param in model.named_parameters():
                if name.endswith("bias") or "ln_" in name:
                    param.normal_(0, 0.3)
    elif kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(num_key_value_heads=4, tie_word_embeddings=True, **common))
    else:  # GQA, q/k/v biases, untied head
        model = Qwen2ForCausalLM(Qwen2Config(num_key_value_heads=2, tie_word_embeddings=False, **common))
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    if bf16_values:  # float32 weights that are exactly bfloat16 values, as a bfloat16 checkpoint loads
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.bfloat16().float())
    model.eval()
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("kind,native", [("llama", False), ("qwen2", False), ("gpt2", False),
                                         ("llama", True), ("qwen2", True), ("qwen2", "bf16 values")])
def test_incremental_batched_logits_match_transformers(tmp_path, kind, native):
    """native "bf16 values": weights that are exactly bfloat16 values, so that the native forward's
    narrow feeds (up to 16 tokens: the one- and two-token steps) multiply by its bfloat16 copies; float32
    weights that are not get none (the copy would change the arithmetic)."""
    hf = save_random(tmp_path, kind, bf16_values=native == "bf16 values")
    draft = DraftModel(tmp_path, max_rows=4, max_len=64)
    if native:
        draft.use_native()
        assert draft.native
        assert draft.native_narrow == (native == "bf16 values")
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 97, (n,), generator=gen) for n in (11, 6, 14)]
    with torch.no_grad():
        expected = [hf(input_ids=s.unsqueeze(0)).logits[0].float() for s in seqs]

    # Step 1: ragged catch-up: rows feed 5, 2 and 7 tokens from position 0.
    first = [5, 2, 7]
    tokens = torch.zeros(3, 7, dtype=torch.long)
    for i, n in enumerate(first):
        tokens[i, :n] = seqs[i][:n]
    logits = draft.forward(tokens, torch.zeros(3, dtype=torch.long), torch.tensor(first) - 1)
    for i, n in enumerate(first):
        torch.testing.assert_close(logits[i], expected[i][n - 1], atol=1e-4, rtol=1e-4)

    # Then one token at a time, each row at its own position.
    pos = torch.tensor(first)
    for _ in range(2):
        tokens = torch.stack([seqs[i][pos[i]] for i in range(3)]).unsqueeze(1)
        logits = draft.forward(tokens, pos, torch.zeros(3, dtype=torch.long))
        for i in range(3):
            torch.testing.assert_close(logits[i], expected[i][pos[i]], atol=1e-4, rtol=1e-4)
        pos = pos + 1

    # Two tokens a row, 6 in all (the native forward's bfloat16 products: a group of four and two single rows).
    tokens = torch.stack([seqs[i][pos[i]: pos[i] + 2] for i in range(3)])
    logits = draft.forward(tokens, pos, torch.ones(3, dtype=torch.long))
    for i in range(3):
        torch.testing.assert_close(logits[i], expected[i][pos[i] + 1], atol=1e-4, rtol=1e-4)
    pos = pos + 2

    # Rows move (vLLM condensed its batch): row 2's cache becomes row 0's.
    draft.move_rows([2], [0])
    logits = draft.forward(seqs[2][pos[2]].view(1, 1), pos[2:3], torch.zeros(1, dtype=torch.long))
    torch.testing.assert_close(logits[0], expected[2][pos[2]], atol=1e-4, rtol=1e-4)


def test_rejects_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["BloomForCausalLM"], "vocab_size": 10}')
    with pytest.raises(ValueError, match="not supported"):
        DraftModel(tmp_path, max_rows=1, max_len=8)


def test_tensors_lists_weights_tables_and_cache(tmp_path):
    """What the compiled decode marks as static on CUDA: every tensor the decoder reads."""
    save_random(tmp_path, "qwen2")
    draft = DraftModel(tmp_path, max_rows=2, max_len=16)
    ids = {id(t) for t in draft.tensors()}
    assert {id(draft.k_cache), id(draft.v_cache), id(draft.embed), id(draft.lm_head), id(draft.cos)} <= ids
    assert all(id(w) in ids for layer in draft.layers for w in layer.values() if w is not None)


def test_native_forward_equals_eager_for_named_rows_chunks_and_no_logits():
    """On the shipped draft, from the same cache: the native call writes the same keys and values as the
    eager forward (1e-5) and returns the same logits (1e-4 relative), for one-token steps at several
    batch sizes, width-2 catch-ups, and a rebuild chunk fed to named cache rows without logits; feeds of
    up to 8 tokens through the bfloat16 copies of its weights, wider ones (10, 18, 60) through float32
    products."""
    from deployment.defaults import DEMO_DRAFT

    eager = DraftModel(DEMO_DRAFT, max_rows=8, max_len=128)
    native = DraftModel(DEMO_DRAFT, max_rows=8, max_len=128)
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, eager.vocab_size, (8, 100), generator=gen)
    for model in (eager, native):  # the same cache contents in both: an eager prefill
        model.forward(prefix, torch.zeros(8, dtype=torch.long), None)
    native.use_native()
    assert native.native_narrow  # a bfloat16 checkpoint: feeds of up to 16 tokens take the bfloat16 copies
    cases = [(1, 1), (4, 1), (2, 2), (5, 1), (8, 1), (3, 2), (5, 2), (6, 3)]
    for batch, width in cases:
        tokens = torch.randint(0, eager.vocab_size, (batch, width), generator=gen)
        start = torch.randint(60, 100, (batch,), generator=gen)
        last = torch.randint(0, width, (batch,), generator=gen)
        torch.testing.assert_close(native.forward(tokens, start, last), eager.forward(tokens, start, last),
                                   atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(native.k_cache, eager.k_cache, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(native.v_cache, eager.v_cache, atol=1e-5, rtol=1e-5)
    rows = torch.tensor([6, 2, 4])
    tokens = torch.randint(0, eager.vocab_size, (3, 20), generator=gen)
    start = torch.tensor([100, 90, 105])
    assert native.forward(tokens, start, None, rows=rows) is None
    eager.forward(tokens, start, None, rows=rows)
    torch.testing.assert_close(native.k_cache, eager.k_cache, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(native.v_cache, eager.v_cache, atol=1e-5, rtol=1e-5)


def test_native_forward_is_refused_where_it_does_not_apply(tmp_path):
    save_random(tmp_path, "gpt2")
    draft = DraftModel(tmp_path, max_rows=1, max_len=8)
    assert "GPT-2" in draft.native_unsupported()
    with pytest.raises(ValueError, match="GPT-2"):
        draft.use_native()
    assert not draft.native
    save_random(tmp_path, "llama")
    assert "float32" in DraftModel(tmp_path, max_rows=1, max_len=8, dtype=torch.bfloat16).native_unsupported()


def test_bfloat16_cache_native_equals_eager_and_stays_near_float32():
    """The engine's default on CPU (draft_cache_dtype "auto"): float32 arithmetic over a bfloat16 KV cache.
    On the shipped draft, from the same prefill, the native call and the eager forward with bfloat16 caches
    store the same keys and values (bfloat16's own tolerance: an entry may round the other way where the
    two products differ in float32's last bits) and return the same logits (1e-4); against a float32 cache
    each next-token distribution moves by at most 0.01 in total variation and keeps its argmax."""
    from deployment.defaults import DEMO_DRAFT

    eager, native = (DraftModel(DEMO_DRAFT, max_rows=8, max_len=128, cache_dtype=torch.bfloat16) for _ in range(2))
    wide = DraftModel(DEMO_DRAFT, max_rows=8, max_len=128)
    assert eager.k_cache.dtype == torch.bfloat16 and wide.k_cache.dtype == torch.float32
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, eager.vocab_size, (8, 100), generator=gen)
    for model in (eager, native, wide):
        model.forward(prefix, torch.zeros(8, dtype=torch.long), None)
    native.use_native()
    for batch, width in [(1, 1), (4, 1), (2, 2), (8, 1), (3, 2), (6, 3), (2, 9)]:
        tokens = torch.randint(0, eager.vocab_size, (batch, width), generator=gen)
        start = torch.randint(60, 100, (batch,), generator=gen)
        last = torch.randint(0, width, (batch,), generator=gen)
        logits = native.forward(tokens, start, last)
        torch.testing.assert_close(logits, eager.forward(tokens, start, last), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(native.k_cache, eager.k_cache)
        torch.testing.assert_close(native.v_cache, eager.v_cache)
        reference = wide.forward(tokens, start, last)
        assert (logits.softmax(-1) - reference.softmax(-1)).abs().sum(-1).max() / 2 <= 0.01
        assert torch.equal(logits.argmax(-1), reference.argmax(-1))


def test_native_products_of_many_rows_multiply_in_bfloat16_near_float32():
    """Where the weights are exactly bfloat16 values, the native forward multiplies the LM head of 16 rows
    or more, and layer products of 128 rows or more (a batch of prompts rebuilt), in bfloat16 (oneDNN).
    On the shipped draft, against the eager float32 forward from the same cache: each next-token
    distribution within 0.01 in total variation, and 15 of every 16 argmaxes or more the same (a near
    tie may turn); the keys and values the rebuild writes within bfloat16's rounding of the products."""
    from deployment.defaults import DEMO_DRAFT

    eager, native = (DraftModel(DEMO_DRAFT, max_rows=20, max_len=400) for _ in range(2))
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, eager.vocab_size, (20, 100), generator=gen)
    for model in (eager, native):
        model.forward(prefix, torch.zeros(20, dtype=torch.long), None)
    native.use_native("on")  # whether or not they pay on this processor
    assert native.native_wide
    agree = rows = 0
    for batch, width in [(16, 1), (20, 1), (17, 2), (2, 64), (4, 40)]:  # LM heads of 16-20 rows; 128 and 160 fed
        tokens = torch.randint(0, eager.vocab_size, (batch, width), generator=gen)
        start = torch.randint(60, 100, (batch,), generator=gen)
        last = torch.randint(0, width, (batch,), generator=gen)
        logits, reference = native.forward(tokens, start, last), eager.forward(tokens, start, last)
        assert (logits.softmax(-1) - reference.softmax(-1)).abs().sum(-1).max() / 2 <= 0.01
        agree += int((logits.argmax(-1) == reference.argmax(-1)).sum())
        rows += batch
        scale = eager.k_cache.abs().max()
        torch.testing.assert_close(native.k_cache, eager.k_cache, atol=float(scale) * 2**-7, rtol=0)
        torch.testing.assert_close(native.v_cache, eager.v_cache, atol=float(eager.v_cache.abs().max()) * 2**-7, rtol=0)
    assert agree >= rows * 15 / 16


def test_products_of_many_rows_stay_float32_where_bfloat16_does_not_pay(monkeypatch):
    """bfloat16_gemm: "auto" multiplies the wide products in bfloat16 exactly where `bfloat16_gemm_pays`
    says so (emulated bfloat16 took 2-6 times float32's time on an AVX2-only processor here); "off" never.
    Without them the native forward of 16 rows and of a 128-token rebuild equals the eager float32 one
    (1e-4 relative), with its narrow feeds still on the bfloat16 copies. The timing itself answers a bool
    for the shipped draft's LM head."""
    from deployment.defaults import DEMO_DRAFT
    from plugin import native_draft

    eager = DraftModel(DEMO_DRAFT, max_rows=16, max_len=200)
    assert isinstance(native_draft.bfloat16_gemm_pays(eager.lm_head, repeats=2), bool)
    for pays in (True, False):
        monkeypatch.setattr(native_draft, "bfloat16_gemm_pays", lambda weight, pays=pays: pays)
        auto = DraftModel(DEMO_DRAFT, max_rows=16, max_len=200)
        auto.use_native()
        assert auto.native_wide == pays and auto.native_narrow
    native = DraftModel(DEMO_DRAFT, max_rows=16, max_len=200)
    with pytest.raises(ValueError, match="bfloat16_gemm must be 'auto', 'on' or 'off'"):
        native.use_native("yes")
    native.use_native("off")
    assert not native.native_wide and native.native_narrow
    gen = torch.Generator().manual_seed(9)
    rebuild = torch.randint(0, eager.vocab_size, (2, 64), generator=gen)  # 128 rows of products, no logits
    for model in (eager, native):
        model.forward(rebuild, torch.zeros(2, dtype=torch.long), None, rows=torch.tensor([3, 7]))
    torch.testing.assert_close(native.k_cache, eager.k_cache, atol=1e-5, rtol=1e-5)
    tokens = torch.randint(0, eager.vocab_size, (16, 1), generator=gen)
    start, last = torch.full((16,), 64), torch.zeros(16, dtype=torch.long)
    torch.testing.assert_close(native.forward(tokens, start, last), eager.forward(tokens, start, last), atol=1e-4, rtol=1e-4)
