"""The VAE's activation layout (NCDHW, or NDHWC stored channels-last 3-D): read from a tensor, and given to every
tensor made from it, so a path never falls back to NCDHW midway. Below the convs, norms and the row split."""
from __future__ import annotations

import torch


def layout_of(x: torch.Tensor) -> torch.memory_format:
    """channels_last_3d for an activation stored NDHWC (the VAE's channels-last path), else contiguous_format:
    the layout every tensor the VAE makes from ``x`` is given, so the path never falls back to NCDHW midway."""
    if x.ndim == 5 and x.stride(1) == 1 and not x.is_contiguous():     # channels innermost (a band's view too)
        return torch.channels_last_3d
    return torch.contiguous_format


def empty_like_layout(x: torch.Tensor, shape) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=x.dtype, device=x.device, memory_format=layout_of(x))
