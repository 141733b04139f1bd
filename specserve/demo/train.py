"""`specserve train-demo`: tokenizer, target and distilled draft, from the stdlib, on CPU.

Three stages, each reproducible from fixed seeds:
1. a byte-level BPE tokenizer on the training files;
2. the target, a ~23 M-parameter Llama, trained on next-token prediction;
3. the draft, a ~1 M-parameter Llama with the same tokenizer, distilled from the target: its loss is
   the cross-entropy against the target's full next-token distribution (soft labels), which is what
   raises the acceptance rate alpha = sum(min(p, q)).
`distil_draft` (`specserve train-demo --draft-only`) runs stage 3 alone against the target already saved.
"""

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from plugin.speculation_math import acceptance_rate
from specserve.demo.corpus import EOT, read_source, split_files

SEQ_LEN = 512
BATCH = 8
# The demo models complete code; a chat turn is the concatenated message texts, so chat routes work.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}\n{% endfor %}"


@dataclass
class Shape:
    hidden: int
    layers: int
    heads: int
    intermediate: int


TARGET_SHAPE = Shape(hidden=512, layers=8, heads=8, intermediate=1024)
DRAFT_SHAPE = Shape(hidden=128, layers=2, heads=2, intermediate=320)
TARGET_STEPS = 750
# 600 steps (2.5 M tokens) left the draft short of what its size can learn: 2,400 (9.8 M tokens, about
# three passes over the training files, soft labels each time) raised held-out alpha from 0.814 to 0.882
# and the greedy match from 0.728 to 0.809 (models/README.md).
DRAFT_STEPS = 2400


def log(msg: str) -> None:
    print(f"[train-demo {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOT,
        eos_token=EOT,
        unk_token=EOT,
        pad_token=EOT,
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def encode_files(tokenizer, files: list[str]) -> torch.Tensor:
    """All files as one token stream, an end-of-text token after each."""
    eot = tokenizer.convert_tokens_to_ids(EOT)
    ids: list[int] = []
    for enc in tokenizer([read_source(f) for f in files], add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.int32)


def llama(shape: Shape, vocab_size: int, eot_id: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=eot_id,
    )
    return LlamaForCausalLM(config)


def num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def random_batch(stream: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - SEQ_LEN - 1, (BATCH,), generator=gen)
    return torch.stack([stream[s : s + SEQ_LEN + 1] for s in starts.tolist()]).long()


def lr_at(step: int, total: int, peak: float, warmup: int = 50) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _logits(model, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(input_ids=x).logits.float()


def train_loop(model, stream, steps, peak_lr, seed, name, loss_fn):
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    t0 = time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, peak_lr)
        batch = random_batch(stream, gen)
        loss = loss_fn(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 20 == 0 or step == steps - 1:
            done = step + 1
            elapsed = time.time() - t0
            tok_s = done * BATCH * SEQ_LEN / elapsed
            eta = elapsed / done * (steps - done)
            log(f"{name} step {done}/{steps} loss {loss.item():.3f} {tok_s:,.0f} tok/s eta {eta / 60:.1f} min")
    model.eval()
    return time.time() - t0


def next_token_loss(model, batch):
    logits = _logits(model, batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))


def distillation_loss(target):
    def loss(draft, batch):
        x = batch[:, :-1]
        with torch.no_grad():
            p = torch.softmax(_logits(target, x), dim=-1)
        log_q = torch.log_softmax(_logits(draft, x), dim=-1)
        return -(p * log_q).sum(-1).mean()

    return loss


@torch.no_grad()
def evaluate_pair(target, draft, stream: torch.Tensor, max_tokens: int = 32768) -> dict:
    """Held-out loss of both models, alpha = mean sum(min(p, q)) and greedy match, temperature 1."""
    n = min(len(stream) - 1, max_tokens) // SEQ_LEN * SEQ_LEN
    x = stream[:n].long().view(-1, SEQ_LEN)
    y = stream[1 : n + 1].long().view(-1, SEQ_LEN)
    totals = dict(target_loss=0.0, draft_loss=0.0, alpha=0.0, greedy_match=0.0)
    for i in range(0, len(x), 8):
        xb, yb = x[i : i + 8], y[i : i + 8]
        lp, lq = _logits(target, xb), _logits(draft, xb)
        totals["target_loss"] += F.cross_entropy(lp.flatten(0, 1), yb.flatten(), reduction="sum").item()
        totals["draft_loss"] += F.cross_entropy(lq.flatten(0, 1), yb.flatten(), reduction="sum").item()
        p, q = torch.softmax(lp, -1), torch.softmax(lq, -1)
        totals["alpha"] += acceptance_rate(p, q).sum().item()
        totals["greedy_match"] += (lp.argmax(-1) == lq.argmax(-1)).float().sum().item()
    return {k: v / n for k, v in totals.items()} | {"eval_tokens": n}


def save_bf16(model, tokenizer, out_dir: Path) -> None:
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    model.float()


def distil(draft, target, tokenizer, train_stream, steps: int, seed: int, out_dir: Path) -> float:
    """Stage 3: distil draft from target (bfloat16, the weights that ship), save it to out_dir/draft and
    leave it in bfloat16, as it ships, for the evaluation; the training's seconds."""
    seconds = train_loop(draft, train_stream, steps, 3e-3, seed + 2, "draft", distillation_loss(target))
    save_bf16(draft, tokenizer, out_dir / "draft")
    draft.to(torch.bfloat16)
    return seconds


def train_demo(
    out_dir: Path,
    vocab_size: int = 4096,
    target_steps: int = TARGET_STEPS,
    draft_steps: int = DRAFT_STEPS,
    seed: int = 0,
) -> dict:
    torch.manual_seed(seed)
    out_dir = Path(out_dir)
    train_files, held_out_files = split_files()
    log(f"{len(train_files)} training files, {len(held_out_files)} held-out files")

    t0 = time.time()
    tokenizer = train_tokenizer([read_source(f) for f in train_files], vocab_size, out_dir / "target")
    train_stream = encode_files(tokenizer, train_files)
    held_out_stream = encode_files(tokenizer, held_out_files)
    eot = tokenizer.convert_tokens_to_ids(EOT)
    tokenizer_s = time.time() - t0
    log(f"tokenizer: {len(tokenizer)} tokens; {len(train_stream):,} training tokens, "
        f"{len(held_out_stream):,} held-out tokens ({tokenizer_s:.0f} s)")

    target = llama(TARGET_SHAPE, len(tokenizer), eot)
    draft = llama(DRAFT_SHAPE, len(tokenizer), eot)
    log(f"target {num_params(target) / 1e6:.2f} M params, draft {num_params(draft) / 1e6:.3f} M params")

    target_s = train_loop(target, train_stream, target_steps, 1e-3, seed + 1, "target", next_token_loss)
    save_bf16(target, tokenizer, out_dir / "target")
    target.to(torch.bfloat16)  # distil from exactly the weights that ship

    draft_s = distil(draft, target, tokenizer, train_stream, draft_steps, seed, out_dir)
    stats = evaluate_pair(target, draft, held_out_stream)
    stats |= {
        "vocab_size": len(tokenizer),
        "train_files": len(train_files),
        "held_out_files": len(held_out_files),
        "train_tokens": len(train_stream),
        "held_out_tokens": len(held_out_stream),
        "target_params": num_params(target),
        "draft_params": num_params(draft),
        "target_steps": target_steps,
        "draft_steps": draft_steps,
        "tokens_per_step": BATCH * SEQ_LEN,
        "tokenizer_seconds": round(tokenizer_s, 1),
        "target_seconds": round(target_s, 1),
        "draft_seconds": round(draft_s, 1),
        "seed": seed,
    }
    (out_dir / "training_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    log(f"done: {json.dumps(stats)}")
    return stats


def distil_draft(out_dir: Path, draft_steps: int = DRAFT_STEPS, seed: int = 0) -> dict:
    """Stage 3 alone: distil a new draft from the target already in out_dir/target (the shipped bfloat16
    weights, which are what `train_demo` distils from), with the same split, tokenizer and seeds; the
    target's figures in training_stats.json are kept."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    out_dir = Path(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(out_dir / "target")
    train_files, held_out_files = split_files()
    train_stream = encode_files(tokenizer, train_files)
    held_out_stream = encode_files(tokenizer, held_out_files)
    target = AutoModelForCausalLM.from_pretrained(out_dir / "target", dtype=torch.bfloat16).eval()
    draft = llama(DRAFT_SHAPE, len(tokenizer), tokenizer.convert_tokens_to_ids(EOT))
    log(f"distilling a {num_params(draft) / 1e6:.3f} M-parameter draft for {draft_steps} steps")
    draft_s = distil(draft, target, tokenizer, train_stream, draft_steps, seed, out_dir)
    stats_file = out_dir / "training_stats.json"
    stats = json.loads(stats_file.read_text()) if stats_file.exists() else {}
    stats |= evaluate_pair(target, draft, held_out_stream)
    stats |= {"draft_params": num_params(draft), "draft_steps": draft_steps, "draft_seconds": round(draft_s, 1)}
    stats_file.write_text(json.dumps(stats, indent=2) + "\n")
    log(f"done: {json.dumps(stats)}")
    return stats
