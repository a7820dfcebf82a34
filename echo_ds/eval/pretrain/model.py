"""The pretrained decoder (random init from ``transformers``), its optimizer, LR schedule and loss."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from echo_ds.eval.pretrain.corpus import ByteTokenizer


def model_config(args):
    import transformers
    kw = dict(vocab_size=ByteTokenizer.vocab_size, hidden_size=args.hidden, intermediate_size=args.intermediate,
              num_hidden_layers=args.layers, num_attention_heads=args.heads,
              num_key_value_heads=args.kv_heads or args.heads, max_position_embeddings=args.seq_len,
              tie_word_embeddings=False)
    if args.arch == "qwen3":
        return transformers.Qwen3Config(head_dim=args.head_dim or args.hidden // args.heads, **kw)
    if args.arch == "llama":
        return transformers.LlamaConfig(**kw)
    raise SystemExit(f"--arch {args.arch!r}: qwen3 or llama")


def build_model(args, seed: int) -> torch.nn.Module:
    """A randomly initialised decoder (fp32, CPU): the same weights for the same ``seed``."""
    import transformers
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(model_config(args), attn_implementation="sdpa")
    return model.float()


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.95), eps=1e-5):
    """AdamW; weight decay on the matrices and embeddings only (not the norms)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    fused = next(model.parameters()).is_cuda
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=tuple(betas), eps=eps, fused=fused)


def lr_at(step: int, num_steps: int, peak: float, warmup: int, min_lr: float) -> float:
    """Linear warm-up over ``warmup`` steps to ``peak``, then cosine decay to ``min_lr`` at the last step."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, num_steps - 1 - warmup)
    return min_lr + 0.5 * (peak - min_lr) * (1.0 + math.cos(math.pi * min(1.0, progress)))


def loss_of(model, batch: torch.Tensor, amp_dtype) -> torch.Tensor:
    """Mean next-byte cross-entropy of ``batch`` [B, L + 1] (fp32)."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    device_type = inputs.device.type
    with torch.autocast(device_type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
        logits = model(input_ids=inputs, use_cache=False).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
