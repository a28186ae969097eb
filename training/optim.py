"""Optimizers and LR schedules for LoRA training."""
from __future__ import annotations

import math

import torch

OPTIMIZERS = ("adamw", "adamw8bit", "prodigy")
SCHEDULERS = ("constant", "cosine", "linear")

# Prodigy settings that work for FLUX LoRAs (notes §7: README for diffusion + kohya/ai-toolkit reports):
# lr 1.0, betas (0.9, 0.99), wd 0.01 decoupled, bias correction, safeguard warm-up, d0 1e-5 (d stays tiny on
# FLUX from 1e-6), d_coef 1, no gradient clipping.
PRODIGY_DEFAULTS = dict(lr=1.0, betas=(0.9, 0.99), weight_decay=0.01, decouple=True, use_bias_correction=True,
                        safeguard_warmup=True, d0=1e-5, d_coef=1.0)


def build_optimizer(params, name: str, lr: float, weight_decay: float = 0.01, betas=(0.9, 0.999), eps=1e-8,
                    prodigy_d_coef: float = 1.0):
    params = [p for p in params if p.requires_grad]
    name = name.lower()
    if name == "adamw":
        fused = all(p.is_cuda for p in params)
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                 **({"fused": True} if fused else {}))
    if name == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise RuntimeError("optimizer adamw8bit needs bitsandbytes, which is not installed. "
                               "Fix: `pip install bitsandbytes` in ComfyUI's python, or choose adamw.")
        return bnb.optim.AdamW8bit(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if name == "prodigy":
        try:
            from prodigyopt import Prodigy
        except ImportError:
            raise RuntimeError("optimizer prodigy needs prodigyopt, which is not installed. "
                               "Fix: `pip install prodigyopt` in ComfyUI's python, or choose adamw.")
        kw = dict(PRODIGY_DEFAULTS)
        kw["d_coef"] = prodigy_d_coef
        if lr != 1.0:
            kw["lr"] = lr  # the node warns: Prodigy wants lr 1.0
        return Prodigy(params, **kw)
    raise ValueError(f"unknown optimizer {name!r}. Fix: use one of {', '.join(OPTIMIZERS)}.")


def build_scheduler(optimizer, name: str, total_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.0):
    name = name.lower()
    if name not in SCHEDULERS:
        raise ValueError(f"unknown LR schedule {name!r}. Fix: use one of {', '.join(SCHEDULERS)}.")
    total = max(1, int(total_steps))
    warm = max(0, int(warmup_steps))

    def factor(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        if name == "constant":
            return 1.0
        p = min(1.0, (step - warm) / max(1, total - warm))
        if name == "linear":
            return max(min_lr_ratio, 1.0 - p * (1.0 - min_lr_ratio))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
