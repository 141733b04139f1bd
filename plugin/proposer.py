"""`DraftProposer`: the draft half of draft-and-verify, as vLLM 0.32's `custom_class` proposer.

Every step, for all running requests together, it catches the draft's KV cache up with each request's
token prefix (one batched forward over the tokens the draft has not seen, usually the accepted drafts
plus the recovered or bonus token) and then drafts K tokens, one batched forward per draft position.
Each draft token is sampled from the request's processed draft distribution q (temperature, top-k,
top-p; argmax when greedy), and q is handed to the model runner's draft-probability slot, so the
target verifies with the full min(1, p/q) test.

Draft KV state follows the request's tokens, not its history: before each step the cached prefix is
compared with the request's current tokens and cut back to the common prefix, which rolls back
rejected drafts and rebuilds whatever vLLM preempted or recomputed. Cache rows follow vLLM's batch
rows; a request that leaves the batch or finishes loses its row.

A failure while drafting (an exception, or running out of device memory) makes that step propose
nothing: decoding continues without speculation, and the failure is logged and counted.
"""

import logging
import random
import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from plugin import _vllm_internals as internals
from plugin.config import CONFIG_KEY, check_shared_vocabulary, resolve_model_dir
from plugin.draft_model import DraftModel
from plugin.sampling import processed_probs, sample_from
from plugin.step_profile import StepProfile

logger = logging.getLogger("specserve.proposer")
_DEFAULT_MAX_ROWS = 64


class DraftFault(RuntimeError):
    """An injected drafting failure (fault_injection_rate)."""


@dataclass
class CatchUp:
    """One step's plan, per batch row (up to max_rows): whether it drafts, the tokens it feeds the draft
    before drafting (those its cache lacks), and the cache position of the first of them."""

    drafting: np.ndarray  # [rows] bool
    feed: list[np.ndarray]  # rows x [n_i] token ids
    start: np.ndarray  # [rows] int64


class DraftProposer:
    """The draft model, its KV cache (rows follow vLLM's batch rows) and per-request draft generators.
    vLLM builds it as `DraftProposer(vllm_config)` and calls `load_model` then `propose` every step;
    `SpeculativeWorker` attaches the model runner and releases finished requests."""

    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        options: dict[str, Any] = (vllm_config.additional_config or {}).get(CONFIG_KEY) or {}
        if not options.get("draft_model"):
            raise ValueError(f"{type(self).__name__} needs additional_config['{CONFIG_KEY}']['draft_model']; "
                             "build the engine arguments with plugin.speculative_engine_kwargs(...)")
        model_config = vllm_config.model_config
        self.k = spec.num_speculative_tokens
        self.draft_dir = resolve_model_dir(options["draft_model"])
        check_shared_vocabulary(model_config.tokenizer or model_config.model, self.draft_dir)
        self.target_vocab = model_config.get_vocab_size()
        self.max_rows = options.get("max_draft_rows") or min(vllm_config.scheduler_config.max_num_seqs, _DEFAULT_MAX_ROWS)
        self.max_len = options.get("max_draft_len") or model_config.max_model_len
        self.device = torch.device(vllm_config.device_config.device)
        dtype = options.get("draft_dtype", "auto")
        self.dtype = torch.float32 if dtype == "auto" and self.device.type == "cpu" else (
            model_config.dtype if dtype == "auto" else getattr(torch, dtype))
        self.fault_rate = float(options.get("fault_injection_rate") or 0.0)
        self._fault_rng = random.Random(0)

        self.model: Optional[DraftModel] = None
        self.runner = None
        self.owner: list[Optional[str]] = [None] * self.max_rows  # request id per cache row
        self.cached = np.zeros((self.max_rows, self.max_len), dtype=np.int64)  # tokens in each row
        self.valid = np.zeros(self.max_rows, dtype=np.int64)  # cached prefix length per row
        self.generators: dict[str, torch.Generator] = {}  # seeded requests' draft generators
        self.stats = {"steps": 0, "proposed_requests": 0, "draft_tokens": 0, "failures": 0, "draft_seconds": 0.0}
        self.profile = StepProfile(self.device, bool(options.get("profile_steps")))

    # --- wiring ------------------------------------------------------------------------------------

    def load_model(self, target_model=None) -> None:
        self.model = DraftModel(self.draft_dir, self.max_rows, self.max_len, self.device, self.dtype)
        logger.info("specserve draft %s: %d layers, K=%d, KV cache %d rows x %d positions (%.1f MiB)",
                    self.draft_dir, self.model.num_layers, self.k, self.max_rows, self.max_len,
                    self.model.cache_bytes / 2**20)

    def attach(self, runner) -> None:
        """The model runner whose batch rows, sampling parameters and draft-probability slot we use."""
        self.runner = runner

    def release(self, req_ids) -> None:
        """Free the state of finished requests."""
        for row, owner in enumerate(self.owner):
            if owner in req_ids:
                self.owner[row] = None
                self.valid[row] = 0
        for req_id in req_ids:
            self.generators.pop(req_id, None)

    def tracked_requests(self) -> set[str]:
        return {o for o in self.owner if o is not None} | set(self.generators)

    # --- proposing ---------------------------------------------------------------------------------

    def propose(
        self,
        sampled_token_ids: list[list[int]],  # [batch][tokens emitted this step] per vLLM batch row
        num_tokens_no_spec: np.ndarray,  # [>= batch] tokens each row really holds (no drafts)
        token_ids_cpu: np.ndarray,  # [>= batch, max_model_len] each row's token ids
        slot_mappings=None,  # vLLM's target KV slots; the draft keeps its own cache
    ) -> list[list[int]]:
        """vLLM's custom_class entry point, after each verification step: up to K draft tokens per
        batch row ([] for a row that does not draft), and q [batch, K, vocab] (None when every request
        is greedy) in the runner's draft-probability slot for the next step's verification."""
        batch = len(sampled_token_ids)
        if self.model is None or self.runner is None:
            return [[] for _ in range(batch)]
        start = time.perf_counter()
        self.stats["steps"] += 1
        try:
            if self.fault_rate and self._fault_rng.random() < self.fault_rate:
                raise DraftFault("injected draft fault")
            req_ids = internals.batch_request_ids(self.runner, batch)
            drafts, q = self._propose(req_ids, sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        except Exception as exc:  # the draft must never fail a request: skip speculation this step
            self.stats["failures"] += 1
            self.valid[:] = 0  # a half-finished step may leave rows inconsistent: rebuild them
            log = logger.warning if isinstance(exc, DraftFault) else logger.exception
            log("specserve: drafting failed (%s); this step decodes without speculation", exc)
            return [[] for _ in range(batch)]
        finally:
            self.stats["draft_seconds"] += time.perf_counter() - start
        internals.hand_draft_probs(self.runner, q, req_ids)
        return drafts

    def _propose(self, req_ids, sampled_token_ids, num_tokens_no_spec, token_ids_cpu):
        """The step, in order: follow vLLM's batch rows, plan each row's catch-up, run the draft,
        record what its cache now holds."""
        with self.profile.phase("follow_rows"):
            self._follow_batch_rows(req_ids)
        with self.profile.phase("plan"):
            plan = self._plan_catch_up(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        if not plan.drafting.any():
            return [[] for _ in sampled_token_ids], None
        drafts, q = self._draft(plan, len(sampled_token_ids))
        with self.profile.phase("commit"):
            return self._commit(plan, drafts, len(sampled_token_ids)), q

    def _follow_batch_rows(self, req_ids: list[str]) -> None:
        """Move cache rows so that row i holds the request in vLLM's batch row i."""
        where = {owner: row for row, owner in enumerate(self.owner) if owner is not None}
        src, dst = [], []
        for row, req_id in enumerate(req_ids[: self.max_rows]):
            old = where.get(req_id)
            if old is not None and old != row:
                src.append(old)
                dst.append(row)
        if src:
            self.model.move_rows(src, dst)
            self.cached[dst] = self.cached[src]
            self.valid[dst] = self.valid[src]
        kept = set(req_ids[: self.max_rows])
        for row in range(self.max_rows):
            req_id = req_ids[row] if row < len(req_ids) else None
            if req_id is None or (self.owner[row] != req_id and where.get(req_id) is None):
                self.valid[row] = 0  # a new (or resumed) request: rebuilt from its tokens
            self.owner[row] = req_id
        for req_id in list(self.generators):
            if req_id not in kept:
                del self.generators[req_id]

    def _plan_catch_up(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu) -> "CatchUp":
        """Which rows draft this step, and the tokens each must feed first: the cached prefix is cut back
        to where it stops matching the request's real tokens (rolled-back drafts, preemption), and
        everything after it is fed again."""
        rows = min(len(sampled_token_ids), self.max_rows)
        feed: list[np.ndarray] = []
        drafting = np.zeros(rows, dtype=bool)
        for row in range(rows):
            n = int(num_tokens_no_spec[row])
            if not len(sampled_token_ids[row]) or n + self.k > self.max_len:
                feed.append(np.zeros(0, dtype=np.int64))
                continue
            tokens = token_ids_cpu[row, :n]
            keep = min(int(self.valid[row]), n - 1)  # at least the last token is fed: its logits draft
            differ = np.nonzero(self.cached[row, :keep] != tokens[:keep])[0]
            if len(differ):
                keep = int(differ[0])
            feed.append(np.asarray(tokens[keep:], dtype=np.int64))
            self.valid[row] = keep
            drafting[row] = True
        return CatchUp(drafting=drafting, feed=feed, start=self.valid[:rows].copy())

    def _draft(self, plan: "CatchUp", batch: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The catch-up forward, then K draft tokens per row, one batched forward per position, each
        sampled from the row's processed q. Returns drafts [rows, K] and q [batch, K, vocab] (None when
        every row is greedy: greedy rows are verified by argmax alone)."""
        rows, k = len(plan.drafting), self.k
        width = max(len(tokens) for tokens in plan.feed)
        feed = np.zeros((rows, width), dtype=np.int64)  # [rows, width], right-padded
        lengths = np.ones(rows, dtype=np.int64)  # [rows]; rows with nothing to feed read position 0
        for row, tokens in enumerate(plan.feed):
            feed[row, : len(tokens)] = tokens
            lengths[row] = max(len(tokens), 1)

        temperature, top_k, top_p, generators = self._sampling_params(rows)
        greedy = temperature <= 0  # [rows]
        drafts = torch.zeros(rows, k, dtype=torch.long, device=self.device)
        q = None if bool(greedy.all()) else torch.zeros(batch, k, self.target_vocab, device=self.device)
        tokens = torch.from_numpy(feed).to(self.device)  # [rows, width], then [rows, 1]
        positions = torch.from_numpy(plan.start).to(self.device)  # [rows]
        last = torch.from_numpy(lengths - 1).to(self.device)  # [rows] index of each row's last real token
        for j in range(k):
            with self.profile.phase("catch_up" if j == 0 else "draft_forward"):
                logits = self._vocab_aligned(self.model.forward(tokens, positions, last))  # [rows, vocab]
            with self.profile.phase("sampling"):
                probs = processed_probs(logits, temperature, top_k, top_p)
                token = torch.where(greedy, probs.argmax(-1), sample_from(probs, generators))  # [rows]
                drafts[:, j] = token
                if q is not None:
                    q[:rows, j] = probs
            positions = positions + last + 1
            tokens, last = token.unsqueeze(1), torch.zeros_like(last)
        return drafts, q

    def _commit(self, plan: "CatchUp", drafts: torch.Tensor, batch: int) -> list[list[int]]:
        """Record what each drafting row's cache now holds (its catch-up tokens and its first K - 1
        drafts; the K-th was never fed) and hand out the drafts."""
        k = self.k
        drafts_np = drafts.cpu().numpy()
        out: list[list[int]] = [[] for _ in range(batch)]
        for row in np.nonzero(plan.drafting)[0]:
            s, n = int(plan.start[row]), len(plan.feed[row])
            self.cached[row, s : s + n] = plan.feed[row]
            self.cached[row, s + n : s + n + k - 1] = drafts_np[row, : k - 1]
            self.valid[row] = s + n + k - 1
            out[row] = drafts_np[row].tolist()
        self.stats["proposed_requests"] += int(plan.drafting.sum())
        self.stats["draft_tokens"] += int(plan.drafting.sum()) * k
        return out

    def _sampling_params(self, rows: int):
        """Per row: temperature, top_k, top_p [rows] on the draft's device, and a generator for each
        seeded request (its own reproducible draft stream, derived from the request's seed)."""
        temperature, top_k, top_p, vllm_generators = internals.batch_sampling_params(self.runner, rows)
        req_ids = internals.batch_request_ids(self.runner, rows)
        generators = [None] * rows
        for row, vllm_gen in vllm_generators.items():
            req_id = req_ids[row]
            if req_id not in self.generators:
                self.generators[req_id] = torch.Generator(self.device).manual_seed(vllm_gen.initial_seed() ^ 0x5EED)
            generators[row] = self.generators[req_id]
        dev = self.device
        return (torch.from_numpy(temperature.astype(np.float32)).to(dev),
                torch.from_numpy(top_k.astype(np.int64)).to(dev),
                torch.from_numpy(top_p.astype(np.float32)).to(dev), generators)

    def _vocab_aligned(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary size (checkpoints pad embeddings differently)."""
        size = logits.shape[-1]
        if size == self.target_vocab:
            return logits
        if size > self.target_vocab:
            return logits[:, : self.target_vocab]
        pad = logits.new_full((logits.shape[0], self.target_vocab - size), float("-inf"))
        return torch.cat([logits, pad], dim=-1)
