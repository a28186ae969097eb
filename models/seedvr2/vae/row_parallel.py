"""The VAE split by rows over the ranks of a process group (sequence parallel for one clip), equal to one process.

Each rank holds a band of whole rows (all frames, all columns) and runs the same encoder / decoder on it. Three
operations of the VAE read across rows; under ``split_rows(group)`` they reach the other ranks instead:

* a convolution reads ``pad_top`` rows above its band and ``k - stride - pad_top`` below: those rows come from the
  neighbouring ranks (one send and one receive each way); on the frame's top and bottom edges they are zero rows of
  the same buffer, so every rank's conv is left with the same (no) row padding, which cuDNN applies itself (a
  one-sided padding would need a padded copy of the whole band);
* GroupNorm takes its per-frame statistics over the whole frame: the band's sums are all-reduced (mean first, then
  the centred squares, in float32);
* the mid block's attention runs within a frame over every position: each rank's keys and values are gathered.

Everything else (1x1 convs, depth-to-space, the temporal causal cache, time chunks) is row-local. Bands are cut on
multiples of the spatial factor (encode) or on latent rows (decode), so every stride-2 step and every 2x upsampling
keeps the cut on a row boundary of each rank. The result equals the single-process VAE up to float rounding (the
statistics and the attention sum in another order); ``encode_rows`` / ``decode_rows`` return the whole output on
every rank. Works with gloo (CPU tensors) and NCCL (CUDA tensors).
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .layout import empty_like_layout
from .posterior import LatentDistribution

_SHARD: contextvars.ContextVar = contextvars.ContextVar("seedvr2bw_vae_rows", default=None)


@dataclass(frozen=True)
class RowShard:
    group: Optional[object]
    rank: int
    world: int

    # ------------------------------------------------------------------ convolutions
    def halo_rows(self, pad: Sequence[int], k: int, stride: int) -> tuple[int, int]:
        """Rows (above, below) a conv (kernel ``k`` rows, ``stride``, spatial ``pad`` (top, bottom, left, right))
        of this band reads beyond it: the neighbouring bands' rows, or on the frame's edges its zero padding."""
        return pad[0], k - stride - pad[0]

    def halo(self, x: torch.Tensor, pad: Sequence[int], k: int, stride: int) -> tuple[torch.Tensor, tuple]:
        """``x`` (..., H_band, W) extended by the rows its conv reads from the neighbouring bands, and the zero
        padding left to apply."""
        above, below = self.halo_rows(pad, k, stride)
        if not above and not below:
            return self.fill_halo(x, 0, 0, pad, k, stride)
        h = x.shape[-2]
        buf = empty_like_layout(x, x.shape[:-2] + (above + h + below, x.shape[-1]))
        buf[..., above:above + h, :].copy_(x)
        return self.fill_halo(buf, above, below, pad, k, stride)

    def fill_halo(self, buf: torch.Tensor, above: int, below: int, pad: Sequence[int], k: int,
                  stride: int) -> tuple[torch.Tensor, tuple]:
        """``buf`` (..., above + H_band + below, W), this band in its middle rows (``halo_rows``): its first
        ``above`` and last ``below`` rows are received from the neighbours, which get this band's edge rows, or
        zeroed on the frame's edges. Returns ``buf`` and the zero padding left to apply (columns only)."""
        top, bottom = pad[0], k - stride - pad[0]
        first, last = self.rank == 0, self.rank == self.world - 1
        h = buf.shape[-2] - above - below
        if h < max(top, bottom, 1):
            raise RuntimeError(f"a band of {h} rows is thinner than the {max(top, bottom)} rows its neighbours "
                               f"read: use fewer GPUs for this frame size")
        x = buf[..., above:above + h, :]
        ops, got = [], {}
        if not first:
            if top:                           # my top halo: the previous band's last rows
                got["above"] = buf.new_empty(buf.shape[:-2] + (top, buf.shape[-1]))
                ops.append(dist.P2POp(dist.irecv, got["above"], self._peer(-1), self.group))
            if bottom:                        # the previous band's bottom halo: my first rows
                ops.append(dist.P2POp(dist.isend, x[..., :bottom, :].contiguous(), self._peer(-1), self.group))
        if not last:
            if bottom:                        # my bottom halo: the next band's first rows
                got["below"] = buf.new_empty(buf.shape[:-2] + (bottom, buf.shape[-1]))
                ops.append(dist.P2POp(dist.irecv, got["below"], self._peer(1), self.group))
            if top:                           # the next band's top halo: my last rows
                ops.append(dist.P2POp(dist.isend, x[..., h - top:, :].contiguous(), self._peer(1), self.group))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        if "above" in got:
            buf[..., :above, :].copy_(got["above"])
        elif above:
            buf[..., :above, :].zero_()
        if "below" in got:
            buf[..., above + h:, :].copy_(got["below"])
        elif below:
            buf[..., above + h:, :].zero_()
        return buf, (0, 0, pad[2], pad[3])

    def _peer(self, step: int) -> int:
        r = self.rank + step
        return dist.get_global_rank(self.group, r) if self.group is not None else r

    # ------------------------------------------------------------------ statistics and gathers
    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.group)
        return t

    def gather_moments(self, local: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's per-row statistics of its band: ``local`` (rows, 2) float32 (mean, M2) over ``count``
        values a row -> (rows, world, 2) and the counts (world,), in one all-gather (the fused GroupNorm's
        ``combine``)."""
        mine = torch.cat([local.flatten(), local.new_full((1,), float(count))])   # a fill: no copy, no sync
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(parts, mine, group=self.group)     # gloo has no all_gather_into_tensor
        every = torch.stack(parts)
        return every[:, :-1].view(self.world, -1, 2).transpose(0, 1), every[:, -1]

    def group_norm(self, x: torch.Tensor, norm: torch.nn.GroupNorm, silu: bool,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Per-frame GroupNorm of the band ``x`` (B, C, T, H, W) or (B, C, H, W) with whole-frame statistics: the
        mean first, then the centred squares (two passes, float32), one float32 temporary of the band in all.
        ``out`` (x's shape and dtype, any layout): the result is written there and returned."""
        five = x.ndim == 5
        x5 = x if five else x.unsqueeze(2)
        b, c, t, h, w = x5.shape
        g = norm.num_groups
        xg = x5.reshape(b, g, c // g, t, h, w)
        # the band's sums (accumulated in float32, no float32 copy of the band) and its row count in one all-reduce
        sums = self.all_sum(torch.cat([xg.sum(dim=(2, 4, 5), dtype=torch.float32).flatten(),
                                       torch.full((1,), float(h), device=x.device)]))
        count = sums[-1] * (c // g) * w
        mean = sums[:-1].view(b, g, t) / count
        centred = xg - mean[:, :, None, :, None, None]            # float32 (type promotion)
        var = self.all_sum(torch.linalg.vector_norm(centred, dim=(2, 4, 5)).square_()) / count
        # y = centred * rstd * gamma + beta, scale and shift folded per (sample, channel, frame)
        scale = torch.rsqrt(var + norm.eps)[:, :, None, :]                       # (b, g, 1, t)
        if norm.affine:
            scale = scale * norm.weight.float().view(1, g, c // g, 1)            # (b, g, cg, t)
        centred.mul_(scale[..., None, None])
        if norm.affine:
            centred.add_(norm.bias.float().view(1, g, c // g, 1, 1, 1))
        y = centred.view(b, c, t, h, w)
        if out is not None:
            y = out.copy_(y if five else y.squeeze(2))
        else:
            y = y.to(x.dtype)      # keeps the band's layout (NDHWC on that path)
            y = y if five else y.squeeze(2)
        return F.silu(y, inplace=True) if silu else y

    def gather_rows(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order (the bands may differ in size there)."""
        return gather_uneven(x, dim, self.group)


def gather_uneven(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order, on every rank of ``group``; the ranks' sizes along
    ``dim`` may differ (all_gather needs equal sizes on gloo: each part is padded to the largest)."""
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=x.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([x.shape[dim]], dtype=torch.int64, device=x.device), group=group)
    sizes = [int(s) for s in sizes]
    pad_to = max(sizes)
    xp = x.movedim(dim, 0)
    if xp.shape[0] < pad_to:
        xp = torch.cat([xp, xp.new_zeros((pad_to - xp.shape[0],) + xp.shape[1:])])
    parts = [torch.empty_like(xp) for _ in range(world)]
    dist.all_gather(parts, xp.contiguous(), group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)]).movedim(0, dim)


def current() -> Optional[RowShard]:
    """The row split the VAE runs under (None: the whole frame in this process)."""
    return _SHARD.get()


@contextlib.contextmanager
def split_rows(group=None):
    """The VAE calls inside run on this rank's band of rows of ``group`` (default: the world)."""
    token = _SHARD.set(RowShard(group, dist.get_rank(group), dist.get_world_size(group)))
    try:
        yield
    finally:
        _SHARD.reset(token)


class TooFewRows(ValueError):
    """The frame has fewer rows than the ranks need (a band of at least one unit each); raised before any
    collective, on every rank alike."""


def bands(rows: int, world: int, unit: int = 1) -> list[tuple[int, int]]:
    """``rows`` cut into ``world`` contiguous bands on multiples of ``unit``, as even as possible."""
    units = -(-rows // unit)
    if units < world:
        raise TooFewRows(f"{rows} rows cannot be split over {world} ranks in bands of {unit}: use fewer GPUs")
    cuts = [round(i * units / world) * unit for i in range(world + 1)]
    cuts[-1] = rows
    return list(zip(cuts, cuts[1:]))


def decode_rows(vae, z: torch.Tensor, group=None, should_stop=None) -> torch.Tensor:
    """``vae.decode(z)`` over the ranks of ``group``, each decoding a band of latent rows; the whole output on every
    rank."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    r0, r1 = bands(z.shape[-2], world)[rank]
    with split_rows(group):
        part = vae.decode(z[..., r0:r1, :], should_stop=should_stop)
        return current().gather_rows(part, part.ndim - 2)


def encode_rows(vae, x: torch.Tensor, group=None, should_stop=None):
    """``vae.encode(x)`` over the ranks of ``group`` (bands on multiples of the spatial factor); the whole latent
    distribution on every rank."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    r0, r1 = bands(x.shape[-2], world, vae.spatial_factor)[rank]
    with split_rows(group):
        post = vae.encode(x[..., r0:r1, :], should_stop=should_stop)
        return LatentDistribution(current().gather_rows(post.moments, post.moments.ndim - 2))
