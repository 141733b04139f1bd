"""The draft model in plain PyTorch: a decoder with a KV cache whose rows follow vLLM's batch rows, so
a batched forward reads the cache as a view, with no gather.

Two families of Hugging Face checkpoints (safetensors):
- Llama-style (Llama, Qwen2, Mistral): RMSNorm, rotary positions, SwiGLU, grouped-query attention,
  Qwen2's q/k/v biases;
- GPT-2 (the seeds' pair: GPT-2 drafting for GPT-2-medium): LayerNorm with biases, learned positions,
  tanh-approximated GELU, one fused attention projection (stored as Conv1D, [in, out]).
Both run the same pre-norm block below. Vocabulary checks live in `plugin.config`.
"""

import json
from pathlib import Path

import torch
import torch.nn.functional as F

LLAMA_STYLE = {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"}
GPT2_STYLE = {"GPT2LMHeadModel"}
SUPPORTED_ARCHITECTURES = LLAMA_STYLE | GPT2_STYLE


def read_config(model_dir: str | Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def _rope_theta(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def _load_weights(model_dir: Path, device, dtype) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(file))
    if not weights:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return {name: w.to(device=device, dtype=dtype) for name, w in weights.items()}


def _llama_layers(w: dict, num_layers: int) -> list[dict]:
    # q/k/v and gate/up are fused into one matmul each: a small draft is bound by per-op overhead.
    layers = []
    for i in range(num_layers):
        p = f"model.layers.{i}."
        biases = [w.get(p + f"self_attn.{n}_proj.bias") for n in "qkv"]
        layers.append({
            "in_norm": w[p + "input_layernorm.weight"],
            "post_norm": w[p + "post_attention_layernorm.weight"],
            "qkv": torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]),
            "qkv_b": torch.cat(biases) if biases[0] is not None else None,
            "o": w[p + "self_attn.o_proj.weight"],
            "up": torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]),
            "down": w[p + "mlp.down_proj.weight"],
        })
    return layers


def _gpt2_layers(w: dict, num_layers: int) -> list[dict]:
    # GPT-2's Conv1D stores weights as [in, out]: transposed once here into F.linear's [out, in].
    layers = []
    for i in range(num_layers):
        p = f"h.{i}."
        layers.append({
            "in_norm": w[p + "ln_1.weight"], "in_norm_b": w[p + "ln_1.bias"],
            "post_norm": w[p + "ln_2.weight"], "post_norm_b": w[p + "ln_2.bias"],
            "qkv": w[p + "attn.c_attn.weight"].t().contiguous(), "qkv_b": w[p + "attn.c_attn.bias"],
            "o": w[p + "attn.c_proj.weight"].t().contiguous(), "o_b": w[p + "attn.c_proj.bias"],
            "up": w[p + "mlp.c_fc.weight"].t().contiguous(), "up_b": w[p + "mlp.c_fc.bias"],
            "down": w[p + "mlp.c_proj.weight"].t().contiguous(), "down_b": w[p + "mlp.c_proj.bias"],
        })
    return layers


class DraftModel:
    """Batched incremental decoding over cache rows 0..B-1 (row i = vLLM batch row i)."""

    def __init__(self, model_dir: str | Path, max_rows: int, max_len: int, device="cpu", dtype=torch.float32,
                 cache_dtype: torch.dtype | None = None):
        model_dir = Path(model_dir)
        cfg = read_config(model_dir)
        arch = (cfg.get("architectures") or ["?"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"draft model {model_dir}: architecture {arch} is not supported "
                             f"(supported: {sorted(SUPPORTED_ARCHITECTURES)})")
        self.gpt2 = arch in GPT2_STYLE
        self.max_rows, self.max_len = max_rows, max_len
        self.device, self.dtype = torch.device(device), dtype
        # The KV cache may be narrower than the arithmetic (bfloat16 under float32: keys and values rounded
        # as they are stored, read back widened): attention over a long prefix reads the whole cache every
        # forward, and at a batch of 16 that read, not the products, is most of a CPU draft forward.
        self.cache_dtype = cache_dtype or dtype
        w = _load_weights(model_dir, self.device, dtype)
        self.vocab_size = cfg["vocab_size"]
        if self.gpt2:
            w = {name.removeprefix("transformer."): t for name, t in w.items()}
            self.num_layers, self.num_heads = cfg["n_layer"], cfg["n_head"]
            self.num_kv_heads, self.head_dim = self.num_heads, cfg["n_embd"] // cfg["n_head"]
            self.eps = cfg.get("layer_norm_epsilon", 1e-5)
            if max_len > cfg["n_positions"]:
                raise ValueError(f"draft model {model_dir} has {cfg['n_positions']} positions; "
                                 f"max_draft_len {max_len} needs more")
            self.embed, self.positions_embed = w["wte.weight"], w["wpe.weight"]
            self.lm_head = w.get("lm_head.weight", self.embed)
            self.final_norm, self.final_norm_b = w["ln_f.weight"], w["ln_f.bias"]
            self.layers = _gpt2_layers(w, self.num_layers)
        else:
            self.num_layers, self.num_heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
            self.num_kv_heads = cfg.get("num_key_value_heads", self.num_heads)
            self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // self.num_heads
            self.eps = cfg.get("rms_norm_eps", 1e-6)
            self.embed = w["model.embed_tokens.weight"]
            self.lm_head = w.get("lm_head.weight", self.embed)
            self.final_norm, self.final_norm_b = w["model.norm.weight"], None
            self.layers = _llama_layers(w, self.num_layers)
            inv_freq = 1.0 / (_rope_theta(cfg) ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
            angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
            angles = torch.cat([angles, angles], dim=-1)
            self.cos = angles.cos().to(self.device, dtype)
            self.sin = angles.sin().to(self.device, dtype)

        self._arange = torch.arange(max(max_len, max_rows), device=self.device)
        shape = (self.num_layers, max_rows, self.num_kv_heads, max_len, self.head_dim)
        self.k_cache = torch.zeros(shape, device=self.device, dtype=self.cache_dtype)
        self.v_cache = torch.zeros(shape, device=self.device, dtype=self.cache_dtype)
        self._native = None  # (the native op, per-layer weights, final norm, both bfloat16 forms) after `use_native`

    def native_unsupported(self) -> str | None:
        """Why this decoder cannot run the native forward (`plugin.native_draft`), or None if it can."""
        if self.gpt2:
            return "GPT-2-family drafts run eagerly"
        if self.device.type != "cpu" or self.dtype != torch.float32:
            return f"the native forward is for float32 on CPU, not {self.dtype} on {self.device.type}"
        if self.cache_dtype not in (torch.float32, torch.bfloat16):
            return f"the native forward keeps its cache in float32 or bfloat16, not {self.cache_dtype}"
        return None

    def use_native(self, bfloat16_gemm: str = "auto") -> float:
        """Run `forward` as one native call from now on; the seconds its build or load took. Raises
        ValueError where it does not apply, and whatever the build raises. bfloat16_gemm: whether products
        of many rows multiply in bfloat16 ("auto": where that is faster than float32 on this processor,
        `native_draft.bfloat16_gemm_pays`; "on"; "off")."""
        from plugin import native_draft
        from plugin.config import check_switch

        check_switch("bfloat16_gemm", bfloat16_gemm)
        reason = self.native_unsupported()
        if reason:
            raise ValueError(reason)
        seconds = native_draft.load()
        no_bias = torch.empty(0, device=self.device, dtype=self.dtype)
        weights = [t if t is not None else no_bias for layer in self.layers
                   for t in (layer["in_norm"], layer["post_norm"], layer["qkv"], layer["qkv_b"], layer["o"],
                             layer["up"], layer["down"])]
        products = [layer[name] for layer in self.layers for name in ("qkv", "o", "up", "down")] + [self.lm_head]
        # The native code reads the norms' weights as dense blocks (no-ops for a loaded checkpoint).
        narrow, wide = native_draft.bfloat16_products(products)
        if wide and (bfloat16_gemm == "off" or bfloat16_gemm == "auto" and not native_draft.bfloat16_gemm_pays(self.lm_head)):
            wide = []
        self._native = (native_draft.forward_op(), [w.contiguous() for w in weights], self.final_norm.contiguous(),
                        narrow, wide)
        return seconds

    @property
    def native(self) -> bool:
        return self._native is not None

    @property
    def native_narrow(self) -> bool:
        """Whether the native forward's narrow feeds multiply by bfloat16 copies of the weights (only where
        the weights are exactly bfloat16 values: `plugin.native_draft.bfloat16_products`)."""
        return self._native is not None and bool(self._native[3])

    @property
    def native_wide(self) -> bool:
        """Whether the native forward's products of many rows multiply in bfloat16 (`use_native`)."""
        return self._native is not None and bool(self._native[4])

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the decoder holds: weights, position tables, KV cache."""
        held = [t for t in vars(self).values() if isinstance(t, torch.Tensor)]
        return held + [t for layer in self.layers for t in layer.values() if t is not None]

    @property
    def cache_bytes(self) -> int:
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    def move_rows(self, src: list[int], dst: list[int]) -> None:
        """Copy cache rows src[i] -> dst[i] (the right side is gathered first, so swaps are safe)."""
        if src:
            self.k_cache[:, dst] = self.k_cache[:, src]
            self.v_cache[:, dst] = self.v_cache[:, src]

    def _norm(self, x, weight, bias=None):
        if self.gpt2:
            return F.layer_norm(x, weight.shape, weight, bias, self.eps)
        return F.rms_norm(x, weight.shape, weight, self.eps)

    def _mlp(self, h, layer):
        up = F.linear(h, layer["up"], layer.get("up_b"))
        if self.gpt2:
            return F.linear(F.gelu(up, approximate="tanh"), layer["down"], layer["down_b"])
        gate, up = up.chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, layer["down"])

    @staticmethod
    def _rotate(x, cos, sin):
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor):
        """Token embeddings [B, T, d] (plus learned positions for GPT-2), and the rotary tables at
        positions, [B, T, 1, head_dim] each (None for GPT-2)."""
        x = self.embed[tokens]
        if self.gpt2:
            return x + self.positions_embed[positions], None
        return x, (self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2))

    def _qkv(self, x: torch.Tensor, layer: dict, rope):
        """The layer's q [B, T, heads, hd], k and v [B, T, kv_heads, hd] from x [B, T, d]; q and k are
        rotated together: half the small ops a draft is bound by."""
        batch, width = x.shape[:2]
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        h = self._norm(x, layer["in_norm"], layer.get("in_norm_b"))
        qk, v = F.linear(h, layer["qkv"], layer["qkv_b"]).split([q_dim + kv_dim, kv_dim], dim=-1)
        qk = qk.view(batch, width, self.num_heads + self.num_kv_heads, self.head_dim)
        if rope is not None:
            qk = self._rotate(qk, *rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=2)
        return q, k, v.view(batch, width, self.num_kv_heads, self.head_dim)

    def _finish_layer(self, x: torch.Tensor, attn: torch.Tensor, layer: dict) -> torch.Tensor:
        """The output projection of attn [B, T, heads * hd] and the MLP, each added to the residual."""
        x = x + F.linear(attn, layer["o"], layer.get("o_b"))
        return x + self._mlp(self._norm(x, layer["post_norm"], layer.get("post_norm_b")), layer)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] (float32) from hidden states [B, d]."""
        return F.linear(self._norm(x, self.final_norm, self.final_norm_b), self.lm_head).float()

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start: torch.Tensor, last: torch.Tensor | None,
                rows: torch.Tensor | None = None) -> torch.Tensor | None:
        """Feed tokens [B, T] to cache rows 0..B-1 (or to the cache rows named by rows [B]) at positions
        start[i] + t; return the logits [B, V] after position last[i] of each row (None when last is
        None: a catch-up chunk whose logits nobody reads). Positions past a row's real tokens write
        scratch entries beyond its valid prefix, which later forwards overwrite before anything reads
        them. Rows 0..B-1 read the cache as a view; named rows gather theirs (a copy)."""
        batch, width = tokens.shape
        if self._native is not None:
            return self._native_forward(tokens, start, last, rows)
        positions = (start.unsqueeze(1) + self._arange[:width]).clamp_max(self.max_len - 1)  # [B, T]
        key_len = int(positions.max()) + 1
        # One row decoding one token attends to every cached position up to its own: no mask needed.
        mask = None if batch == width == 1 else (self._arange[:key_len].view(1, 1, -1) <= positions.unsqueeze(-1)).unsqueeze(1)
        cache_rows = slice(0, batch) if rows is None else rows
        rows = (self._arange[:batch] if rows is None else rows).unsqueeze(1)
        groups = self.num_heads // self.num_kv_heads

        x, rope = self._embed(tokens, positions)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(x, layer, rope)
            self.k_cache[i][rows, :, positions] = k.to(self.cache_dtype)
            self.v_cache[i][rows, :, positions] = v.to(self.cache_dtype)
            keys = self.k_cache[i, cache_rows, :, :key_len].to(self.dtype)
            values = self.v_cache[i, cache_rows, :, :key_len].to(self.dtype)
            if groups > 1:
                keys = keys.repeat_interleave(groups, dim=1)
                values = values.repeat_interleave(groups, dim=1)
            attn = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask)
            x = self._finish_layer(x, attn.transpose(1, 2).reshape(batch, width, -1), layer)
        if last is None:
            return None
        return self._logits(x[self._arange[:batch], last])

    def _native_forward(self, tokens, start, last, rows):
        """forward's contract, as one native call (`plugin/native_draft.cpp`)."""
        op, weights, final_norm, narrow, wide = self._native
        logits = op(tokens, start, last if last is not None else start[:0],
                    rows if rows is not None else self._arange[: tokens.shape[0]], weights, self.embed,
                    final_norm, self.lm_head, self.cos, self.sin, self.k_cache, self.v_cache,
                    self.num_heads, self.num_kv_heads, self.eps, narrow, wide)
        return logits if last is not None else None

    def decode_step(self, tokens: torch.Tensor, positions: torch.Tensor, key_len: int):
        """One token per cache row 0..B-1: tokens [B, 1] at positions [B], attending to the row's cached
        positions below its own among the first key_len (at least every position < max(positions)).
        Returns logits [B, V] and the token's keys and values [layers, B, kv_heads, head_dim], which the
        caller writes into the cache (`write_kv`). The same arithmetic as forward, with no host
        synchronisation and no writes to its inputs, so that torch.compile traces it into one graph:
        with key_len = max_len every shape is static (one CUDA graph per batch size); with key_len the
        batch's longest prefix, a CPU graph compiled for dynamic shapes reads no more than forward does."""
        batch = tokens.shape[0]
        at = positions.clamp_max(self.max_len - 1).view(batch, 1)
        before = (torch.arange(key_len, device=self.device) < at).view(batch, 1, 1, -1)  # cached, earlier
        groups = self.num_heads // self.num_kv_heads
        scale = self.head_dim ** -0.5

        x, rope = self._embed(tokens, at)
        new_keys, new_values = [], []
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(x, layer, rope)
            k, v = k[:, 0], v[:, 0]  # [B, kv_heads, hd]
            new_keys.append(k)
            new_values.append(v)
            q = q.reshape(batch, self.num_kv_heads, groups, self.head_dim)  # grouped-query heads share keys
            keys = self.k_cache[i, :batch, :, :key_len].to(self.dtype)
            values = self.v_cache[i, :batch, :, :key_len].to(self.dtype)
            cached = (q @ keys.transpose(-1, -2)) * scale  # [B, kv_heads, groups, key_len]
            cached = cached.masked_fill(~before, float("-inf"))
            own = (q @ k.unsqueeze(-1)) * scale  # [B, kv_heads, groups, 1]
            weights = torch.cat([cached, own], dim=-1).softmax(dim=-1)
            attn = weights[..., :-1] @ values + weights[..., -1:] * v.unsqueeze(2)  # [B, kv_heads, groups, hd]
            x = self._finish_layer(x, attn.reshape(batch, 1, -1), layer)
        return self._logits(x[:, 0]), torch.stack(new_keys), torch.stack(new_values)

    def write_kv(self, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store one token's keys and values [layers, B, kv_heads, head_dim] at positions [B] of rows 0..B-1."""
        rows = torch.arange(keys.shape[1], device=self.device)
        at = positions.clamp_max(self.max_len - 1)
        # Advanced indices separated by a slice put their dimension first: the target is [B, layers, ...].
        self.k_cache[:, rows, :, at] = keys.transpose(0, 1).to(self.cache_dtype)
        self.v_cache[:, rows, :, at] = values.transpose(0, 1).to(self.cache_dtype)
