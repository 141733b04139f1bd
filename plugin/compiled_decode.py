"""The draft's one-token decode step, compiled: `torch.compile` of `DraftModel.decode_static` with the
batch padded up to a few fixed sizes, so that every call reuses one of a handful of graphs (on CUDA,
`mode="reduce-overhead"`: CUDA graphs, as gpt-fast does; on CPU, inductor's C++ kernels). All sizes
are compiled at start-up (`warm_up`), so no request waits for a compile. Any failure to compile or to
run falls back to the eager step, for good, with one warning.
"""

import logging
import time

import torch

logger = logging.getLogger("specserve.compiled_decode")
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class CompiledDecode:
    def __init__(self, model, max_rows: int):
        self.model = model
        self.buckets = [b for b in BUCKETS if b < max_rows] + [max_rows]
        mode = None
        if model.device.type == "cuda":
            mode = "reduce-overhead"
            # The decoder's tensors are attributes of a plain object, not an nn.Module's buffers: without
            # this, CUDA graph replays would copy each of them (the whole KV cache) into static inputs.
            for tensor in model.tensors():
                torch._dynamo.mark_static_address(tensor)
        self.step = torch.compile(model.decode_static, mode=mode, dynamic=False, fullgraph=True)
        self.failed: str | None = None
        self.compile_seconds = 0.0

    def _bucket(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def warm_up(self) -> None:
        """Compile every bucket now (the warm-up writes land at position 0 of rows that hold nothing yet)."""
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
            size = self._bucket(batch)
            pad = size - batch  # padding rows read cache rows batch..size-1 and write nothing
            if pad:
                tokens = torch.cat([tokens, tokens.new_zeros(pad, 1)])
                positions = torch.cat([positions, positions.new_zeros(pad)])
            try:
                logits, keys, values = self.step(tokens, positions)
                self.model.write_kv(positions[:batch], keys[:, :batch], values[:, :batch])
                return logits[:batch].clone()
            except Exception as exc:  # noqa: BLE001 - compilation can fail in many ways: eager is always there
                self.failed = f"{type(exc).__name__}: {exc}"
                logger.warning("specserve: the compiled draft step failed (%s); decoding eagerly from now on",
                               self.failed[:500])
                tokens, positions = tokens[:batch], positions[:batch]
        return self.model.forward(tokens, positions, torch.zeros_like(positions))
