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

    def forward(self, x: torch.Tensor, cache: Optional[TemporalCache] = None,
                x_bias: Optional[torch.Tensor] = None, then: Optional[CausalConv3d] = None) -> torch.Tensor:
        """``x_bias``: x lacks the bias of the conv that made it (``takes_input_bias``), added where x is read.
        ``then``: a conv that reads the block's output (a down block's downsampler): the sum is written straight
        into its input (``CausalConv3d.input_buffer``, allocated once this block's convs have run, so it does not
        add to their peak) and that conv's output is returned."""
        fold = fold_biases(x, *self._convs())
        if x_bias is not None and not fold:
            x, x_bias = x + fused.per_channel(x_bias, x.ndim), None
        # folded: conv1's bias goes into norm2's kernels, conv2's into the residual add, the shortcut's (or x's own)
        # too: a pass over the block's activations fewer each (cuDNN on NDHWC adds a bias in a pass of its own)
        h = norm_silu_conv(x, self.norm1, self.conv1, cache, self.norm_max_bytes, in_bias=x_bias, conv_bias=not fold)
        h = norm_silu_conv(h, self.norm2, self.conv2, cache, self.norm_max_bytes,
                           in_bias=self.conv1.bias if fold else None, conv_bias=not fold)
        if self.conv_shortcut is not None:
            s_bias = self._shortcut_bias(x_bias) if fold else None
            if fold and then is None:       # the shortcut's GEMM adds the residual, where that kernel runs
                y = fused.shortcut_residual(h, x, self.conv_shortcut.weight, s_bias, self.conv2.bias)
                if y is not None:
                    return y
            x, x_bias = self.conv_shortcut(x, cache, bias=not fold), s_bias
        buf, out = then.input_buffer(h, h.shape, cache) if then is not None else (None, None)
        if fold:
            y = fused.residual_bias(h, x, self.conv2.bias, x_bias, out=out)
        else:
            y = h.add_(x) if out is None else torch.add(h, x, out=out)
        return y if then is None else then.run_buffer(buf, cache)

    def takes_input_bias(self, x: torch.Tensor) -> bool:
        """Whether x may come without its conv's bias (``forward``'s ``x_bias``): where the biases fold. norm1 adds it
        as it reads x; a 1 x 1 shortcut is linear, so what the bias gives through it joins the shortcut's own bias
        in the residual add."""
        return fold_biases(x, *self._convs())

    def _convs(self) -> tuple:
        return (self.conv1, self.conv2) + ((self.conv_shortcut,) if self.conv_shortcut is not None else ())

    def _shortcut_bias(self, x_bias: Optional[torch.Tensor]) -> torch.Tensor:
        """The bias the shortcut's output lacks when neither it nor its input x has its bias: the shortcut's own,
        plus its weight times x's missing ``x_bias`` (float32)."""
        b = self.conv_shortcut.bias
        if x_bias is None:
            return b
        w = self.conv_shortcut.weight
        return b.float() + w.reshape(w.shape[0], -1).float() @ x_bias.float()
