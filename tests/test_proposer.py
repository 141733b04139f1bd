"""`DraftProposer`'s cache bookkeeping, driven step by step as vLLM's model runner drives it (a stand-in
runner holding just the batch arrays it reads), against a reference that recomputes every draft
distribution from scratch: after rollbacks, all-accepted steps, a new long request, rows that move,
a finished request, a preempted one that comes back, a new one in a row that another just left, and two
rows that swap; with every row drafting K tokens, and with per-row draft lengths that change every step
(0 included: a row that pauses drafting and catches up when it resumes)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from deployment.defaults import DEMO_DRAFT  # noqa: E402
from plugin import proposer as proposer_module  # noqa: E402
from plugin.draft_model import DraftModel  # noqa: E402
from plugin.proposer import DraftProposer  # noqa: E402

K, MAX_LEN, VOCAB, SLOTS = 3, 320, 4096, 8


def make_proposer(k_policy: str = "fixed", compile_draft: str = "auto", native_draft: str = "auto",
                  draft_cache_dtype: str = "float32") -> DraftProposer:
    """A proposer on the shipped draft. Its cache is float32 unless asked (the engine's default on CPU is
    bfloat16), so that its q can be held to the eager float32 reference's to float32 rounding."""
    config = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=K),
        additional_config={"specserve": {"draft_model": DEMO_DRAFT, "max_draft_rows": 4, "k_policy": k_policy,
                                         "compile_draft": compile_draft, "native_draft": native_draft,
                                         "draft_cache_dtype": draft_cache_dtype}},
        model_config=SimpleNamespace(tokenizer=DEMO_DRAFT, model=DEMO_DRAFT, max_model_len=MAX_LEN,
                                     dtype=torch.float32, get_vocab_size=lambda: VOCAB),
        scheduler_config=SimpleNamespace(max_num_seqs=SLOTS),
        device_config=SimpleNamespace(device="cpu"),
    )
    proposer = DraftProposer(config)
    proposer.load_model()
    return proposer


class Batch:
    """vLLM's persistent batch as the proposer reads it: request ids per row, token ids, sampling arrays."""

    def __init__(self):
        self.req_ids: list[str] = []
        self.token_ids = np.zeros((SLOTS, MAX_LEN), dtype=np.int32)
        self.temperature_cpu = np.ones(SLOTS, dtype=np.float32)
        self.top_k_cpu = np.zeros(SLOTS, dtype=np.int32)
        self.top_p_cpu = np.ones(SLOTS, dtype=np.float32)
        self.generators = {}


@pytest.fixture(scope="module")
def reference():
    model = DraftModel(DEMO_DRAFT, max_rows=1, max_len=MAX_LEN)

    def q_after(tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor([tokens])
        logits = model.forward(ids, torch.zeros(1, dtype=torch.long), torch.tensor([len(tokens) - 1]))
        return torch.softmax(logits[0], -1)

    return q_after


@pytest.mark.parametrize("lengths,forward", [
    ("fixed", "native"), ("varying", "native"), ("varying", "eager"),
    pytest.param("varying", "compiled", marks=pytest.mark.slow, id="varying-compiled"),
])
def test_drafts_follow_each_requests_tokens_through_every_kind_of_step(reference, lengths, forward, monkeypatch):
    """The reference is the eager decoder; the proposer's draft runs the native forward (one call in
    C++), the eager one or the compiled one-token decode. The native forward's products of many rows
    multiply in bfloat16 where that pays, and a rebuild in one forward would be such a product: there
    the rebuilds take chunks of 64 tokens (float32 products, which hold q to this test's tolerance); the
    others rebuild a long prefix in one forward."""
    rng = np.random.default_rng(0)
    if forward == "native":
        monkeypatch.setattr(proposer_module, "REBUILD_TOKENS", 0)
    compiled = forward == "compiled"
    proposer = make_proposer(compile_draft="on" if compiled else "off",
                             native_draft="on" if forward == "native" else "off")
    assert (proposer.decode is not None) == compiled
    assert proposer.model.native == (forward == "native")
    chosen = np.full(4, K)
    if lengths == "varying":  # the policy's choice, replaced by a random one per row and step
        proposer.policy.choose = lambda candidates, requests, pinned=None: np.where(candidates, chosen[: len(candidates)], 0)
    batch = Batch()
    proposer.attach(SimpleNamespace(input_batch=batch, requests={}))
    sequences: dict[str, list[int]] = {}
    last_drafts: dict[str, list[int]] = {}

    def place(rows: list[str]):
        batch.req_ids = list(rows)
        for row, req in enumerate(rows):
            batch.token_ids[row, : len(sequences[req])] = sequences[req]

    def step(accept: dict[str, int]):
        """Verification of last step's drafts (accept[req] of them kept, then one new token), then propose."""
        for req in batch.req_ids:
            kept = last_drafts.get(req, [])[: accept.get(req, 0)]
            sequences[req] += kept + [int(rng.integers(VOCAB))]
        place(batch.req_ids)
        if lengths == "varying":
            chosen[:] = rng.integers(0, K + 1, size=4)
        n = np.array([len(sequences[r]) for r in batch.req_ids] + [0] * (SLOTS - len(batch.req_ids)))
        drafts = proposer.propose([[1]] * len(batch.req_ids), n, batch.token_ids)
        q = proposer.runner._draft_probs
        live = chosen[: len(batch.req_ids)]
        if forward == "native" and live.any():  # forwards feed the drafting rows alone: a row fed per draft
            assert proposer._row_forwards == live.sum()
        elif live.any():  # forward j feeds rows 0..(the last with K > j)
            assert proposer._row_forwards == sum(np.nonzero(live > j)[0][-1] + 1 for j in range(live.max()))
        for row, req in enumerate(batch.req_ids):
            assert len(drafts[row]) == chosen[row]
            if chosen[row]:
                assert proposer.runner._draft_prob_req_ids == batch.req_ids
            for j in range(chosen[row]):
                expected = reference(sequences[req] + drafts[row][:j])
                torch.testing.assert_close(q[row, j], expected, atol=2e-5, rtol=1e-4)
            last_drafts[req] = drafts[row]

    sequences.update(a=list(rng.integers(VOCAB, size=10)), b=list(rng.integers(VOCAB, size=25)))
    place(["a", "b"])
    step({})
    step({"a": 1, "b": 0})  # rollbacks: some drafts rejected
    step({"a": K, "b": K})  # all accepted: the last draft and the bonus are fed
    sequences["c"] = list(rng.integers(VOCAB, size=150))  # a new long request joins (rebuilt in 1 or 3 forwards)
    place(["a", "b", "c"])
    step({"a": 2, "b": 1})
    step({"a": 0, "b": K, "c": 2})
    proposer.release({"a"})  # a finishes; vLLM condenses the batch: c moves into row 0
    place(["c", "b"])
    step({"c": 1, "b": 2})
    place(["c"])  # b is preempted ...
    step({"c": K})
    place(["c", "b"])  # ... and resumes: rebuilt from its tokens
    step({"c": 0})
    step({"c": 2, "b": 1})
    sequences["d"] = list(rng.integers(VOCAB, size=30))  # b is preempted and new d takes its row at once
    place(["c", "d"])
    step({"c": 1})
    place(["d", "c"])  # the two rows swap
    step({"d": 2, "c": K})
    assert proposer.tracked_requests() == {"c", "d"}
    assert proposer.stats["failures"] == 0
    if compiled:  # every one-token forward, catch-up included, went through the compiled step
        assert proposer.decode.failed is None, proposer.decode.failed


def test_a_rebuild_feeds_up_to_512_tokens_a_forward_and_at_least_64_a_row():
    """One new request's prompt goes in one forward (it took five of 64 tokens before), several rows share
    the forward's 512 tokens, and a row that runs out stops being fed."""
    proposer = make_proposer(native_draft="off")
    widths = []
    forward = proposer.model.forward

    def recording(tokens, *args, **kwargs):
        widths.append(tuple(tokens.shape))
        return forward(tokens, *args, **kwargs)

    proposer.model.forward = recording
    proposer._rebuilds = 0  # counted per step by propose
    token_ids = np.random.default_rng(0).integers(VOCAB, size=(SLOTS, MAX_LEN))
    proposer._feed(token_ids, np.array([0]), np.array([0]), np.array([300]))
    assert widths == [(1, 300)]
    widths.clear()
    proposer._feed(token_ids, np.arange(4), np.zeros(4, dtype=np.int64), np.array([300, 40, 200, 129]))
    assert widths == [(4, 128), (3, 128), (1, 44)]
    assert proposer._rebuilds == 4


@pytest.mark.parametrize("rows", [
    pytest.param([(0.0, 0, 1.0), (0.7, 20, 1.0), (1.0, 0, 0.9)], id="greedy-top_k-top_p"),
    pytest.param([(0.7, 0, 1.0), (1.0, 0, 1.0)], id="sampled-unfiltered"),
])
def test_each_row_drafts_from_its_own_processed_distribution(rows):
    """Rows of one batch with their own sampling: a greedy row drafts the argmax (q one-hot), a sampled
    row draws from its q, which is the draft's distribution after its temperature, top-k and top-p; the
    filters and the argmax are skipped where no row needs them, and nothing else changes."""
    from plugin.sampling import processed_probs

    rng = np.random.default_rng(1)
    proposer = make_proposer(native_draft="on", draft_cache_dtype="float32")
    model = DraftModel(DEMO_DRAFT, max_rows=1, max_len=MAX_LEN)
    batch = Batch()
    proposer.attach(SimpleNamespace(input_batch=batch, requests={}))
    batch.req_ids = [f"r{i}" for i in range(len(rows))]
    prompts = [list(rng.integers(VOCAB, size=12 + 5 * i)) for i in range(len(rows))]
    for row, (prompt, (temperature, top_k, top_p)) in enumerate(zip(prompts, rows)):
        batch.token_ids[row, : len(prompt)] = prompt
        batch.temperature_cpu[row], batch.top_k_cpu[row], batch.top_p_cpu[row] = temperature, top_k, top_p
    n = np.array([len(p) for p in prompts] + [0] * (SLOTS - len(rows)))
    drafts = proposer.propose([[1]] * len(rows), n, batch.token_ids)
    q = proposer.runner._draft_probs
    assert q is not None and q.shape == (len(rows), K, VOCAB)
    for row, (temperature, top_k, top_p) in enumerate(rows):
        assert len(drafts[row]) == K
        for j in range(K):
            tokens = torch.tensor([prompts[row] + drafts[row][:j]])
            logits = model.forward(tokens, torch.zeros(1, dtype=torch.long), torch.tensor([tokens.shape[1] - 1]))
            expected = processed_probs(logits, torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p]))[0]
            torch.testing.assert_close(q[row, j], expected, atol=2e-5, rtol=1e-4)
            if temperature == 0:
                assert drafts[row][j] == int(logits.argmax()) and q[row, j, drafts[row][j]] == 1
            else:
                assert q[row, j, drafts[row][j]] > 0  # drawn from q: never a token outside its filters
    assert proposer.stats["failures"] == 0


def test_the_draft_cache_is_bfloat16_under_a_float32_draft_on_cpu_unless_asked_otherwise():
    """auto: a float32 draft on CPU keeps its KV cache in bfloat16 (half the bytes its attention reads),
    natively and eagerly alike; a named dtype is kept."""
    for native in ("auto", "off"):
        proposer = make_proposer(native_draft=native, draft_cache_dtype="auto")
        assert proposer.model.k_cache.dtype == proposer.model.v_cache.dtype == torch.bfloat16
        assert proposer.model.dtype == torch.float32
    assert make_proposer(draft_cache_dtype="float32").model.k_cache.dtype == torch.float32


def test_native_forward_falls_back_to_eager_unless_required(monkeypatch):
    """auto: a draft the native forward does not serve, or a failed build, runs eagerly; on: the engine
    refuses to start instead; off: eager even where native applies."""
    from plugin import native_draft

    assert make_proposer(native_draft="auto").model.native
    assert not make_proposer(native_draft="off").model.native

    monkeypatch.setattr(DraftModel, "native_unsupported", lambda self: "GPT-2-family drafts run eagerly")
    assert not make_proposer(native_draft="auto").model.native
    with pytest.raises(RuntimeError, match="GPT-2-family"):
        make_proposer(native_draft="on")

    monkeypatch.undo()

    def no_compiler():
        raise OSError("no C++ compiler")

    monkeypatch.setattr(native_draft, "load", no_compiler)
    proposer = make_proposer(native_draft="auto")
    assert not proposer.model.native
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        make_proposer(native_draft="on")


def test_a_seeded_requests_draft_stream_goes_on_after_a_step_out_of_the_batch():
    """A seeded request preempted or left out of a step keeps its draft generator (as vLLM keeps its own),
    so the drafts it gets on its return are those of a run in which it never left: same tokens, same seed,
    temperature 1. Its generator goes when it finishes."""
    rng = np.random.default_rng(2)
    prompt, other = list(rng.integers(VOCAB, size=20)), list(rng.integers(VOCAB, size=15))

    def run(leaves: bool) -> list[list[int]]:
        proposer = make_proposer(native_draft="off", draft_cache_dtype="float32")
        batch = Batch()
        proposer.attach(SimpleNamespace(input_batch=batch, requests={}))
        drafts = []

        def step(req_ids, prompts):
            batch.req_ids = req_ids
            batch.generators = {0: torch.Generator().manual_seed(11)} if req_ids == ["b"] else {}
            for row, tokens in enumerate(prompts):
                batch.token_ids[row, : len(tokens)] = tokens
            n = np.array([len(t) for t in prompts] + [0] * (SLOTS - len(prompts)))
            return proposer.propose([[1]] * len(prompts), n, batch.token_ids)

        drafts.append(step(["b"], [prompt])[0])
        if leaves:
            step(["a"], [other])  # b is out of the batch for a step
        drafts.append(step(["b"], [prompt])[0])  # every draft rejected: the same tokens again
        assert "b" in proposer.generators
        proposer.release({"b"})
        assert "b" not in proposer.generators
        return drafts

    stayed, left = run(leaves=False), run(leaves=True)
    assert left == stayed
    assert stayed[0] != stayed[1]  # the stream moved on: a restarted one would repeat the first drafts


def test_acceptance_counts_only_the_drafts_the_scheduler_kept():
    """The scheduler's token budget can cut a row's drafts (a prompt ahead of it in the step): of three
    proposed it sent two, both accepted, and the row emitted three tokens. That is no rejection at the
    third position, which was never tested; counting what was proposed would record one."""
    rng = np.random.default_rng(3)
    prompt = list(rng.integers(VOCAB, size=20))
    proposer = make_proposer(native_draft="off", draft_cache_dtype="float32")
    batch = Batch()
    proposer.attach(SimpleNamespace(input_batch=batch, requests={}))
    batch.req_ids = ["b"]
    batch.token_ids[0, :20] = prompt
    n = np.array([20] + [0] * (SLOTS - 1))
    drafts = proposer.propose([[1]], n, batch.token_ids)[0]
    assert len(drafts) == K == 3
    tracker = proposer.policy.acceptance
    before_tested, before_accepted = tracker.engine_tested.copy(), tracker.engine_accepted.copy()
    proposer.scheduled_drafts = {"b": drafts[:2]}
    batch.token_ids[0, 20:23] = drafts[:2] + [7]
    proposer.propose([drafts[:2] + [7]], n + 3, batch.token_ids)
    decay = tracker.engine_decay
    np.testing.assert_allclose(tracker.engine_tested - before_tested * decay, [1, 1, 0])
    np.testing.assert_allclose(tracker.engine_accepted - before_accepted * decay, [1, 1, 0])
    # Placeholders (-1) that the scheduler pads a request with are no drafts: nothing tested.
    before_tested = tracker.engine_tested.copy()
    proposer.scheduled_drafts = {"b": [-1, -1, -1]}
    batch.token_ids[0, 23] = 9
    proposer.propose([[9]], n + 4, batch.token_ids)
    np.testing.assert_allclose(tracker.engine_tested, before_tested * decay)
