"""RMSNorm as Apex ``FusedRMSNorm`` computes it (docs/SPEC.md §1.4): statistics in fp32, eps 1e-5.

y = x / sqrt(mean(x^2) + eps) * w. fp32 input: exactly that formula (golden parity). fp16/bf16 input:
the statistic is accumulated in fp32 straight from the half tensor (``vector_norm(..., dtype=fp32)``,
no fp32 copy of x is materialised) and the product is evaluated in fp32 and stored in the input dtype,
as the fused kernel does. This path is memory-bound; avoiding fp32 temporaries is what makes it cheap.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    if x.dtype in (torch.float32, torch.float64):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return y * weight.to(x.dtype) if weight is not None else y
    ss = torch.linalg.vector_norm(x, 2, dim=-1, keepdim=True, dtype=torch.float32)
    r = torch.rsqrt(ss.square_().div_(x.shape[-1]).add_(eps))
    y = torch.mul(x, r, out=torch.empty(x.shape, dtype=x.dtype, device=x.device))  # fp32 math, one store
    if weight is not None:
        y.mul_(weight)
    return y


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
