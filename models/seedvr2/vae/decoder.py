"""Decoder (official Decoder3D): conv_in, mid block, up blocks of layers_per_block + 1 ResNets, GN -> SiLU -> conv_out."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn

from .blocks import MidBlock3D, UpBlock3D
from .causal_conv import CausalConv3d, TemporalCache
from .config import VAEConfig
from .norm import norm_silu_conv


class Decoder3D(nn.Module):
    def __init__(self, cfg: VAEConfig):
        super().__init__()
        boc, g, eps = cfg.block_out_channels, cfg.norm_num_groups, cfg.norm_eps
        rev = list(reversed(boc))
        n = len(rev)
        self.conv_in = CausalConv3d(cfg.latent_channels, rev[0], 3, padding=1)
        self.mid_block = MidBlock3D(rev[0], g, eps, cfg.mid_attention)
        # The temporal upsamplers are the first `temporal_scale_num` ones (mirror of the encoder).
        self.up_blocks = nn.ModuleList([
            UpBlock3D(rev[i - 1] if i else rev[0], rev[i], cfg.layers_per_block + 1, g, eps,
                      upsample=i < n - 1, temporal_up=i < cfg.temporal_scale_num)
            for i in range(n)
        ])
        self.conv_norm_out = nn.GroupNorm(g, boc[0], eps=eps)
        self.conv_out = CausalConv3d(boc[0], cfg.out_channels, 3, padding=1)
        self.norm_max_bytes = math.inf

    def forward(self, z: torch.Tensor, cache: Optional[TemporalCache] = None) -> torch.Tensor:
        # conv_in may leave its bias to the first ResNet's kernels (``ResnetBlock3D.takes_input_bias``)
        fold = self.mid_block.takes_input_bias(z)
        x = self.conv_in(z, cache, bias=not fold)
        x = self.mid_block(x, cache, self.conv_in.bias if fold else None)
        x_bias = None
        for i, blk in enumerate(self.up_blocks):
            nxt = self.up_blocks[i + 1] if i + 1 < len(self.up_blocks) else None
            x, x_bias = blk(x, cache, x_bias, leave_bias=nxt is not None and nxt.takes_input_bias(x))
        return norm_silu_conv(x, self.conv_norm_out, self.conv_out, cache, self.norm_max_bytes)
