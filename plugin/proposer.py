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
from typing import Any, Optional

import numpy as np
import torch

from plugin.config import CONFIG_KEY, check_shared_vocabulary, resolve_model_dir
from plugin.draft_model import DraftModel
from plugin.sampling import processed_probs, sample_from

logger = logging.getLogger("specserve.proposer")
_DEFAULT_MAX_ROWS = 64


class DraftFault(RuntimeError):
    """An injected drafting failure (fault_injection_rate)."""


class DraftProposer:
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

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None) -> list[list[int]]:
        batch = len(sampled_token_ids)
        if self.model is None or self.runner is None:
            return [[] for _ in range(batch)]
        start = time.perf_counter()
        self.stats["steps"] += 1
        try:
            if self.fault_rate and self._fault_rng.random() < self.fault_rate:
                raise DraftFault("injected draft fault")
            drafts, q = self._propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        except Exception as exc:  # the draft must never fail a request: skip speculation this step
            self.stats["failures"] += 1
            self.valid[:] = 0  # a half-finished step may leave rows inconsistent: rebuild them
            log = logger.warning if isinstance(exc, DraftFault) else logger.exception
            log("specserve: drafting failed (%s); this step decodes without speculation", exc)
            return [[] for _ in range(batch)]
        finally:
            self.stats["draft_seconds"] += time.perf_counter() - start
        self.runner._draft_probs = q
        self.runner._draft_prob_req_ids = list(self.runner.input_batch.req_ids[:batch])
        return drafts

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

    def _sampling_params(self, rows: int):
        batch = self.runner.input_batch
        temperature = torch.from_numpy(batch.temperature_cpu[:rows].astype(np.float32))
        top_k = torch.from_numpy(batch.top_k_cpu[:rows].astype(np.int64))
        top_p = torch.from_numpy(batch.top_p_cpu[:rows].astype(np.float32))
        generators = []
        for row in range(rows):
            vllm_gen = batch.generators.get(row)
            if vllm_gen is None:
                generators.append(None)
                continue
            req_id = batch.req_ids[row]
            if req_id not in self.generators:  # a seeded request: its own reproducible draft stream
                self.generators[req_id] = torch.Generator(self.device).manual_seed(vllm_gen.initial_seed() ^ 0x5EED)
            generators.append(self.generators[req_id])
        dev = self.device
        return temperature.to(dev), top_k.to(dev), top_p.to(dev), generators

    def _propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu):
        req_ids = list(self.runner.input_batch.req_ids[: len(sampled_token_ids)])
        self._follow_batch_rows(req_ids)
        rows = min(len(req_ids), self.max_rows)
        k = self.k

        # Which rows draft this step, and the tokens each must feed to catch up.
        catch_up: list[np.ndarray] = []
        drafting = np.zeros(rows, dtype=bool)
        for row in range(rows):
            n = int(num_tokens_no_spec[row])
            if not len(sampled_token_ids[row]) or n + k > self.max_len:
                catch_up.append(np.zeros(0, dtype=np.int64))
                continue
            tokens = token_ids_cpu[row, :n]
            keep = min(int(self.valid[row]), n - 1)
            differ = np.nonzero(self.cached[row, :keep] != tokens[:keep])[0]
            if len(differ):
                keep = int(differ[0])
            catch_up.append(np.asarray(tokens[keep:], dtype=np.int64))
            self.valid[row] = keep
            drafting[row] = True
        if not drafting.any():
            return [[] for _ in sampled_token_ids], None

        width = max(len(c) for c in catch_up)
        feed = np.zeros((rows, width), dtype=np.int64)
        lengths = np.ones(rows, dtype=np.int64)
        for row, tokens in enumerate(catch_up):
            feed[row, : len(tokens)] = tokens
            lengths[row] = max(len(tokens), 1)
        start = self.valid[:rows].copy()

        temperature, top_k, top_p, generators = self._sampling_params(rows)
        greedy = temperature <= 0
        drafts = torch.zeros(rows, k, dtype=torch.long, device=self.device)
        # Greedy requests are verified by argmax alone: q is only kept when some request samples.
        keep_q = not bool(greedy.all())
        q = torch.zeros(len(sampled_token_ids), k, self.target_vocab, device=self.device) if keep_q else None
        tokens = torch.from_numpy(feed).to(self.device)
        positions = torch.from_numpy(start).to(self.device)
        last = torch.from_numpy(lengths - 1).to(self.device)
        for j in range(k):
            logits = self._vocab_aligned(self.model.forward(tokens, positions, last))
            probs = processed_probs(logits, temperature, top_k, top_p)
            token = torch.where(greedy, probs.argmax(-1), sample_from(probs, generators))
            drafts[:, j] = token
            if keep_q:
                q[:rows, j] = probs
            positions = positions + last + 1
            tokens, last = token.unsqueeze(1), torch.zeros_like(last)

        # The cache now holds each drafting row's catch-up tokens and its first K-1 drafts.
        drafts_np = drafts.cpu().numpy()
        out: list[list[int]] = [[] for _ in sampled_token_ids]
        for row in np.nonzero(drafting)[0]:
            s, n = int(start[row]), len(catch_up[row])
            self.cached[row, s : s + n] = catch_up[row]
            self.cached[row, s + n : s + n + k - 1] = drafts_np[row, : k - 1]
            self.valid[row] = s + n + k - 1
            out[row] = drafts_np[row].tolist()
        self.stats["proposed_requests"] += int(drafting.sum())
        self.stats["draft_tokens"] += int(drafting.sum()) * k
        return out, q

    def _vocab_aligned(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary size (checkpoints pad embeddings differently)."""
        size = logits.shape[-1]
        if size == self.target_vocab:
            return logits
        if size > self.target_vocab:
            return logits[:, : self.target_vocab]
        pad = logits.new_full((logits.shape[0], self.target_vocab - size), float("-inf"))
        return torch.cat([logits, pad], dim=-1)
