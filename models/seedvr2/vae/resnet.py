"""ResNet block (official `ResnetBlock3D`, time_receptive_field "full").

GN -> SiLU -> conv1 3x3x3 -> GN -> SiLU -> dropout(0) -> conv2 3x3x3, plus the input (through a 1x1x1
`conv_shortcut` when the width changes). Output scale 1.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn

from ....optimization import fused
from .causal_conv import CausalConv3d, TemporalCache
from .norm import fold_biases, norm_silu_conv


class ResnetBlock3D(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, groups: int, eps: float):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, in_channels, eps=eps)
        self.conv1 = CausalConv3d(in_channels, out_channels, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, out_channels, eps=eps)
        self.conv2 = CausalConv3d(out_channels, out_channels, 3, padding=1)
        self.conv_shortcut = CausalConv3d(in_channels, out_channels, 1) if in_channels != out_channels else None
        self.norm_max_bytes = math.inf

    def forward(self, x: torch.Tensor, cache: Optional[TemporalCache] = None) -> torch.Tensor:
        if fold_biases(x, self.conv1, self.conv2):
            # conv1's bias goes into norm2's kernels, conv2's into the residual add: two passes over the block's
            # activations fewer (cuDNN on NDHWC adds a bias in a pass of its own)
            h = norm_silu_conv(x, self.norm1, self.conv1, cache, self.norm_max_bytes, conv_bias=False)
            h = norm_silu_conv(h, self.norm2, self.conv2, cache, self.norm_max_bytes, in_bias=self.conv1.bias,
                               conv_bias=False)
            if self.conv_shortcut is not None:
                x = self.conv_shortcut(x, cache)
            return fused.residual_bias(h, x, self.conv2.bias)
        h = norm_silu_conv(x, self.norm1, self.conv1, cache, self.norm_max_bytes)
        h = norm_silu_conv(h, self.norm2, self.conv2, cache, self.norm_max_bytes)
        if self.conv_shortcut is not None:
            x = self.conv_shortcut(x, cache)
        return h.add_(x)
