"""Spatial tiling of encode/decode with overlap and linear blending; VRAM-based tile choice.

The official VAE has no spatial tiling (docs/SPEC.md §5); its exactness comes from causal temporal slicing, which
every tile here uses as well (each tile runs the official temporal chunks with its own TemporalCache). Spatial
tiles are *not* exact: the per-frame GroupNorm statistics and the mid-block attention span the whole frame, so a
tile sees different statistics than the full frame. Overlaps are cross-faded linearly to hide the seams.

Geometry is planned in latent units (so pixel tiles stay aligned to the 8x grid): tile i covers latents
[a_i, b_i) and pixels [8a_i, 8b_i). Blending weights are separable, ramp across the actual overlap of neighbouring
tiles and are normalised so they sum to one at every position: where one tile alone covers a position its weight
is exactly 1, so results there are copied unchanged.

Memory: one tile's temporal chunk is alive at a time; its (weighted) result is added into a preallocated output
that may live on another device (e.g. CPU), so peak device memory does not grow with the frame size.
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch

from .causal_conv import GIB, INDEX_LIMIT
from .config import SEEDVR2_VAE, VAEConfig
from .posterior import LatentDistribution, check_stop

Pair = Union[int, Tuple[int, int]]


def _pair(v: Pair) -> Tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def tile_spans(size: int, tile: int, overlap: int) -> List[Tuple[int, int]]:
    """[(start, end)] covering [0, size) with tiles of `tile` overlapping by at least `overlap`, spread evenly."""
    if tile <= 0 or tile >= size:
        return [(0, size)]
    overlap = max(0, min(overlap, tile - 1))
    n = math.ceil((size - overlap) / (tile - overlap))
    if n <= 1:
        return [(0, size)]
    starts = [round(k * (size - tile) / (n - 1)) for k in range(n)]
    return [(s, s + tile) for s in starts]


def blend_weights(spans: Sequence[Tuple[int, int]], size: int, margin: int = 0, device=None) -> List[torch.Tensor]:
    """1-D float64 weights per span, normalised to sum to 1 at every position, on ``device`` (default the host).
    The tilers take them to the device before any tile is queued: a copy from pageable host memory first waits for
    what the GPU has queued (CUDA's rule), and one such copy a temporal chunk left the GPU idle while the next chunk
    was launched (the 8 GiB plan's 720p decode on an H100: 1082 ms for 871 ms of kernels).

    Across the overlap of two neighbours the weight ramps linearly from one to the other. `margin` positions at
    each tile's inner edge get weight 0 (the ramp spans the middle of the overlap), so a tile's border, where its
    output lacks the context of the neighbour, is never used; for an operation whose receptive field is within
    `margin`, tiling is then exact up to rounding.
    """
    def ramp(dist, o):
        m = max(0, min(margin, (o - 1) // 2))
        return ((dist - m + 1) / (o - 2 * m + 1)).clamp(0.0, 1.0)

    raw = []
    for i, (a, b) in enumerate(spans):
        p = torch.arange(a, b, dtype=torch.float64)
        w = torch.ones(b - a, dtype=torch.float64)
        if i > 0 and spans[i - 1][1] > a:
            w = torch.minimum(w, ramp(p - a, spans[i - 1][1] - a))
        if i < len(spans) - 1 and spans[i + 1][0] < b:
            w = torch.minimum(w, ramp(b - 1 - p, b - spans[i + 1][0]))
        raw.append(w)
    total = torch.zeros(size, dtype=torch.float64)
    for (a, b), w in zip(spans, raw):
        total[a:b] += w
    total = total.clamp_min(1e-12)
    return [(w / total[a:b]).to(device or "cpu") for (a, b), w in zip(spans, raw)]


def _plan(h: int, w: int, tile: Pair, overlap: Pair):
    (th, tw), (oh, ow) = _pair(tile), _pair(overlap)
    ys, xs = tile_spans(h, th, oh), tile_spans(w, tw, ow)
    return ys, xs


def _tile_weight(wy: torch.Tensor, wx: torch.Tensor, single: bool) -> Optional[torch.Tensor]:
    """A tile's 2-D float32 blend weight from its 1-D float64 ones (None for one tile), where they are."""
    return None if single else (wy[:, None] * wx[None, :]).float()


def _accumulate(out: torch.Tensor, part: torch.Tensor, t0: int, y: Tuple[int, int], x: Tuple[int, int],
                w: Optional[torch.Tensor]) -> None:
    """Adds a tile's ``part`` times its blend weight ``w`` (``_tile_weight``) into ``out``; copies it for one tile."""
    dst = out[:, :, t0:t0 + part.shape[2], y[0]:y[1], x[0]:x[1]]
    if w is None:  # one tile: plain copy, bit-identical to the untiled path
        dst.copy_(part)
        return
    dst.add_((part.float() * w).to(dst.device, dst.dtype))


@torch.no_grad()
def decode_tiled(vae, z: torch.Tensor, tile: Pair = 64, overlap: Pair = 8, should_stop=None,
                 output_device=None, output_dtype=None, margin: int = 0) -> torch.Tensor:
    """Decode z (B, C, t, h, w) (or (B, C, h, w)) in spatial tiles of `tile` latents overlapping by `overlap`
    latents. The output (B, 3, 4(t-1)+1, 8h, 8w) is preallocated on `output_device` (default: z's device) with
    `output_dtype` (default float32 when tiles overlap, so the blend accumulates without rounding). `margin`
    (latents) of each tile's inner border is left out of the blend (see blend_weights)."""
    squeeze = z.ndim == 4
    if squeeze:
        z = z.unsqueeze(2)
    b, _, t, h, w = z.shape
    s, tf = vae.spatial_factor, vae.temporal_factor
    ys, xs = _plan(h, w, tile, overlap)
    single = len(ys) == 1 and len(xs) == 1
    wys = blend_weights([(a * s, b_ * s) for a, b_ in ys], h * s, margin * s, vae.device)
    wxs = blend_weights([(a * s, b_ * s) for a, b_ in xs], w * s, margin * s, vae.device)
    dtype = output_dtype or (vae.dtype if single else torch.float32)
    out = torch.zeros((b, vae.config.out_channels, tf * (t - 1) + 1, h * s, w * s),
                      device=output_device or z.device, dtype=dtype)
    for iy, (y0, y1) in enumerate(ys):
        for ix, (x0, x1) in enumerate(xs):
            check_stop(should_stop)
            zt = z[:, :, :, y0:y1, x0:x1]
            wt = _tile_weight(wys[iy], wxs[ix], single)
            for pos, part in vae.iter_decode(zt, should_stop):
                _accumulate(out, part, pos, (y0 * s, y1 * s), (x0 * s, x1 * s), wt)
                del part
    return out.squeeze(2) if squeeze else out


@torch.no_grad()
def encode_tiled(vae, x: torch.Tensor, tile: Pair = 512, overlap: Pair = 64, should_stop=None,
                 output_device=None, margin: int = 0) -> LatentDistribution:
    """Encode x (B, 3, T, H, W) in spatial tiles of `tile` pixels overlapping by `overlap` pixels (both rounded
    down to multiples of 8). The latent moments are blended (before the logvar clamp) in float32. `margin` (pixels,
    rounded down to latents) of each tile's inner border is left out of the blend."""
    if x.ndim == 4:
        x = x.unsqueeze(2)
    b, _, t, hp, wp = x.shape
    s = vae.spatial_factor
    if hp % s or wp % s:
        raise ValueError(f"tiled encode needs H and W divisible by {s}, got {hp}x{wp}")
    (th, tw), (oh, ow) = _pair(tile), _pair(overlap)
    h, w = hp // s, wp // s
    ys, xs = _plan(h, w, (max(1, th // s), max(1, tw // s)), (oh // s, ow // s))
    single = len(ys) == 1 and len(xs) == 1
    wys, wxs = blend_weights(ys, h, margin // s, vae.device), blend_weights(xs, w, margin // s, vae.device)
    lat_t = (t - 1) // vae.temporal_factor + 1
    out = torch.zeros((b, 2 * vae.config.latent_channels, lat_t, h, w), device=output_device or vae.device,
                      dtype=vae.dtype if single else torch.float32)
    for iy, (y0, y1) in enumerate(ys):
        for ix, (x0, x1) in enumerate(xs):
            check_stop(should_stop)
            xt = x[:, :, :, y0 * s:y1 * s, x0 * s:x1 * s]
            wt = _tile_weight(wys[iy], wxs[ix], single)
            for pos, part in vae.iter_encode(xt, should_stop):
                _accumulate(out, part, pos, (y0, y1), (x0, x1), wt)
                del part
    return LatentDistribution(out.to(vae.dtype))


# ------------------------------------------------------------------------------------------------ tile choice
def _area(tile: Pair) -> int:
    th, tw = _pair(tile)
    return th * tw


# Conv bands of at most this size (the memory plan's below 48 GiB) keep the fixed part of a VAE call's peak small.
SMALL_BANDS = 341 * 2**20
# The smallest tiles (pixels) at which whole convs' peaks were measured (``estimate_decode_bytes``, ``_encode_``).
WHOLE_MEASURED_PX = 150_000
WHOLE_MEASURED_ENCODE_PX = 300_000


def estimate_decode_bytes(tile_latent: Pair, config: VAEConfig = SEEDVR2_VAE, dtype_bytes: int = 2,
                          split_size: int = 4, conv_bytes: Optional[int] = None, one_frame: bool = False) -> int:
    """Estimated peak device memory of decoding one tile of `tile_latent` latents (int: square; or (h, w)),
    excluding weights and the output.

    The peak is at full resolution in the last up blocks, over the first temporal chunk (split_size + 1 frames,
    + 2 replicated head frames in the 3x3x3 convs): tensors of boc[1] channels (the spatial-only upsampler of the
    second-to-last up block and the first ResNet of the last one). With the official 0.5 GiB conv/norm limits
    (``conv_bytes`` None) calibrated on an H200 (bf16, torch 2.11): 17.5 GiB per megapixel + 1.1 GiB (tiles of
    512 px, 720p, 1080p, 21 frames), modelled as 5.5 such tensors + 1.25 GiB (cuDNN workspace, the band's padded
    copy). With conv bands of ``conv_bytes`` <= SMALL_BANDS, measured on an H100 through the memory plan (one pass
    and 672x720 to 480x288 px tiles of 720p x 21, bands 64-341 MiB): 17.7 GiB per megapixel + 0.34 GiB within 1.3 %,
    modelled as 5.3 tensors + 0.34 GiB. A single image (``one_frame``) peaked at 4/7 of that per pixel (H100,
    1920x1088 in 992x1088 tiles: 10.1 GiB per megapixel), modelled as 4 frames. Whole convs (``conv_bytes`` inf,
    NDHWC) where those tensors stay below INDEX_LIMIT elements (above it the convs run in bands again), measured on
    an H100 at 0.17-0.40 Mpx tiles and one 720p pass (8019564: conv_out streamed, the upsamplers' 1 x 1 outputs
    freed early): 2.75-6.16 GiB and 13.81 GiB, 4.40 tensors + 0.27 GiB within 1.1 %, modelled as 4.6 tensors +
    0.3 GiB (4-5 % above each; the official-limit model is 25-50 % above them at card-budget tiles;
    ``tests/test_memory_plan.py`` holds the points). Below those tiles (WHOLE_MEASURED_PX), unmeasured, the
    official-limit model stays.
    """
    px = _area(tile_latent) * config.spatial_factor ** 2
    frames = 4 if one_frame else split_size + 1 + 2
    return _modelled_bytes(config.block_out_channels[1] * frames * px, px, dtype_bytes, conv_bytes, one_frame,
                           WHOLE_MEASURED_PX, whole=(4.6, 0.3), banded=(5.3, 0.34), official=(5.5, 1.25))


def estimate_encode_bytes(tile_px: Pair, config: VAEConfig = SEEDVR2_VAE, dtype_bytes: int = 2,
                          split_size: int = 4, conv_bytes: Optional[int] = None, one_frame: bool = False) -> int:
    """Estimated peak device memory of encoding one pixel tile (int: square; or (h, w)): the first down block at
    full resolution over the first chunk (split_size + 1 frames, + 2 head frames), boc[0] channels. Measured on an
    H200 (bf16, official limits): about 10.6 GiB per megapixel + 0.3 GiB, modelled as 6.5 tensors + 0.5 GiB; with
    conv bands <= SMALL_BANDS (H100, as for decoding: one pass to 368x720 px tiles): 9.6 GiB per megapixel +
    0.23 GiB within 3 %, modelled as 5.8 tensors + 0.3 GiB. A single image (``one_frame``: 1920x1088 in one pass,
    4.0 GiB per megapixel) is modelled as 3 frames (the image and the 2 replicated head frames). Whole convs
    (``conv_bytes`` inf, NDHWC; tiles from WHOLE_MEASURED_ENCODE_PX, tensors below INDEX_LIMIT elements), measured
    on an H100 at 0.35-0.57 Mpx tiles and 720p and 1080p passes: 9.36 GiB per megapixel within 1 %, modelled as
    5.7 tensors + 0.1 GiB (the official-limit model is 18-31 % above them)."""
    frames = 3 if one_frame else split_size + 1 + 2
    px = _area(tile_px)
    return _modelled_bytes(config.block_out_channels[0] * frames * px, px, dtype_bytes, conv_bytes, one_frame,
                           WHOLE_MEASURED_ENCODE_PX, whole=(5.7, 0.1), banded=(5.8, 0.3), official=(6.5, 0.5))


def _modelled_bytes(elements: int, px: int, dtype_bytes: int, conv_bytes: Optional[float], one_frame: bool,
                    whole_from: int, whole: tuple, banded: tuple, official: tuple) -> int:
    """A VAE call's peak as (tensors, fixed GiB) times its largest tensors' ``elements``: ``whole`` for whole convs
    (``conv_bytes`` inf) from ``whole_from`` pixels (the measured tiles) while a sample stays below INDEX_LIMIT,
    ``banded`` for bands of at most SMALL_BANDS, else ``official``."""
    if conv_bytes == math.inf and whole_from <= px and elements <= INDEX_LIMIT and not one_frame:
        tensors, fixed = whole
    elif conv_bytes is not None and conv_bytes <= SMALL_BANDS:
        tensors, fixed = banded
    else:
        tensors, fixed = official
    return int(tensors * elements * dtype_bytes + fixed * GIB)


def _tile_len(size: int, n: int, overlap: int, unit: int) -> int:
    """The shortest tile (a multiple of ``unit``) with which ``n`` tiles overlapping by ``overlap`` cover ``size``."""
    if n == 1:
        return size
    t = -(-(size + (n - 1) * overlap) // n)
    return min(size, t + (-t) % unit)


def choose_run_tiles(kind: str, mode: str, tile_px: int, overlap_px: int, ph: int, pw: int, budget: Optional[int],
                     dtype_bytes: int, config: VAEConfig = SEEDVR2_VAE, peak_factor: float = 1.0,
                     conv_bytes: Optional[int] = None, one_frame: bool = False) -> tuple[tuple, int]:
    """((tile, overlap), estimated peak) of every ``kind`` call of a run on ph x pw pixel frames (the memory plan's
    choice, made once; ``plan_tiles`` sizes a single call from the free memory at that moment), in ``encode_tiled``
    (pixels) / ``decode_tiled`` (latents) units; tile is an (h, w) pair, (0, 0) means one pass. Among the tile grids
    whose peak (``estimate_*_bytes`` x ``peak_factor``) fits ``budget``, the one that processes the least area;
    a given tile size or mode "off" is kept as it is."""
    s = config.spatial_factor
    d = 1 if kind == "encode" else s                    # pixels per unit of the call
    unit = 2 * s // d                                    # whole 2x2 latent patches
    h, w = ph // d, pw // d
    est = estimate_encode_bytes if kind == "encode" else estimate_decode_bytes

    def peak(th, tw):
        return int(peak_factor * est((th, tw), config, dtype_bytes, conv_bytes=conv_bytes, one_frame=one_frame))

    ov = overlap_px // d // unit * unit
    if mode == "off" or (budget is None and not tile_px and mode == "auto"):
        return (0, 0), peak(h, w)
    if tile_px or budget is None:
        t = max(2 * unit, (tile_px or 512) // d // unit * unit)
        if t >= h and t >= w:
            return (0, 0), peak(h, w)
        th, tw = min(t, h), min(t, w)
        return ((th, tw), min(ov, t // 2)), peak(th, tw)
    if peak(h, w) <= budget:
        return (0, 0), peak(h, w)
    best = None
    for ny in range(1, 17):
        for nx in range(1, 17):
            th, tw = _tile_len(h, ny, ov, unit), _tile_len(w, nx, ov, unit)
            if min(th, tw) < max(2 * unit, 2 * ov) or peak(th, tw) > budget:
                continue
            cost = (ny * nx * th * tw, ny * nx)
            if best is None or cost < best[0]:
                best = (cost, th, tw)
    if best is None:                                      # nothing fits: the smallest tile, the caller refuses
        t = max(2 * unit, 2 * ov)
        return ((t, t), min(ov, t // 2)), peak(t, t)
    _, th, tw = best
    return ((th, tw), min(ov, min(th, tw) // 2)), peak(th, tw)


def tile_area_ratio(kind: str, tiles: tuple, ph: int, pw: int, config: VAEConfig = SEEDVR2_VAE) -> float:
    """The area every ``kind`` call processes with ``tiles`` ((tile, overlap) as ``choose_run_tiles`` gives them, or
    (0, 0): one pass) over the ph x pw pixel frame's: the overlap's extra work, the cost ``choose_run_tiles``
    minimises."""
    if not tiles[0]:
        return 1.0
    (th, tw), ov = tiles
    d = 1 if kind == "encode" else config.spatial_factor
    h, w = ph // d, pw // d
    ny = 1 if th >= h else -(-(h - ov) // (th - ov))
    nx = 1 if tw >= w else -(-(w - ov) // (tw - ov))
    return ny * min(th, h) * nx * min(tw, w) / (h * w)


def plan_tiles(kind: str, mode: str, tile_px: int, overlap_px: int, height: int, width: int,
               free_bytes: Callable[[], Optional[int]], dtype: torch.dtype = torch.bfloat16,
               config: VAEConfig = SEEDVR2_VAE, safety: float = 0.8) -> Tuple[Pair, int]:
    """The tiling of one `kind` ("encode" / "decode") call on a height x width pixel frame, for a caller without a
    memory plan: (tile, overlap) in the units of encode_tiled (pixels) / decode_tiled (latents), (0, 0) for none.

    `mode` "off": none. A given `tile_px` > 0 is used as it is; otherwise `free_bytes()` is asked and the tiles are
    choose_run_tiles' for `safety` x that budget: one pass where the whole frame's estimate fits, else tiles shaped
    to the frame. Where free memory is unknown (None) "auto" does not tile and "on" uses 512 px.
    """
    if mode == "off":
        return 0, 0
    budget = None
    if not (tile_px and tile_px > 0):
        free = free_bytes()
        budget = None if free is None else int(free * safety)
    elem = torch.empty((), dtype=dtype).element_size()
    (tile, overlap), _ = choose_run_tiles(kind, mode, max(0, tile_px or 0), overlap_px, height, width, budget, elem,
                                          config)
    return tile, overlap
