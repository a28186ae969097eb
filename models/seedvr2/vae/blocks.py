"""Down, up and mid blocks (official DownEncoderBlock3D, UpDecoderBlock3D, UNetMidBlock3D)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn

from .attention import FrameAttention
from .causal_conv import TemporalCache
from .norm import fold_biases
from .resnet import ResnetBlock3D
from .sampling import Downsample3D, Upsample3D


class _Block(nn.Module):
    def takes_input_bias(self, x: torch.Tensor) -> bool:
        """Whether the block's input may come without the bias of the conv that made it (its first ResNet's)."""
        return self.resnets[0].takes_input_bias(x)


class DownBlock3D(_Block):
    def __init__(self, cin, cout, layers, groups, eps, downsample: bool, temporal_down: bool):
        super().__init__()
        self.resnets = nn.ModuleList(
            [ResnetBlock3D(cin if i == 0 else cout, cout, groups, eps) for i in range(layers)])
        self.downsamplers = nn.ModuleList([Downsample3D(cout, temporal_down)]) if downsample else None

    def forward(self, x: torch.Tensor, cache: Optional[TemporalCache] = None,
                x_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x_bias``: x lacks its conv's bias (``takes_input_bias``)."""
        last = len(self.resnets) - 1
        down = self.downsamplers[0].conv if self.downsamplers is not None else None
        for i, r in enumerate(self.resnets):
            # the last ResNet writes its sum straight into the downsampling conv's padded input
            x = r(x, cache, x_bias if i == 0 else None, then=down if i == last else None)
        return x


class UpBlock3D(_Block):
    def __init__(self, cin, cout, layers, groups, eps, upsample: bool, temporal_up: bool):
        super().__init__()
        self.resnets = nn.ModuleList(
            [ResnetBlock3D(cin if i == 0 else cout, cout, groups, eps) for i in range(layers)])
        self.upsamplers = nn.ModuleList([Upsample3D(cout, temporal_up)]) if upsample else None

    def forward(self, x: torch.Tensor, cache: Optional[TemporalCache] = None, x_bias: Optional[torch.Tensor] = None,
                leave_bias: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(output, the bias it lacks or None). ``x_bias``: x lacks its conv's bias (``takes_input_bias``).
        ``leave_bias``: the next block takes its input without the bias, so the upsampler's conv may leave its bias
        to that block's kernels (a pass over the upsampled activations fewer)."""
        for i, r in enumerate(self.resnets):
            x = r(x, cache, x_bias if i == 0 else None)
        if self.upsamplers is None:
            return x, None
        up = self.upsamplers[0]
        leave = leave_bias and fold_biases(x, up.conv)
        return up(x, cache, bias=not leave), up.conv.bias if leave else None


class MidBlock3D(_Block):
    """ResNet -> per-frame self-attention -> ResNet."""

    def __init__(self, channels, groups, eps, attention: bool = True):
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock3D(channels, channels, groups, eps) for _ in range(2)])
        self.attentions = nn.ModuleList([FrameAttention(channels, groups, eps)]) if attention else None

    def forward(self, x: torch.Tensor, cache: Optional[TemporalCache] = None,
                x_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x_bias``: x lacks its conv's bias (``takes_input_bias``)."""
        x = self.resnets[0](x, cache, x_bias)
        if self.attentions is not None:
            x = self.attentions[0](x)
        return self.resnets[1](x, cache)
