"""Mid-block self-attention (diffusers `Attention` as configured by the official UNetMidBlock3D).

One head of dim C, its own GroupNorm, q/k/v/out Linear layers with bias, a residual, softmax scale 1/sqrt(C).
It runs within each frame over the H*W positions (docs/SPEC.md §5). Key names: group_norm, to_q, to_k, to_v, to_out.0.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ....optimization.attention import wide_head
from . import row_parallel
from .norm import causal_group_norm


class FrameAttention(nn.Module):
    def __init__(self, channels: int, groups: int, eps: float):
        super().__init__()
        self.group_norm = nn.GroupNorm(groups, channels, eps=eps)
        self.to_q = nn.Linear(channels, channels)
        self.to_k = nn.Linear(channels, channels)
        self.to_v = nn.Linear(channels, channels)
        self.to_out = nn.ModuleList([nn.Linear(channels, channels)])  # index 1 (dropout) has no parameters

    def _frame(self, f: torch.Tensor) -> torch.Tensor:
        b, c, h, w = f.shape
        y = causal_group_norm(f, self.group_norm).view(b, c, h * w).transpose(1, 2)   # (B, N, C)
        q, k, v = (lin(y) for lin in (self.to_q, self.to_k, self.to_v))  # (B, N, C)
        shard = row_parallel.current()
        if shard is not None:            # a band of rows: its queries attend to every position of the frame
            k, v = shard.gather_rows(torch.cat([k, v], dim=-1), 1).chunk(2, dim=-1)     # one gather for both
        # The official sets upcast_softmax, which diffusers' SDPA processor does not use; the softmax is taken in
        # fp32 for 16-bit inputs anyway (one head of C: wide_head picks SDPA or two GEMMs)
        o = self.to_out[0](wide_head.attention(q, k, v))
        return o.transpose(1, 2).reshape(b, c, h, w) + f

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim == 4:
            return self._frame(x)
        out = torch.empty_like(x)
        for t in range(x.shape[2]):  # one frame at a time bounds the q/k/v working set to one frame
            out[:, :, t] = self._frame(x[:, :, t])
        return out
