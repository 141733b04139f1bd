"""The draft model in plain PyTorch: a Llama-family decoder with a KV cache whose rows follow vLLM's
batch rows, so a batched forward reads the cache as a view, with no gather.

Supports Llama and Qwen2 checkpoints in Hugging Face format (safetensors); Qwen2's q/k/v biases and
grouped-query attention included. Vocabulary checks live in `plugin.config`.
"""

import json
from pathlib import Path

import torch
import torch.nn.functional as F

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"}


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


class DraftModel:
    """Batched incremental decoding over cache rows 0..B-1 (row i = vLLM batch row i)."""

    def __init__(self, model_dir: str | Path, max_rows: int, max_len: int, device="cpu", dtype=torch.float32):
        model_dir = Path(model_dir)
        cfg = read_config(model_dir)
        arch = (cfg.get("architectures") or ["?"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"draft model {model_dir}: architecture {arch} is not supported "
                             f"(supported: {sorted(SUPPORTED_ARCHITECTURES)})")
        self.vocab_size = cfg["vocab_size"]
        self.num_layers = cfg["num_hidden_layers"]
        self.num_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg.get("num_key_value_heads", self.num_heads)
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // self.num_heads
        self.eps = cfg.get("rms_norm_eps", 1e-6)
        self.max_rows, self.max_len = max_rows, max_len
        self.device, self.dtype = torch.device(device), dtype

        w = _load_weights(model_dir, self.device, dtype)
        self.embed = w["model.embed_tokens.weight"]
        self.lm_head = w.get("lm_head.weight", self.embed)
        self.final_norm = w["model.norm.weight"]
        # q/k/v and gate/up are fused into one matmul each: a small draft is bound by per-op overhead.
        self.layers = []
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            biases = [w.get(p + f"self_attn.{n}_proj.bias") for n in "qkv"]
            self.layers.append({
                "in_norm": w[p + "input_layernorm.weight"],
                "post_norm": w[p + "post_attention_layernorm.weight"],
                "qkv": torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]),
                "qkv_b": torch.cat(biases) if biases[0] is not None else None,
                "o": w[p + "self_attn.o_proj.weight"],
                "gate_up": torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]),
                "down": w[p + "mlp.down_proj.weight"],
            })

        inv_freq = 1.0 / (_rope_theta(cfg) ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
        angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.cos = angles.cos().to(self.device, dtype)
        self.sin = angles.sin().to(self.device, dtype)

        shape = (self.num_layers, max_rows, self.num_kv_heads, max_len, self.head_dim)
        self.k_cache = torch.zeros(shape, device=self.device, dtype=dtype)
        self.v_cache = torch.zeros(shape, device=self.device, dtype=dtype)

    @property
    def cache_bytes(self) -> int:
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    def move_rows(self, src: list[int], dst: list[int]) -> None:
        """Copy cache rows src[i] -> dst[i] (the right side is gathered first, so swaps are safe)."""
        if src:
            self.k_cache[:, dst] = self.k_cache[:, src]
            self.v_cache[:, dst] = self.v_cache[:, src]

    def _rms_norm(self, x, weight):
        return F.rms_norm(x, weight.shape, weight, self.eps)

    @staticmethod
    def _rotate(x, cos, sin):
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start: torch.Tensor, last: torch.Tensor | None,
                rows: torch.Tensor | None = None) -> torch.Tensor | None:
        """Feed tokens [B, T] to cache rows 0..B-1 (or to the cache rows named by rows [B]) at positions
        start[i] + t; return the logits [B, V] after position last[i] of each row (None when last is
        None: a catch-up chunk whose logits nobody reads). Positions past a row's real tokens write
        scratch entries beyond its valid prefix, which later forwards overwrite before anything reads
        them. Rows 0..B-1 read the cache as a view; named rows gather theirs (a copy)."""
        batch, width = tokens.shape
        positions = start.unsqueeze(1) + torch.arange(width, device=self.device)
        positions = positions.clamp_max(self.max_len - 1)
        key_len = int(positions.max()) + 1
        mask = (torch.arange(key_len, device=self.device).view(1, 1, -1) <= positions.unsqueeze(-1)).unsqueeze(1)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        cache_rows = slice(0, batch) if rows is None else rows
        rows = (torch.arange(batch, device=self.device) if rows is None else rows).unsqueeze(1)
        groups = self.num_heads // self.num_kv_heads
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim

        x = self.embed[tokens]
        for i, layer in enumerate(self.layers):
            h = self._rms_norm(x, layer["in_norm"])
            q, k, v = F.linear(h, layer["qkv"], layer["qkv_b"]).split([q_dim, kv_dim, kv_dim], dim=-1)
            q = q.view(batch, width, self.num_heads, self.head_dim).transpose(1, 2)
            k = k.view(batch, width, self.num_kv_heads, self.head_dim).transpose(1, 2)
            v = v.view(batch, width, self.num_kv_heads, self.head_dim)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            self.k_cache[i][rows, :, positions] = k.transpose(1, 2)
            self.v_cache[i][rows, :, positions] = v
            keys = self.k_cache[i, cache_rows, :, :key_len]
            values = self.v_cache[i, cache_rows, :, :key_len]
            if groups > 1:
                keys = keys.repeat_interleave(groups, dim=1)
                values = values.repeat_interleave(groups, dim=1)
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
            x = x + F.linear(attn.transpose(1, 2).reshape(batch, width, -1), layer["o"])
            h = self._rms_norm(x, layer["post_norm"])
            gate, up = F.linear(h, layer["gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer["down"])
        if last is None:
            return None
        x = x[torch.arange(batch, device=self.device), last]
        return F.linear(self._rms_norm(x, self.final_norm), self.lm_head).float()
