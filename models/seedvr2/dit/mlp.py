"""Feed-forward layers (docs/SPEC.md §1.8). Names match the checkpoint keys."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ....optimization import fused


class SwiGLU(nn.Module):
    """3B: proj_out(silu(proj_in_gate x) * proj_in x), no biases."""

    def __init__(self, dim: int, hidden: int, device=None, dtype=None):
        super().__init__()
        self.proj_in_gate = nn.Linear(dim, hidden, bias=False, device=device, dtype=dtype)
        self.proj_out = nn.Linear(hidden, dim, bias=False, device=device, dtype=dtype)
        self.proj_in = nn.Linear(dim, hidden, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused.enabled(x):  # silu(a) * b in one pass
            return self.proj_out(fused.silu_mul(self.proj_in_gate(x), self.proj_in(x)))
        return self.proj_out(F.silu(self.proj_in_gate(x)) * self.proj_in(x))


class GeluMLP(nn.Module):
    """7B ("normal"): proj_out(gelu_tanh(proj_in x)), with biases."""

    def __init__(self, dim: int, hidden: int, device=None, dtype=None):
        super().__init__()
        self.proj_in = nn.Linear(dim, hidden, device=device, dtype=dtype)
        self.proj_out = nn.Linear(hidden, dim, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.proj_in
        if type(p) is nn.Linear and p.bias is not None and p.weight.dtype == x.dtype and fused.enabled(x, p.weight):
            return self.proj_out(fused.linear_gelu(x, p.weight, p.bias))  # GELU in the GEMM epilogue
        return self.proj_out(F.gelu(self.proj_in(x), approximate="tanh"))


def make_mlp(kind: str, dim: int, hidden: int, device=None, dtype=None) -> nn.Module:
    if kind == "swiglu":
        return SwiGLU(dim, hidden, device=device, dtype=dtype)
    if kind == "gelu":
        return GeluMLP(dim, hidden, device=device, dtype=dtype)
    raise ValueError(f"unknown mlp type {kind!r}")
