"""Feed-forward layers (SPEC §1.8). Names match the checkpoint keys."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """3B: proj_out(silu(proj_in_gate x) * proj_in x), no biases."""

    def __init__(self, dim: int, hidden: int, device=None, dtype=None):
        super().__init__()
        self.proj_in_gate = nn.Linear(dim, hidden, bias=False, device=device, dtype=dtype)
        self.proj_out = nn.Linear(hidden, dim, bias=False, device=device, dtype=dtype)
        self.proj_in = nn.Linear(dim, hidden, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj_out(F.silu(self.proj_in_gate(x)) * self.proj_in(x))


class GeluMLP(nn.Module):
    """7B ("normal"): proj_out(gelu_tanh(proj_in x)), with biases."""

    def __init__(self, dim: int, hidden: int, device=None, dtype=None):
        super().__init__()
        self.proj_in = nn.Linear(dim, hidden, device=device, dtype=dtype)
        self.proj_out = nn.Linear(hidden, dim, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj_out(F.gelu(self.proj_in(x), approximate="tanh"))


def make_mlp(kind: str, dim: int, hidden: int, device=None, dtype=None) -> nn.Module:
    if kind == "swiglu":
        return SwiGLU(dim, hidden, device=device, dtype=dtype)
    if kind == "gelu":
        return GeluMLP(dim, hidden, device=device, dtype=dtype)
    raise ValueError(f"unknown mlp type {kind!r}")
