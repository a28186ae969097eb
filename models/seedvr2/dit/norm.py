"""RMSNorm as Apex ``FusedRMSNorm`` computes it (SPEC §1.4): statistics in fp32, eps 1e-5.

y = x / sqrt(mean(x^2) + eps) * w, evaluated in fp32 and returned in the input dtype (the fused kernel
keeps the input dtype; its fp32 statistics are why bf16 runs stay close to fp32 ones).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm with a learnable weight (qk-norm, output norm). The pre-norms have no weight and use
    :func:`rms_norm` directly, so they own no parameters (none exist in the checkpoint)."""

    def __init__(self, dim: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
