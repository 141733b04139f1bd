"""The draft's one-token decode step, compiled: `torch.compile` of `DraftModel.decode_step`, in the form
each device needs.

- CUDA: `mode="reduce-overhead"`, that is CUDA graphs, as gpt-fast does. A graph needs static shapes, so
  the batch is padded up to a few fixed sizes and attention reads all max_len cached positions (masked):
  on a GPU that costs little beside the launches a graph saves.
- CPU: inductor's C++ kernels with dynamic shapes: one graph for every batch size and prefix length
  (and one for batch 1, which inductor specialises), reading only the batch's longest prefix. Padding
  to fixed sizes would not pay here, where attending over all max_len positions costs more than the
  kernel launches it saves.

Every graph is compiled at start-up (`warm_up`), so no request waits for a compile. Any failure to
compile or to run falls back to the eager step, for good, with one warning.
"""

import logging
import time

import torch

logger = logging.getLogger("specserve.compiled_decode")
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# Dynamic shapes specialise sizes 0 and 1: the prefix read is never shorter than this, so that one graph
# serves every position (the mask hides what lies beyond a row's own).
_MIN_KEY_LEN = 2


class CompiledDecode:
    def __init__(self, model, max_rows: int):
        self.model = model
        self.static = model.device.type == "cuda"
        if self.static:
            self.buckets = [b for b in BUCKETS if b < max_rows] + [max_rows]
            # The decoder's tensors are attributes of a plain object, not an nn.Module's buffers: without
            # this, CUDA graph replays would copy each of them (the whole KV cache) into static inputs.
            for tensor in model.tensors():
                torch._dynamo.mark_static_address(tensor)
            self.step = torch.compile(model.decode_step, mode="reduce-overhead", dynamic=False, fullgraph=True)
        else:
            self.buckets = [1, 2] if max_rows > 1 else [1]  # batch 1, and every other size
            self.step = torch.compile(model.decode_step, dynamic=True, fullgraph=True)
        self.failed: str | None = None
        self.compile_seconds = 0.0

    def _bucket(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def warm_up(self) -> None:
        """Compile every graph now (the warm-up writes land at position 0 of rows that hold nothing yet)."""
        start = time.perf_counter()
        for size in self.buckets:
            zeros = torch.zeros(size, dtype=torch.long, device=self.model.device)
            self(zeros.unsqueeze(1), zeros)
            if self.failed:
                break
        self.compile_seconds = time.perf_counter() - start

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens [B, 1] at positions [B] on cache rows 0..B-1; logits [B, V]."""
        batch = tokens.shape[0]
        if self.failed is None:
            try:
                if self.static:
                    size = self._bucket(batch)
                    pad = size - batch  # padding rows read cache rows batch..size-1 and write nothing
                    padded_tokens = torch.cat([tokens, tokens.new_zeros(pad, 1)]) if pad else tokens
                    padded_positions = torch.cat([positions, positions.new_zeros(pad)]) if pad else positions
                    logits, keys, values = self.step(padded_tokens, padded_positions, self.model.max_len)
                else:
                    key_len = min(max(int(positions.max()), _MIN_KEY_LEN), self.model.max_len)
                    logits, keys, values = self.step(tokens, positions, key_len)
                self.model.write_kv(positions, keys[:, :batch], values[:, :batch])
                return logits[:batch].clone() if self.static else logits
            except Exception as exc:  # noqa: BLE001 - compilation can fail in many ways: eager is always there
                self.failed = f"{type(exc).__name__}: {exc}"
                logger.warning("specserve: the compiled draft step failed (%s); decoding eagerly from now on",
                               self.failed[:500])
        return self.model.forward(tokens, positions, torch.zeros_like(positions))
