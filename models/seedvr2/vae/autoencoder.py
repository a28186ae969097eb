"""SeedVR2 video VAE ("video_vae_v3", official `VideoAutoencoderKLWrapper`), inference only.

API used by the pipeline:
  vae.encode(x)  x (B, 3, T, H, W) in [-1, 1], T = 4n + 1  ->  LatentDistribution (mean, logvar), each
                 (B, 16, (T-1)/4 + 1, H/8, W/8); `mean, logvar = vae.encode(x)` also works.
  vae.decode(z)  z (B, 16, t, h, w)  ->  (B, 3, 4(t-1) + 1, 8h, 8w). A 4-D z (B, 16, h, w) gives a 4-D image.
  vae.encode_tiled / vae.decode_tiled: spatial tiles with linear blending (tiling.py, the pack's one VAE tiler).
  vae.scaling_factor (0.9152): the pipeline multiplies latents by it after encode and divides before decode.
Every entry point takes `should_stop`, a callable checked between temporal chunks and tiles; when it returns
True, `VAECancelled` is raised.
"""
from __future__ import annotations

import math
from typing import Iterator, Optional, Tuple

import torch
import torch.nn as nn

from ....optimization.runtime.policy import get_policy
from . import tiling
from .causal_conv import GIB, CausalConv3d, TemporalCache
from .config import SEEDVR2_VAE, VAEConfig
from .decoder import Decoder3D
from .encoder import Encoder3D
from .posterior import LatentDistribution, check_stop
from .resnet import ResnetBlock3D


def temporal_chunks(length: int, first: int, step: Optional[int]) -> list:
    """[(start, end)] of the official causal slicing: `first` items (the first frame + split), then `step` at a time.
    The official only slices when length - 1 > step (else one pass)."""
    if not step or length - 1 <= step:
        return [(0, length)]
    out = [(0, first)]
    for a in range(first, length, step):
        out.append((a, min(a + step, length)))
    return out


class VideoAutoencoder(nn.Module):
    def __init__(self, config: VAEConfig = SEEDVR2_VAE):
        super().__init__()
        self.config = config
        self.encoder = Encoder3D(config)
        self.decoder = Decoder3D(config)
        self.split_size = config.split_size
        self.channels_last: Optional[bool] = None    # None: the hardware policy's vae_channels_last
        self.set_memory_limit(config.conv_max_mem, config.norm_max_mem)

    # ---------------------------------------------------------------- properties and settings
    @property
    def scaling_factor(self) -> float:
        return self.config.scaling_factor

    @property
    def spatial_factor(self) -> int:
        return self.config.spatial_factor

    @property
    def temporal_factor(self) -> int:
        return self.config.temporal_factor

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder.conv_in.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.encoder.conv_in.weight.device

    def set_memory_limit(self, conv_max_mem: Optional[float], norm_max_mem: Optional[float]) -> None:
        """Official `set_memory_limit` (GiB; None = no limit). Exact either way; it bounds transient memory."""
        conv_b = math.inf if conv_max_mem is None else conv_max_mem * GIB
        norm_b = math.inf if norm_max_mem is None else norm_max_mem * GIB
        for m in self.modules():
            if isinstance(m, CausalConv3d):
                m.max_bytes = conv_b
            if isinstance(m, (ResnetBlock3D, Encoder3D, Decoder3D)):
                m.norm_max_bytes = norm_b

    def conv_bytes(self) -> float:
        """The convs' band limit in bytes (``set_memory_limit``; inf: whole convs), in the memory model's terms
        (``tiling.estimate_*_bytes``' ``conv_bytes``)."""
        return self.decoder.conv_in.max_bytes

    def set_causal_slicing(self, split_size: Optional[int]) -> None:
        """Official `set_causal_slicing`: frames per temporal chunk (4 in the pipeline), None = one pass."""
        if split_size is not None and split_size % self.temporal_factor:
            raise ValueError(f"split_size must be a multiple of {self.temporal_factor}, got {split_size}")
        self.split_size = split_size

    def layout(self) -> torch.memory_format:
        """How activations are stored inside encode/decode: channels-last 3-D (NDHWC: cuDNN's convolutions read and
        write it without transposing) when ``channels_last`` says so, or when it is None, as the hardware policy of
        the VAE's device says (``vae_channels_last``); NCDHW otherwise. Inputs and outputs are NCDHW either way."""
        return self.layout_on(self.device)

    def layout_on(self, device) -> torch.memory_format:
        """``layout()`` once the weights are on ``device`` (a memory plan is made while they are elsewhere)."""
        device = torch.device(device)
        on = self.channels_last
        if on is None:
            on = device.type == "cuda" and get_policy(device).vae_channels_last
        return torch.channels_last_3d if on else torch.contiguous_format

    def _model_input(self, x: torch.Tensor, layout: torch.memory_format) -> torch.Tensor:
        return x.to(self.device, self.dtype).contiguous(memory_format=layout)

    @torch.no_grad()
    def store_weights(self, layout: torch.memory_format) -> None:
        """Conv weights stored in the activations' layout (``layout()``): torch otherwise hands every convolution a
        converted copy of its weight, a copy per conv per call, and a weight in the other layout would change the
        layout of the conv's output. Weights already stored so are left alone."""
        for m in self.modules():
            if isinstance(m, nn.Conv3d) and not m.weight.is_contiguous(memory_format=layout):
                m.weight.data = m.weight.data.contiguous(memory_format=layout)

    # ---------------------------------------------------------------- chunked cores
    def _frames_check(self, t: int) -> None:
        if (t - 1) % self.temporal_factor:
            raise ValueError(f"the VAE needs T = {self.temporal_factor}n + 1 frames, got T = {t}")

    def iter_encode(self, x: torch.Tensor, should_stop=None) -> Iterator[Tuple[int, torch.Tensor]]:
        """Yield (latent frame index, moments chunk (B, 2*latent, t, h, w)) per official temporal chunk.
        x may live on another device (e.g. CPU): each chunk is moved to the model when it is processed."""
        self._frames_check(x.shape[2])
        split = self.split_size
        chunks = temporal_chunks(x.shape[2], 1 + (split or 0), split)
        cache = TemporalCache(last_chunk=len(chunks) == 1)
        layout = self.layout()
        self.store_weights(layout)
        pos = 0
        for i, (a, b) in enumerate(chunks):
            check_stop(should_stop)
            h = self.encoder(self._model_input(x[:, :, a:b], layout), cache).contiguous()
            cache.next_chunk(last=i + 2 == len(chunks))
            yield pos, h
            pos += h.shape[2]

    def iter_decode(self, z: torch.Tensor, should_stop=None) -> Iterator[Tuple[int, torch.Tensor]]:
        """Yield (output frame index, frames chunk (B, 3, f, 8h, 8w)) per official temporal chunk (latent chunks
        of split_size // 4 frames, the first one with the first latent frame in addition)."""
        step = self.split_size // self.temporal_factor if self.split_size else None
        chunks = temporal_chunks(z.shape[2], 1 + (step or 0), step)
        cache = TemporalCache(last_chunk=len(chunks) == 1)
        layout = self.layout()
        self.store_weights(layout)
        pos = 0
        for i, (a, b) in enumerate(chunks):
            check_stop(should_stop)
            y = self.decoder(self._model_input(z[:, :, a:b], layout), cache).contiguous()
            cache.next_chunk(last=i + 2 == len(chunks))
            yield pos, y
            pos += y.shape[2]

    # ---------------------------------------------------------------- public API
    @torch.no_grad()
    def encode(self, x: torch.Tensor, should_stop=None) -> LatentDistribution:
        if x.ndim == 4:
            x = x.unsqueeze(2)
        chunks = [h for _, h in self.iter_encode(x, should_stop)]
        moments = chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=2)
        return LatentDistribution(moments)

    @torch.no_grad()
    def decode(self, z: torch.Tensor, should_stop=None, output_device=None, output_dtype=None) -> torch.Tensor:
        squeeze = z.ndim == 4
        if squeeze:
            z = z.unsqueeze(2)
        b, _, t, h, w = z.shape
        s = self.spatial_factor
        out = None
        for pos, y in self.iter_decode(z, should_stop):
            if out is None:
                out = torch.empty((b, y.shape[1], self.temporal_factor * (t - 1) + 1, h * s, w * s),
                                  device=output_device or z.device, dtype=output_dtype or y.dtype)
            out[:, :, pos:pos + y.shape[2]].copy_(y)
            del y
        return out.squeeze(2) if squeeze else out

    def encode_tiled(self, x, tile=512, overlap=64, should_stop=None) -> LatentDistribution:
        return tiling.encode_tiled(self, x, tile, overlap, should_stop)

    def decode_tiled(self, z, tile=64, overlap=8, should_stop=None, output_device=None, output_dtype=None):
        return tiling.decode_tiled(self, z, tile, overlap, should_stop, output_device=output_device,
                                   output_dtype=output_dtype)
