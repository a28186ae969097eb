"""Down- and up-samplers (official `Downsample3D` / `Upsample3D`)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ....optimization import fused
from .causal_conv import CausalConv3d, TemporalCache
from .layout import layout_of
from .norm import fold_biases


class Downsample3D(nn.Module):
    """Stride-2 conv. Spatial-only: kernel (1,3,3), stride (1,2,2). Spatio-temporal: kernel (3,3,3), stride (2,2,2)
    with causal first-frame replication. The official pads one zero row/column at the bottom/right only
    (downsample_padding=0) and the conv adds no other spatial padding: the conv's input buffer carries it
    (``CausalConv3d.input_buffer``), which the down block's last ResNet writes into directly."""

    def __init__(self, channels: int, temporal_down: bool):
        super().__init__()
        kt = 3 if temporal_down else 1
        self.conv = CausalConv3d(
            channels, channels, (kt, 3, 3), stride=(2 if temporal_down else 1, 2, 2),
            padding=(1 if temporal_down else 0, 0, 0), spatial_pad=(0, 1, 0, 1),
        )

    def forward(self, x: torch.Tensor, cache: Optional[TemporalCache] = None) -> torch.Tensor:
        buf, body = self.conv.input_buffer(x, x.shape, cache)
        body.copy_(x)
        return self.conv.run_buffer(buf, cache)


class Upsample3D(nn.Module):
    """1x1x1 conv C -> C*r, depth-to-space, causal 3x3x3 conv.

    Expanded channel index ((sx*2 + sy)*rt + st)*C + c maps to output (frame*rt + st, row*2 + sx, col*2 + sy).
    With temporal upsampling the first latent frame yields a duplicate frame (index 1) that is dropped, so t frames
    become 2t - 1; in later temporal chunks there is no such frame and nothing is dropped.
    """

    def __init__(self, channels: int, temporal_up: bool, spatial_up: bool = True):
        super().__init__()
        self.temporal_ratio = 2 if temporal_up else 1
        self.spatial_ratio = 2 if spatial_up else 1
        r = self.temporal_ratio * self.spatial_ratio ** 2
        self.upscale_conv = nn.Conv3d(channels, channels * r, kernel_size=1)
        self.conv = CausalConv3d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor, cache: Optional[TemporalCache] = None, bias: bool = True) -> torch.Tensor:
        """``bias`` False: the output lacks the 3 x 3 x 3 conv's bias (the caller adds it where it reads the output)."""
        s, rt = self.spatial_ratio, self.temporal_ratio
        b, c, t, h, w = x.shape
        layout = layout_of(x)
        x = x.to(self.upscale_conv.weight.dtype)
        drop = rt > 1 and (cache is None or cache.first_chunk)
        # folded: the 1 x 1 conv's bias is added by the depth-to-space (cuDNN on NDHWC adds it in one more pass)
        fold = fold_biases(x, self.upscale_conv)
        if layout == torch.channels_last_3d:   # written straight into the conv's input (no extended copy)
            buf, body = self.conv.input_buffer(x, (b, c, t * rt - (1 if drop else 0), h * s, w * s), cache)
            head, keep = self.conv.edges(body, cache)
            fused.conv1x1_depth_to_space(x, self.upscale_conv.weight, self.upscale_conv.bias, body, s, rt, drop, head,
                                         keep, late_bias=fold)
            return self.conv.run_buffer(buf, cache, bias=bias, written=(head, keep))
        y = self.upscale_conv(x)
        y = (y.view(b, s, s, rt, c, t, h, w)
              .permute(0, 4, 5, 3, 6, 1, 7, 2)          # b, c, t, st, h, sx, w, sy
              .reshape(b, c, t * rt, h * s, w * s))
        if drop:
            y = torch.cat([y[:, :, :1], y[:, :, 2:]], dim=2)
        return self.conv(y, cache, bias=bias)
