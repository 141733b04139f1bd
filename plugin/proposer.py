"""`DraftProposer`: the draft half of draft-and-verify, as vLLM 0.32's `custom_class` proposer.

Every step, for all running requests together, it records how many of each request's drafts the target
accepted, asks the speculation policy (`plugin.speculation_policy`) how many tokens K_i each request
drafts next (0 to K_max: from the request's acceptance and the measured step costs), catches the draft's
KV cache up with the tokens of the requests that draft (usually just the recovered or bonus token; the
whole prefix for a new or preempted request, or one that paused drafting, in a forward of its own so
that other rows are not padded to it) and then drafts, one batched forward per draft position, of the
rows whose K_i reaches it (the native forward names its cache rows; the eager and compiled ones feed
every row up to the last of those, the others scratch, so that the batch reads the cache as a view). A
step in which no request drafts runs no draft forward at all. Each draft token is sampled from the request's processed draft
distribution q (temperature, top-k, top-p; argmax when greedy), and q is handed to the model runner's
draft-probability slot, so the target verifies with the full min(1, p/q) test.

Draft KV state follows the request's tokens, not its history: a cache row holds its request's real
tokens up to `verified`, then the K_i - 1 drafts it fed last step. Before each step those drafts are
compared with the tokens the target kept, and the cache is cut back to the last accepted one, which
rolls back rejected drafts. A row whose request is new, resumed or moved in from nowhere is rebuilt from
its tokens. Cache rows follow vLLM's batch rows; a request that leaves the batch or finishes loses its
row. All of this bookkeeping is array arithmetic over the batch; nothing loops over rows unless the
batch itself changed.

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
from plugin.compiled_decode import CompiledDecode
from plugin.config import CONFIG_KEY, check_shared_vocabulary, check_switch, resolve_model_dir
from plugin.draft_model import DraftModel
from plugin.sampling import argmax, processed_probs, sample_from
from plugin.speculation_policy import DEFAULT_SPEED_FLOOR, SpeculationPolicy
from plugin.step_profile import StepProfile, work_clock

logger = logging.getLogger("specserve.proposer")
_DEFAULT_MAX_ROWS = 64
CATCH_UP_WIDTH = 2  # tokens every row may feed in the first draft forward (see DraftProposer._draft)
# When rows rebuild a longer prefix (DraftProposer._feed): tokens per forward, all rows together, and at
# least REBUILD_CHUNK per row.
REBUILD_TOKENS = 512
REBUILD_CHUNK = 64


class DraftFault(RuntimeError):
    """An injected drafting failure (fault_injection_rate)."""


@dataclass
class CatchUp:
    """One step's plan, per batch row (up to max_rows): how many tokens it drafts (k, 0 for none), and
    the span of its real tokens, token_ids[row, start:end], that its cache lacks and must feed before
    drafting (empty for a row that does not draft: it feeds scratch from its first unverified position
    when a later row drafts)."""

    k: np.ndarray  # [rows] int64 draft tokens, 0..K_max
    start: np.ndarray  # [rows] int64
    end: np.ndarray  # [rows] int64
    token_ids: np.ndarray  # [>= rows, max_model_len] vLLM's token ids per batch row

    @property
    def drafting(self) -> np.ndarray:  # [rows] bool
        return self.k > 0


def _leading_drafts(tokens) -> int:
    """How many of a request's scheduled draft tokens are drafts: the scheduler pads a request that has
    one token left to compute with -1 placeholders (vLLM's `pad_spec_decode`), which verification skips."""
    return next((i for i, token in enumerate(tokens) if token < 0), len(tokens))


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
        self.target_model = str(model_config.model)
        check_shared_vocabulary(model_config.tokenizer or model_config.model, self.draft_dir)
        self.target_vocab = model_config.get_vocab_size()
        self.max_rows = options.get("max_draft_rows") or min(vllm_config.scheduler_config.max_num_seqs, _DEFAULT_MAX_ROWS)
        self.max_len = options.get("max_draft_len") or model_config.max_model_len
        self.device = torch.device(vllm_config.device_config.device)
        dtype = options.get("draft_dtype", "auto")
        self.dtype = torch.float32 if dtype == "auto" and self.device.type == "cpu" else (
            model_config.dtype if dtype == "auto" else getattr(torch, dtype))
        # auto: a bfloat16 cache under a float32 draft on CPU (half the bytes attention reads; the target's own
        # KV cache is bfloat16 too), the draft's dtype elsewhere.
        cache_dtype = options.get("draft_cache_dtype", "auto")
        self.cache_dtype = getattr(torch, cache_dtype) if cache_dtype != "auto" else (
            torch.bfloat16 if self.device.type == "cpu" and self.dtype == torch.float32 else self.dtype)
        self.fault_rate = float(options.get("fault_injection_rate") or 0.0)
        compile_draft = options.get("compile_draft", "auto")
        check_switch("compile_draft", compile_draft)
        # auto: compiled on CUDA (CUDA graphs remove the launch-bound draft's overhead); eager on CPU,
        # where `specserve bench` measured no gain and inductor adds tens of seconds to start-up.
        self.compile = compile_draft == "on" or (compile_draft == "auto" and self.device.type == "cuda")
        self.decode: Optional[CompiledDecode] = None
        self.native = options.get("native_draft", "auto")
        check_switch("native_draft", self.native)
        self._fault_rng = random.Random(0)
        self.policy = SpeculationPolicy(options.get("k_policy") or "adaptive", self.k, self.max_rows,
                                        options.get("request_speed_floor", DEFAULT_SPEED_FLOOR),
                                        k_max_unless_sure=options.get("k_max_unless_sure", True))

        self.model: Optional[DraftModel] = None
        self.runner = None
        # Per cache row: the request it holds; how many of its real tokens the cache holds (verified);
        # how many positions it holds in all (valid: verified plus up to K - 1 drafts); those drafts; how
        # many it proposed last step (proposed, to count what the target accepted); whether its request
        # ever drafted.
        self.owner: list[Optional[str]] = [None] * self.max_rows
        self.verified = np.zeros(self.max_rows, dtype=np.int64)
        self.valid = np.zeros(self.max_rows, dtype=np.int64)
        self.drafted = np.zeros((self.max_rows, max(self.k - 1, 0)), dtype=np.int64)
        self.proposed = np.zeros(self.max_rows, dtype=np.int64)
        self.ever_drafted = np.zeros(self.max_rows, dtype=bool)
        self.generators: dict[str, torch.Generator] = {}  # seeded requests' draft generators
        # The drafts the scheduler sent this step's verification, by request (set by the worker before the
        # step): its token budget can cut a row's drafts, and a cut draft was never tested. None when no
        # worker tells (a proposer driven directly): then what was proposed.
        self.scheduled_drafts: Optional[dict[str, list[int]]] = None
        self.stats = {"steps": 0, "steps_drafted": 0, "proposed_requests": 0, "draft_tokens": 0,
                      "draft_forwards": 0, "draft_row_forwards": 0, "finished_requests": 0,
                      "finished_requests_drafted": 0, "failures": 0, "draft_seconds": 0.0}
        self.last_step_seconds = 0.0  # the latest propose call's time (the worker subtracts it from the step)
        self.profile = StepProfile(self.device, bool(options.get("profile_steps")))

    # --- wiring ------------------------------------------------------------------------------------

    def load_model(self, target_model=None) -> None:
        self.model = DraftModel(self.draft_dir, self.max_rows, self.max_len, self.device, self.dtype, self.cache_dtype)
        logger.info("specserve draft %s: %d layers, K=%d, KV cache %d rows x %d positions in %s (%.1f MiB)",
                    self.draft_dir, self.model.num_layers, self.k, self.max_rows, self.max_len,
                    str(self.cache_dtype).removeprefix("torch."), self.model.cache_bytes / 2**20)
        if self.native != "off":
            self._use_native()
        if self.compile:
            self.decode = CompiledDecode(self.model, self.max_rows)
            self.decode.warm_up()
            logger.info("specserve draft decode compiled for batch sizes %s in %.1f s%s", self.decode.buckets,
                        self.decode.compile_seconds, f"; falling back to eager: {self.decode.failed}"
                        if self.decode.failed else "")
        self.policy.feeds_drafting_rows = self.feeds_drafting_rows
        self.policy.calibrate_draft({rows: self._time_draft_forward(rows) for rows in (1, min(16, self.max_rows))})

    def _use_native(self) -> None:
        """The draft's forward as one native call, where it applies ("on": or the engine fails to start)."""
        reason, failed = self.model.native_unsupported(), False
        if reason is None:
            try:
                seconds = self.model.use_native()
                logger.info("specserve draft forward: native (built or loaded in %.1f s); products of many rows in %s",
                            seconds, "bfloat16" if self.model.native_wide else "float32")
                return
            except Exception as exc:  # noqa: BLE001 - a build can fail in many ways: eager is always there
                reason, failed = f"{type(exc).__name__}: {str(exc)[:500]}", True
        if self.native == "on":
            raise RuntimeError(f"native_draft='on', but the native draft forward is unavailable: {reason}")
        # A failed build costs this engine's draft about half its speed: say so where operators look.
        (logger.warning if failed else logger.info)("specserve draft forward: eager (%s)", reason)

    def _time_draft_forward(self, rows: int, repeats: int = 5) -> float:
        """Least seconds of one draft forward feeding one token to each of `rows` rows over `repeats`,
        on `work_clock` (start-up calibration of the step-cost model, which other processes' work must
        not inflate; it writes scratch entries only, every row is empty)."""
        tokens = torch.zeros(rows, 1, dtype=torch.long, device=self.device)
        start, last = torch.zeros(rows, dtype=torch.long, device=self.device), torch.zeros(rows, dtype=torch.long, device=self.device)
        clock, times = work_clock(self.device), []
        for _ in range(repeats + 1):
            began = clock()
            self._forward(tokens, start, last).cpu()
            times.append(clock() - began)
        return min(times[1:])

    def attach(self, runner) -> None:
        """The model runner whose batch rows, sampling parameters and draft-probability slot we use."""
        self.runner = runner

    def release(self, req_ids) -> None:
        """Free the state of finished requests."""
        for row, owner in enumerate(self.owner):
            if owner in req_ids:
                self.stats["finished_requests"] += 1
                self.stats["finished_requests_drafted"] += int(self.ever_drafted[row])
                self.owner[row] = None
                self._forget(row)
                self._forget_request(row)
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
        self._forwards = self._row_forwards = self._rebuilds = 0
        try:
            if self.fault_rate and self._fault_rng.random() < self.fault_rate:
                raise DraftFault("injected draft fault")
            req_ids = internals.batch_request_ids(self.runner, batch)
            drafts, q = self._propose(req_ids, sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        except Exception as exc:  # the draft must never fail a request: skip speculation this step
            self.stats["failures"] += 1
            self._forget(slice(None))  # a half-finished step may leave rows inconsistent: rebuild them
            self.proposed[:] = 0
            log = logger.warning if isinstance(exc, DraftFault) else logger.exception
            log("specserve: drafting failed (%s); this step decodes without speculation", exc)
            return [[] for _ in range(batch)]
        finally:
            self.last_step_seconds = time.perf_counter() - start
            self.stats["draft_seconds"] += self.last_step_seconds
            if not self._rebuilds:  # a prefix rebuild is a one-off cost, not the step's
                self.policy.observe_draft(batch, self._forwards, self._row_forwards, self.last_step_seconds)
        internals.hand_draft_probs(self.runner, q, req_ids)
        return drafts

    def _propose(self, req_ids, sampled_token_ids, num_tokens_no_spec, token_ids_cpu):
        """The step, in order: follow vLLM's batch rows, count what the target accepted, choose each
        row's draft length, plan its catch-up, run the draft, record what its cache now holds."""
        batch = len(sampled_token_ids)
        if self.policy.mode == "off":  # nothing will draft: no bookkeeping either
            return [[] for _ in range(batch)], None
        with self.profile.phase("follow_rows"):
            self._follow_batch_rows(req_ids)
        with self.profile.phase("plan"):
            rows = min(batch, self.max_rows)
            emitted = np.fromiter(map(len, sampled_token_ids[:rows]), dtype=np.int64, count=rows)  # [rows]
            self._record_acceptance(emitted, req_ids)
            n = num_tokens_no_spec[:rows].astype(np.int64)  # [rows] real tokens
            seeded = np.zeros(rows, dtype=bool)
            seeded[internals.seeded_rows(self.runner, rows)] = True
            k = self.policy.choose((emitted > 0) & (n + self.k <= self.max_len), batch, pinned=seeded)  # [rows]
            if not k.any():
                self.proposed[:] = 0
                return [[] for _ in range(batch)], None
            plan = self._plan_catch_up(k, n, token_ids_cpu)
        drafts, q = self._draft(plan, req_ids)
        with self.profile.phase("commit"):
            return self._commit(plan, drafts, batch), q

    def _record_acceptance(self, emitted: np.ndarray, req_ids: list[str]) -> None:
        """Each row emitted its accepted drafts plus one token: feed the policy's acceptance counts, of the
        drafts the target verified (`scheduled_drafts`)."""
        rows = len(emitted)
        verified = self.proposed[:rows]
        if self.scheduled_drafts is not None:
            verified = np.fromiter((_leading_drafts(self.scheduled_drafts.get(req_id, ())) for req_id in req_ids[:rows]),
                                   dtype=np.int64, count=rows)
        self.policy.acceptance.record(np.where(emitted > 0, verified, 0), np.maximum(emitted - 1, 0))

    def _forget_request(self, rows) -> None:
        """The rows hold a new request: no acceptance history, nothing proposed."""
        self.policy.acceptance.forget(rows)
        self.proposed[rows] = 0
        self.ever_drafted[rows] = False

    def _forget(self, rows) -> None:
        """The cache rows hold nothing: their requests are rebuilt from their tokens when they draft."""
        self.verified[rows] = 0
        self.valid[rows] = 0

    def _follow_batch_rows(self, req_ids: list[str]) -> None:
        """Move cache rows so that row i holds the request in vLLM's batch row i. Nothing to do, and
        nothing is done, when the batch kept its rows (most steps)."""
        held = req_ids[: self.max_rows]
        if self.owner[: len(held)] == held and not any(self.owner[len(held):]):
            return
        where = {owner: row for row, owner in enumerate(self.owner) if owner is not None}
        moves = [(where[req_id], row) for row, req_id in enumerate(held)
                 if where.get(req_id, row) != row]
        if moves:
            src, dst = map(list, zip(*moves))
            self.model.move_rows(src, dst)
            for state in (self.verified, self.valid, self.drafted, self.proposed, self.ever_drafted):
                state[dst] = state[src]
            self.policy.acceptance.move(src, dst)
        for row in range(self.max_rows):
            req_id = held[row] if row < len(held) else None
            if req_id is None or req_id not in where:
                self._forget(row)  # empty, or a new (or resumed) request: rebuilt from its tokens
                self._forget_request(row)
            self.owner[row] = req_id
        # A seeded request's draft generator stays until it finishes (`release`), not while it is in the
        # batch: one preempted or left out of a step goes on with its stream, as its vLLM generator does.

    def _plan_catch_up(self, k: np.ndarray, n: np.ndarray, token_ids_cpu: np.ndarray) -> "CatchUp":
        """From which position each drafting row (k [rows] > 0; n [rows] real tokens) feeds its real
        tokens: the cache keeps its verified tokens and those of its K_i - 1 drafts that the target
        accepted; everything after them (the recovered or bonus token, or a whole prefix for a new or
        preempted request, or one that paused drafting) is fed again. At least the last token is fed:
        its logits give the first draft."""
        rows = len(k)
        verified, valid = self.verified[:rows], self.valid[:rows]
        j = np.arange(self.k - 1)
        at = np.minimum(verified[:, None] + j, token_ids_cpu.shape[1] - 1)  # [rows, K - 1] draft positions
        real = np.take_along_axis(token_ids_cpu[:rows], at, axis=1)
        accepted = (real == self.drafted[:rows]) & (j < (valid - verified)[:, None]) & (at < (n - 1)[:, None])
        keep = np.minimum(verified + accepted.cumprod(axis=1).sum(axis=1), n - 1)
        drafting = k > 0
        return CatchUp(k=k, start=np.where(drafting, keep, 0), end=np.where(drafting, n, 0), token_ids=token_ids_cpu)

    def _draft(self, plan: "CatchUp", req_ids: list[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The catch-up, then K_i draft tokens per row, one batched forward per position j, each token
        sampled from the row's processed q. req_ids: vLLM's batch rows (batch = len(req_ids); rows =
        the first max_rows of them). Returns drafts [rows, K_max] (a row's first K_i count) and q
        [batch, K_max, vocab] (None when every drafting row is greedy: greedy rows are verified by
        argmax alone).

        Forward j feeds the rows with K_i > j alone where the forward names its cache rows for free (the
        native one, `feeds_drafting_rows`); elsewhere rows 0..r-1, r one past the last row with K_i > j, so
        that the batch reads the cache as a view (gathering the rows that draft would copy their caches),
        and a row in that range that does not draft position j feeds scratch beyond its valid prefix and
        its token is dropped.

        Catch-up is not padded to its longest row: most rows feed one or two tokens (the recovered or
        bonus token, after an all-accepted step the last draft too), so every row feeds at most
        CATCH_UP_WIDTH tokens in the first draft forward, and the few rows that rebuild a longer prefix
        feed the rest of it before, in a forward of their own."""
        rows, drafting = len(plan.k), plan.drafting  # drafting [rows] bool
        lengths = plan.end - plan.start  # [rows] >= 1 where drafting
        width = min(int(lengths[drafting].max()), CATCH_UP_WIDTH)
        rebuilding = np.nonzero(drafting & (lengths > width))[0]
        if len(rebuilding):
            with self.profile.phase("rebuild"):
                self._feed(plan.token_ids, rebuilding, plan.start[rebuilding], lengths[rebuilding] - width)
        with self.profile.phase("catch_up"):
            tail = np.where(drafting, np.minimum(lengths, width), 1)  # [rows] tokens fed in the first forward
            first = np.where(drafting, plan.end - tail, self.verified[:rows])  # [rows] position of the first
            fed_np = self._fed_rows(np.nonzero(drafting)[0])  # [f]
            tokens = self._gather_tokens(plan.token_ids, fed_np, first[fed_np], tail[fed_np], drafting[fed_np])
        temperature, top_k, top_p, generators = self._sampling_params(req_ids[:rows])
        greedy = temperature <= 0  # [rows]
        greedy_drafting = greedy[torch.from_numpy(drafting)]
        any_greedy = bool(greedy_drafting.any())  # sampled rows then also need the argmax (below)
        drafts = torch.zeros(rows, self.k, dtype=torch.long, device=self.device)
        q = None if bool(greedy_drafting.all()) else torch.zeros(
            len(req_ids), self.k, self.target_vocab, device=self.device)
        positions = torch.from_numpy(first).to(self.device)  # [rows] where each row's next fed token goes
        last = torch.from_numpy(tail - 1).to(self.device)  # [rows] index of each row's last fed token
        for j in range(int(plan.k.max())):
            active_np = np.nonzero(plan.k > j)[0]  # [a] rows that draft position j
            fed_np = self._fed_rows(active_np)  # [f] rows this forward feeds, active among them
            active, fed = (torch.from_numpy(rows_np).to(self.device) for rows_np in (active_np, fed_np))
            # Rows 0..rows-1 all drafting (most steps) are read and written as a slice, not gathered.
            at = slice(0, rows) if len(active_np) == rows else active
            if j > 0:
                tokens = drafts[fed, j - 1].unsqueeze(1)  # [f, 1]
            with self.profile.phase("catch_up" if j == 0 else "draft_forward"):
                logits = self._forward(tokens, positions[fed], last[fed], fed if self.feeds_drafting_rows else None)
                logits = self._vocab_aligned(logits if self.feeds_drafting_rows else logits[active])  # [a, vocab]
            with self.profile.phase("sampling"):
                if q is None:  # every row greedy: the argmax is the draft, no distribution needed
                    token = argmax(logits)  # [a]
                else:
                    probs = processed_probs(logits, temperature[at], None if top_k is None else top_k[at],
                                            None if top_p is None else top_p[at])
                    token = sample_from(probs, [generators[r] for r in active_np])
                    if any_greedy:
                        token = torch.where(greedy[at], argmax(probs), token)
                    q[at, j] = probs
                drafts[at, j] = token
            positions[fed] += last[fed] + 1
            last[fed] = 0  # after the first forward every row feeds one token
            self._forwards += 1
            self._row_forwards += len(fed_np)
        return drafts, q

    @property
    def feeds_drafting_rows(self) -> bool:
        """Whether draft forwards feed only the rows that draft: the native forward reads named cache rows
        in place, where the eager one would copy them and the compiled decode reads rows 0..B-1."""
        return self.decode is None and self.model is not None and self.model.native

    def _fed_rows(self, drafting: np.ndarray) -> np.ndarray:
        """The rows a draft forward feeds for these drafting rows (ascending, not empty), see `_draft`."""
        return drafting if self.feeds_drafting_rows else np.arange(int(drafting[-1]) + 1)

    def _forward(self, tokens: torch.Tensor, first: torch.Tensor, last: torch.Tensor,
                 rows: torch.Tensor | None = None) -> torch.Tensor:
        """Feed tokens [B, T] to cache rows 0..B-1 (or those named by rows [B]) from positions first [B];
        the logits [B, V] after position last [B] of each row. Compiled (rows 0..B-1 only), as T one-token
        steps: step t feeds each row's token min(t, last), so a row with fewer tokens feeds its last one
        again, at the same position (the same keys and values), and the final step's logits are every row's own."""
        if self.decode is None:
            return self.model.forward(tokens, first, last, rows=rows)
        for t in range(tokens.shape[1]):
            column = last.clamp_max(t)  # [B]
            logits = self.decode(tokens.gather(1, column.unsqueeze(1)), first + column)
        return logits

    def _gather_tokens(self, token_ids, rows: np.ndarray, first: np.ndarray, count: np.ndarray,
                       real: np.ndarray | None = None) -> torch.Tensor:
        """token_ids[row, first : first + count] for each row, right-padded with 0 to [len(rows),
        max(count)] (rows where real is False feed a 0, writing scratch beyond their valid prefix)."""
        cols = first[:, None] + np.arange(int(count.max()))  # [len(rows), width]
        fed = cols < (first + count)[:, None]
        if real is not None:
            fed &= real[:, None]
        tokens = np.take_along_axis(token_ids[rows], np.minimum(cols, token_ids.shape[1] - 1), axis=1)
        return torch.from_numpy(np.where(fed, tokens, 0)).to(self.device)

    def _feed(self, token_ids, rows: np.ndarray, first: np.ndarray, count: np.ndarray) -> None:
        """Catch rows up on token_ids[row, first : first + count], in forwards of their own, each feeding
        every row still rebuilding a chunk of max(REBUILD_CHUNK, REBUILD_TOKENS / rows) tokens: rows of
        different lengths (a batch of new requests) pad to the chunk, not to the longest of them, and the
        usual case, one new request, feeds its prompt in one or a few forwards, not in many narrow ones
        (300 tokens here: 2.0 ms in one forward, whose products multiply in bfloat16, against 2.9 in
        five of 64; on a GPU each forward is a round of kernel launches)."""
        chunk = max(REBUILD_CHUNK, REBUILD_TOKENS // len(rows))
        for done in range(0, int(count.max()), chunk):
            active = count > done
            chunk_rows, chunk_first = rows[active], first[active] + done
            tokens = self._gather_tokens(token_ids, chunk_rows, chunk_first,
                                         np.minimum(count[active] - done, chunk))
            self.model.forward(tokens, torch.from_numpy(chunk_first).to(self.device), None,
                               rows=torch.from_numpy(chunk_rows).to(self.device))
            self._rebuilds += 1

    def _commit(self, plan: "CatchUp", drafts: torch.Tensor, batch: int) -> list[list[int]]:
        """Record what each drafting row's cache now holds (its real tokens, then its first K_i - 1
        drafts; the K_i-th was never fed) and hand out each row's K_i drafts."""
        drafts_np = drafts.cpu().numpy()
        rows = np.nonzero(plan.drafting)[0]
        k = plan.k[rows]
        if not self.feeds_drafting_rows:  # rows that did not draft fed scratch over their drafts' entries
            paused = np.nonzero(~plan.drafting)[0]
            self.valid[paused] = self.verified[paused]
        self.verified[rows] = plan.end[rows]
        self.valid[rows] = plan.end[rows] + k - 1
        self.drafted[rows] = drafts_np[rows, : self.k - 1]
        self.proposed[: len(plan.k)] = plan.k
        self.proposed[len(plan.k):] = 0
        self.ever_drafted[rows] = True
        out = [d[:n] for d, n in zip(drafts_np.tolist(), plan.k.tolist())]
        self.stats["steps_drafted"] += 1
        self.stats["proposed_requests"] += len(rows)
        self.stats["draft_tokens"] += int(k.sum())
        self.stats["draft_forwards"] += self._forwards
        self.stats["draft_row_forwards"] += self._row_forwards
        return out + [[] for _ in range(batch - len(out))]

    def _sampling_params(self, req_ids: list[str]):
        """Per row: temperature, top_k, top_p [rows] on the draft's device (top_k or top_p None where no
        row filters by it: every draft position would otherwise test that again), and a generator for each
        seeded request (its own reproducible draft stream, derived from the request's seed)."""
        rows = len(req_ids)
        temperature, top_k, top_p, vllm_generators = internals.batch_sampling_params(self.runner, rows)
        generators = [None] * rows
        for row, vllm_gen in vllm_generators.items():
            req_id = req_ids[row]
            if req_id not in self.generators:
                self.generators[req_id] = torch.Generator(self.device).manual_seed(vllm_gen.initial_seed() ^ 0x5EED)
            generators[row] = self.generators[req_id]
        dev = self.device
        filters_k = ((top_k > 0) & (top_k < self.target_vocab)).any()  # processed_probs' test, once a step
        return (torch.from_numpy(temperature.astype(np.float32)).to(dev),
                torch.from_numpy(top_k.astype(np.int64)).to(dev) if filters_k else None,
                torch.from_numpy(top_p.astype(np.float32)).to(dev) if (top_p < 1).any() else None, generators)

    def _vocab_aligned(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary size (checkpoints pad embeddings differently)."""
        size = logits.shape[-1]
        if size == self.target_vocab:
            return logits
        if size > self.target_vocab:
            return logits[:, : self.target_vocab]
        pad = logits.new_full((logits.shape[0], self.target_vocab - size), float("-inf"))
        return torch.cat([logits, pad], dim=-1)
