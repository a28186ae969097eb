"""Exponential moving average of the LoRA weights, kept in fp32 beside the trained (raw) weights.

After every optimizer step ``shadow = decay * shadow + (1 - decay) * weight``, starting from the weights the run
starts with; the average is saved as its own file beside the LoRA (``<name>_ema.safetensors``) and travels in the
resume state, so a resumed run's average equals the uninterrupted run's.
"""
from __future__ import annotations

import torch


class LoraEMA:
    def __init__(self, named_params, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ema_decay must be between 0 and 1 (got {decay}). Fix: use e.g. 0.999, or 0 to "
                             "turn the EMA off.")
        self.decay = float(decay)
        self.params = {n: p for n, p in named_params if p.requires_grad}
        # fp32 whatever the master weights are: an average over thousands of steps loses its small updates in bf16
        self.shadow = {n: p.detach().float().clone() for n, p in self.params.items()}

    @torch.no_grad()
    def update(self) -> None:
        names = list(self.params)
        shadow = [self.shadow[n] for n in names]
        torch._foreach_mul_(shadow, self.decay)
        torch._foreach_add_(shadow, [self.params[n].detach().float() for n in names], alpha=1.0 - self.decay)

    def weights(self) -> dict:
        """Parameter name (as in the network's ``state_dict``) -> the averaged weight (fp32, on the LoRA's device)."""
        return dict(self.shadow)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "shadow": {n: t.detach().cpu().clone() for n, t in self.shadow.items()}}

    def load_state_dict(self, st: dict) -> None:
        missing = sorted(set(self.shadow) - set(st["shadow"]))
        if missing:
            raise ValueError(f"the resume state's EMA lacks {len(missing)} LoRA weights (e.g. {missing[0]}). Fix: "
                             "resume with the LoRA settings it was trained with, or start fresh under another "
                             "output name.")
        for n, t in self.shadow.items():
            t.copy_(st["shadow"][n])
