"""GroupNorm applied per frame (official `causal_norm_wrapper`).

Statistics are taken over (channels of the group, H, W) for every time step on its own, never across time, so
chunked temporal processing stays exact. The official code rearranges (b c t h w) -> ((b t) c h w) and, when that
tensor exceeds norm_max_mem, normalises it in 2 (fp32) or 4 (16-bit) chunks of whole groups. Group chunks and frame
chunks are independent instances of the same per-(sample, group) reduction, so computing frames in batches (to
avoid the full rearranged copy) and groups in the official chunks gives the official numbers.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ....optimization import fused
from ....optimization.runtime import knobs
from . import row_parallel
from .causal_conv import CausalConv3d, TemporalCache


def _norm_frames(x4: torch.Tensor, norm: nn.GroupNorm, max_bytes: float) -> torch.Tensor:
    """GroupNorm of ((b t), c, h, w) frames, in the official group chunks when the tensor is over the limit."""
    if x4.numel() * x4.element_size() > max_bytes:
        chunks = min(4 if x4.element_size() == 2 else 2, norm.num_groups)
        if norm.num_groups % chunks == 0:
            g = norm.num_groups // chunks
            xs = x4.chunk(chunks, dim=1)
            ws, bs = norm.weight.chunk(chunks), norm.bias.chunk(chunks)
            return torch.cat([F.group_norm(a, g, w, b, norm.eps).to(x4.dtype) for a, w, b in zip(xs, ws, bs)], 1)
    return F.group_norm(x4, norm.num_groups, norm.weight, norm.bias, norm.eps).to(x4.dtype)


def causal_group_norm(x: torch.Tensor, norm: nn.GroupNorm, max_bytes: float = math.inf, silu: bool = False,
                      frame_batch_bytes: float = 256 * 1024 ** 2, out: Optional[torch.Tensor] = None,
                      in_bias: Optional[torch.Tensor] = None, head: int = 0,
                      keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-frame GroupNorm of x (B, C, T, H, W) (or (B, C, H, W)), optionally followed by SiLU (in place).

    The official limit is applied to the full ((b t) c h w) tensor, as there; the work is then done a few frames at
    a time (at most `frame_batch_bytes` of input) so no full-size rearranged copy is made. On a GPU with the fused
    kernels (bf16/fp16) one Triton kernel pair does it all on the 5-D layout: same math, fp32 statistics, no
    temporary larger than the output, so the limit has nothing left to bound. ``out`` (x's shape and dtype, any
    layout): the result is written there and returned. ``in_bias`` (C,): the norm of x + in_bias (the bias of
    the conv that made x, left out of it: ``fold_biases``). ``head``, ``keep`` (with ``out``, the body of a causal
    conv's input): its other copies there (``CausalConv3d.edges``, ``fused.fill_edges``).
    """
    shard = row_parallel.current()       # a band of rows: the frame's statistics come from every rank
    use_fused = fused.enabled(x) and norm.affine
    if use_fused and x.ndim == 5 and (shard is None or fused.channels_last(x)):
        return fused.group_norm_frames(x, norm, silu, out=out, combine=shard.gather_moments if shard else None,
                                       in_bias=in_bias, head=head, keep=keep)
    if out is not None and (head or keep is not None):
        return fused.fill_edges(causal_group_norm(x, norm, max_bytes, silu, frame_batch_bytes, out, in_bias), head,
                                keep)
    if in_bias is not None:
        x = x + fused.per_channel(in_bias, x.ndim)
    if shard is not None:
        return shard.group_norm(x, norm, silu, out=out)
    if use_fused:
        y = fused.group_norm_frames(x.unsqueeze(2), norm, silu).squeeze(2)
        return y if out is None else out.copy_(y)
    if x.ndim == 4:
        y = _norm_frames(x, norm, max_bytes)
        y = F.silu(y, inplace=True) if silu else y
        return y if out is None else out.copy_(y)
    b, c, t, h, w = x.shape
    over = x.numel() * x.element_size() > max_bytes
    limit = 0.0 if over else math.inf        # decide once for the whole tensor, like the official code
    out = torch.empty_like(x) if out is None else out
    frame_bytes = b * c * h * w * x.element_size()
    step = max(1, int(frame_batch_bytes // max(frame_bytes, 1)))
    for t0 in range(0, t, step):
        t1 = min(t, t0 + step)
        xf = x[:, :, t0:t1].transpose(1, 2).reshape(b * (t1 - t0), c, h, w)
        y = _norm_frames(xf, norm, limit)
        if silu:
            F.silu(y, inplace=True)
        out[:, :, t0:t1].copy_(y.view(b, t1 - t0, c, h, w).transpose(1, 2))
        del xf, y
    return out


def fold_biases(x: torch.Tensor, *convs: CausalConv3d) -> bool:
    """Whether ``convs`` may leave their biases to what reads their outputs (the fused channels-last GroupNorm and
    residual kernels add them as they read, rounded as a pass of their own would: a pass over the output less
    each): with ``SEEDVR2BW_VAE_FOLD_BIASES`` on, on the fused kernels' devices, for channels-last activations and
    convs that have biases."""
    return (knobs.get("VAE_FOLD_BIASES") and fused.enabled(x) and fused.channels_last(x)
            and all(c.bias is not None for c in convs))


def norm_silu_conv(x: torch.Tensor, norm: nn.GroupNorm, conv: CausalConv3d, cache: Optional[TemporalCache] = None,
                   max_bytes: float = math.inf, in_bias: Optional[torch.Tensor] = None,
                   conv_bias: bool = True) -> torch.Tensor:
    """``conv(SiLU(GroupNorm(x + in_bias)), cache)`` with the normalised frames written straight into the conv's
    input (``CausalConv3d.input_buffer``): behind its prepended frames and, under a row split, between the
    neighbours' rows, so that input is not a second copy of the activation; the same pass writes the first chunk's
    replicated frames and the frames the next chunk keeps (``CausalConv3d.edges``). ``conv_bias`` False: the output
    lacks the conv's bias (the caller adds it where it reads the output)."""
    streams = x.ndim == 5 and conv.streams(x)       # (a streamed conv reads its input frames where they are)
    if streams and in_bias is None and norm.affine:
        return conv.stream_norm_silu(x, norm, cache, bias=conv_bias)
    if x.ndim != 5 or streams:
        return conv(causal_group_norm(x, norm, max_bytes, silu=True, in_bias=in_bias), cache, bias=conv_bias)
    buf, body = conv.input_buffer(x, x.shape, cache)
    head, keep = conv.edges(body, cache)
    causal_group_norm(x, norm, max_bytes, silu=True, out=body, in_bias=in_bias, head=head, keep=keep)
    return conv.run_buffer(buf, cache, bias=conv_bias, written=(head, keep))
