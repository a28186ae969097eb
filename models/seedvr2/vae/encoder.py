"""Encoder (official Encoder3D): conv_in, down blocks, mid block, GN -> SiLU -> conv_out to 2 x latent channels."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn

from .blocks import DownBlock3D, MidBlock3D
from .causal_conv import CausalConv3d, TemporalCache
from .config import VAEConfig
from .norm import norm_silu_conv


class Encoder3D(nn.Module):
    def __init__(self, cfg: VAEConfig):
        super().__init__()
        boc, g, eps = cfg.block_out_channels, cfg.norm_num_groups, cfg.norm_eps
        n = len(boc)
        self.conv_in = CausalConv3d(cfg.in_channels, boc[0], 3, padding=1)
        blocks = []
        for i in range(n):
            last = i == n - 1
            # The temporal downsamplers are the last `temporal_scale_num` ones (blocks n-1-k .. n-2).
            temporal = i >= n - cfg.temporal_scale_num - 1
            blocks.append(DownBlock3D(boc[i - 1] if i else boc[0], boc[i], cfg.layers_per_block, g, eps,
                                      downsample=not last, temporal_down=temporal))
        self.down_blocks = nn.ModuleList(blocks)
        self.mid_block = MidBlock3D(boc[-1], g, eps, cfg.mid_attention)
        self.conv_norm_out = nn.GroupNorm(g, boc[-1], eps=eps)
        self.conv_out = CausalConv3d(boc[-1], 2 * cfg.latent_channels, 3, padding=1)
        self.norm_max_bytes = math.inf

    def forward(self, x: torch.Tensor, cache: Optional[TemporalCache] = None) -> torch.Tensor:
        # conv_in may leave its bias to the first ResNet's kernels (``ResnetBlock3D.takes_input_bias``)
        fold = self.down_blocks[0].takes_input_bias(x)
        x = self.conv_in(x, cache, bias=not fold)
        x = self.down_blocks[0](x, cache, self.conv_in.bias if fold else None)
        for blk in self.down_blocks[1:]:
            x = blk(x, cache)
        x = self.mid_block(x, cache)
        return norm_silu_conv(x, self.conv_norm_out, self.conv_out, cache, self.norm_max_bytes)
