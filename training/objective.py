"""FLUX rectified-flow objective (kohya / ai-toolkit ``raw`` prediction).

x_t = (1 - t) x0 + t noise, target v = noise - x0, the model gets t (sigma) as its timestep.
Timestep sampling follows kohya's ``get_noisy_model_input_and_timesteps``.
"""
from __future__ import annotations

import math

import torch

TIMESTEP_SAMPLINGS = ("sigmoid", "shift", "flux_shift", "uniform")


def flux_mu(image_seq_len: int, x1=256, y1=0.5, x2=4096, y2=1.15) -> float:
    """FLUX's timestep shift mu for ``image_seq_len`` tokens: linear through (x1, y1) and (x2, y2)."""
    m = (y2 - y1) / (x2 - x1)
    return image_seq_len * m + (y1 - m * x1)


def sample_sigmas(batch: int, mode: str, generator: torch.Generator, *, sigmoid_scale: float = 1.0,
                  shift: float = 3.1582, image_seq_len: int = 4096) -> torch.Tensor:
    """Float32 sigmas in (0, 1) on the CPU, drawn from ``generator``."""
    if mode not in TIMESTEP_SAMPLINGS:
        raise ValueError(f"unknown timestep sampling {mode!r}. Fix: use one of {', '.join(TIMESTEP_SAMPLINGS)}.")
    if mode == "uniform":
        return torch.rand(batch, generator=generator, dtype=torch.float32)
    t = torch.sigmoid(sigmoid_scale * torch.randn(batch, generator=generator, dtype=torch.float32))
    if mode == "shift":
        t = (t * shift) / (1 + (shift - 1) * t)
    elif mode == "flux_shift":
        mu = flux_mu(image_seq_len)
        t = math.exp(mu) / (math.exp(mu) + (1 / t - 1))
    return t


def noisy_input(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor):
    s = sigma.view(-1, *([1] * (x0.ndim - 1))).to(x0)
    x_t = (1 - s) * x0 + s * noise
    return x_t, noise - x0


def flow_loss(pred: torch.Tensor, target: torch.Tensor, loss_type: str = "l2") -> torch.Tensor:
    pred = pred.float()
    target = target.float()
    if loss_type == "l2":
        return torch.nn.functional.mse_loss(pred, target)
    if loss_type == "l1":
        return torch.nn.functional.l1_loss(pred, target)
    if loss_type == "huber":
        return torch.nn.functional.huber_loss(pred, target, delta=1.0)
    raise ValueError(f"unknown loss {loss_type!r}. Fix: use l2, l1 or huber.")
