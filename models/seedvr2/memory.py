"""The memory plan of one upscale run, made before any work from the VRAM and host RAM the run may use.

One plan for the whole run (the node, the benchmark and the streaming video path all call ``plan_memory``): which
DiT blocks stream from host RAM, the NVFP4 path when the fast one cannot fit, one VAE tile shape for every encode
and one for every decode (or none), a shorter chunk when ``batch_size`` is too large for the card, and an error
naming settings that fit when nothing does. It counts the bytes that actually run: an NVFP4 layer on the fp8_speed
path holds an FP8 copy beside its 4-bit weight (``derived_bytes``), activations grow with the chunk's tokens, the
VAE's peak per tile comes from ``vae/tiling.py``'s measured model, and a margin covers the allocator and workspace.

The phases never hold both models: the VAE is on the GPU for encode and decode, the DiT for its phase (see
``DiTStager``), so each phase gets the whole budget.
"""
from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import torch

from ...optimization.blockswap.config import gpu_bytes, plan_blockswap, spread_indices
from ...optimization.runtime.device import available_host_bytes
from .pipeline import MAX_OUTPUT_SIDE, RunPlan, SeedVR2InputError, UpscaleSettings, next_4n1
from .vae.config import SEEDVR2_VAE, VAEConfig
from .vae.tiling import choose_run_tiles, tile_area_ratio

_log = logging.getLogger(__name__)
GiB = 1 << 30
MiB = 1 << 20

# DiT step activations (bytes) = ACT_PER_TOKEN_DIM * tokens * dim + ACT_FIXED: 7B 720p x 21 peaked at 1.26 GiB (bf16)
# and 1.63 GiB (NVFP4, with the FP8 copies of the streamed blocks) above its weights (docs/PERFORMANCE.md §10)
ACT_PER_TOKEN_DIM = 24
ACT_FIXED = 512 * MiB
# Both phases free and allocate large tensors in a changing order, and torch keeps what it freed cached: up to 3.7 GiB
# of a 12 GiB budget were found cached but unusable in the VAE phase, and 1.16 GiB of an 8 GiB budget in the 7B fp8
# DiT step (it ran out of memory there with 6 % kept free); the VAE's measured peaks ran 3-7 % above vae/tiling.py's
# model. Streaming a few more blocks to keep this room costs the DiT step nothing measurable (PERFORMANCE §10).
MARGIN_FRACTION = 0.15
MARGIN_MIN = 384 * MiB
# In the DiT step the unusable cached memory grows with the activations, not the budget: 1.16 GiB beside 1.63 GiB of
# activations (7B fp8, 720p x 21, 8 GiB) and 2.08 GiB beside 3.10 GiB (3B bf16, 1080p x 21, 12 GiB), H100.
DIT_FRAGMENTATION = 0.75
VAE_PEAK_FACTOR = 1.1
# cuDNN runs a big convolution through a workspace-free fallback kernel (3.4x slower encode) when the NCDHW->NDHWC
# copy it needs does not fit next to the activations; conv bands of budget/96 keep that copy small (exact).
CONV_BAND_DIVISOR = 96
CONV_BAND_MIN, CONV_BAND_MAX = 64 * MiB, 512 * MiB
# Whole convs with smaller tiles against conv bands with larger ones, at card budgets (H100, docs/PERFORMANCE.md §3):
# whole was 0.75-0.85x the time to encode and 0.86-1.04x to decode where its tiles processed 1.02-1.09x the area.
WHOLE_CONV_AREA = 1.1
HOST_MARGIN = 2 * GiB       # host RAM left to the OS and the rest of the program


class SeedVR2MemoryError(SeedVR2InputError):
    """No setting fits the memory this run may use; the message names settings that would."""


@dataclass(frozen=True)
class DiTFootprint:
    """What the DiT holds on the GPU: ``block_bytes`` (stored, what a swap copies), ``block_extra`` (derived on the
    GPU while the block is there: the FP8 copy of NVFP4 weights on fp8_speed), ``other_bytes`` (always resident),
    ``dim`` (hidden size, for activations) and whether it has NVFP4 layers (that could fall back to fidelity)."""
    block_bytes: tuple
    block_extra: tuple
    other_bytes: int
    dim: int
    nvfp4: bool = False
    scratch: int = 0         # the shared scratch weight quantized layers dequantize into (the largest layer's)

    @property
    def total(self) -> int:
        return sum(self.block_bytes) + sum(self.block_extra) + self.other_bytes


def dit_footprint(model: torch.nn.Module, device, block_bytes: Sequence[int], other_bytes: int) -> DiTFootprint:
    """The footprint of ``model`` (a NaDiT) running on ``device``; ``block_bytes`` / ``other_bytes`` as its
    ``StagedModel`` stores them."""
    extra, nvfp4 = [], False
    for block in model.blocks:
        n = 0
        for m in block.modules():
            if callable(getattr(m, "derived_bytes", None)):
                nvfp4 = True
                n += int(m.derived_bytes(device))
        extra.append(n)
    scratch = max((int(m.scratch_bytes(device)) for m in model.modules()
                   if callable(getattr(m, "scratch_bytes", None))), default=0)
    dim = int(getattr(getattr(model, "config", None), "dim", 3072))
    return DiTFootprint(tuple(block_bytes), tuple(extra), int(other_bytes), dim, nvfp4, scratch)


def dit_tokens(frames: int, height: int, width: int) -> int:
    """Video tokens of one chunk of ``frames`` (padded to 4n+1) at height x width model pixels (VAE 8x, patch 2)."""
    return ((next_4n1(frames) - 1) // 4 + 1) * (height // 16) * (width // 16)


def dit_activation_bytes(tokens: int, dim: int) -> int:
    return int(ACT_PER_TOKEN_DIM * tokens * dim + ACT_FIXED)


def margin_bytes(budget: int) -> int:
    return max(MARGIN_MIN, int(MARGIN_FRACTION * budget))


def dit_margin_bytes(budget: int, act: int) -> int:
    """What the DiT phase keeps free beside ``act`` bytes of activations (see DIT_FRAGMENTATION)."""
    return max(margin_bytes(budget), int(DIT_FRAGMENTATION * act))


@dataclass(frozen=True)
class MemoryPlan:
    """See the module docstring. Tiles are in ``encode_tiled`` (pixels) / ``decode_tiled`` (latents) units, (0, 0)
    for one pass. ``settings`` are the run's settings after the plan (``batch_size`` may be smaller)."""
    budget: Optional[int]
    settings: UpscaleSettings
    swapped: tuple = ()
    nvfp4_path: Optional[str] = None             # None: the hardware policy's path; "fidelity" when fp8_speed won't fit
    encode_tiles: tuple = (0, 0)
    decode_tiles: tuple = (0, 0)
    dit_gpu_bytes: int = 0
    dit_activation_bytes: int = 0
    vae_peak_bytes: tuple = (0, 0)               # estimated encode / decode peak, weights excluded
    host_bytes: int = 0
    notes: tuple = field(default_factory=tuple)
    vae_stays: bool = False                      # the VAE may stay on the GPU through the DiT phase (room for both)
    vae_conv_bytes: Optional[int] = None         # the VAE's conv band size for this run (None: no bands)

    def line(self) -> str:
        """The one log line: what was decided and why."""
        if self.budget is None:
            return "[SeedVR2-BW] memory plan: no VRAM budget known (CPU): everything resident, VAE " + \
                   _tiles_text(self.encode_tiles, self.decode_tiles)
        parts = [f"budget {self.budget / GiB:.1f} GiB",
                 f"DiT {len(self.swapped)} blocks streamed, {self.dit_gpu_bytes / GiB:.2f} GiB weights + "
                 f"{self.dit_activation_bytes / GiB:.2f} GiB activations on the GPU",
                 "VAE " + _tiles_text(self.encode_tiles, self.decode_tiles) +
                 f" (peaks {self.vae_peak_bytes[0] / GiB:.1f} / {self.vae_peak_bytes[1] / GiB:.1f} GiB)",
                 f"chunks of {self.settings.batch_size} frames"]
        parts.append(f"VAE conv bands {self.vae_conv_bytes / MiB:.0f} MiB" if self.vae_conv_bytes else
                     "VAE convs whole")
        return "[SeedVR2-BW] memory plan: " + "; ".join(parts) + "".join(f"; {n}" for n in self.notes)


def _tiles_text(enc, dec) -> str:
    e = f"encode tiles {enc[0][1]}x{enc[0][0]} px" if enc[0] else "encode one pass"
    d = f"decode tiles {dec[0][1] * 8}x{dec[0][0] * 8} px" if dec[0] else "decode one pass"
    return f"{e}, {d}"


def plan_memory(run: RunPlan, settings: UpscaleSettings, dit: DiTFootprint, vae_bytes: int,
                budget: Optional[int], host_available: Optional[int] = None, blocks_to_swap="auto",
                buffers: int = 2, vae_dtype: torch.dtype = torch.bfloat16,
                vae_config: VAEConfig = SEEDVR2_VAE, channels: int = 3,
                reserve: Optional[int] = None, whole_convs: bool = False) -> MemoryPlan:
    """The plan of ``run`` (``pipeline.plan``) within ``budget`` bytes of VRAM (None: unknown, e.g. the CPU) and
    ``host_available`` bytes of RAM (None: asked from the system). ``blocks_to_swap``: "auto" or a count (a
    BlockSwap node's setting, kept as given); ``reserve``: the least VRAM kept for the DiT's activations (the
    BlockSwap node's; None: the estimate alone). ``whole_convs``: the VAE may run its convs without bands where the
    tiles stay the same (its NDHWC layout: cuDNN then needs no transposed copy beside them). Raises
    ``SeedVR2MemoryError`` before any work when nothing fits."""
    ph, pw = run.model
    th, tw = run.target
    host_available = available_host_bytes() if host_available is None else host_available
    host = run.frames * th * tw * (channels + 1) * 4       # the float32 output + the resized input of a chunk
    if host_available and host + HOST_MARGIN > host_available:
        raise SeedVR2MemoryError(
            f"the output ({run.frames} frames of {tw}x{th}) needs {host / GiB:.1f} GiB of system RAM and "
            f"{host_available / GiB:.1f} GiB are available: lower the resolution, upscale fewer frames at a time, or "
            f"use the SeedVR2 Upscale Video File node, which streams frames to disk.")
    notes = []
    vae = plan_vae(run, budget, vae_bytes, vae_dtype, vae_config, whole_convs)
    enc, dec, (enc_peak, dec_peak), conv = vae.encode_tiles, vae.decode_tiles, vae.peak_bytes, vae.conv_bytes
    if budget is None:
        return MemoryPlan(None, settings, encode_tiles=enc, decode_tiles=dec, vae_peak_bytes=(enc_peak, dec_peak),
                          host_bytes=host)
    margin = margin_bytes(budget)

    batch, path = settings.batch_size, None
    n = len(dit.block_bytes)
    options = [(dit.block_extra, None)] + ([((0,) * n, "fidelity")] if any(dit.block_extra) else [])
    while True:
        act = max(dit_activation_bytes(dit_tokens(min(batch, run.chunk_frames), ph, pw), dit.dim) + dit.scratch,
                  reserve or 0)
        dit_margin = dit_margin_bytes(budget, act)
        for extra, path in options:
            if blocks_to_swap == "auto":
                bs = plan_blockswap(dit.block_bytes, dit.other_bytes, budget - dit_margin, act, buffers=buffers,
                                    block_extra=extra)
                ok, swapped, gpu = bs.fits, tuple(bs.swapped_indices), bs.gpu_bytes
            else:
                swapped = tuple(spread_indices(n, int(blocks_to_swap)))
                gpu, _ = gpu_bytes(dit.block_bytes, dit.other_bytes, swapped, buffers, extra)
                ok = gpu + act <= budget - dit_margin
            if ok:
                break
        if ok:
            break
        if min(batch, run.chunk_frames) <= 1:
            raise SeedVR2MemoryError(_impossible(run, dit, budget, margin, act, gpu, buffers))
        batch = next_4n1(min(batch, run.chunk_frames)) - 4
    if path:
        notes.append("fp8_speed's FP8 weight copies do not fit: NVFP4 runs on the fidelity path")
    if batch != settings.batch_size:
        notes.append(f"batch_size {settings.batch_size} -> {batch}: a longer chunk does not fit")
        settings = replace(settings, batch_size=batch, temporal_overlap=min(settings.temporal_overlap, batch - 1))
    stays = gpu + act + vae_bytes <= budget - dit_margin
    return MemoryPlan(budget, settings, swapped, path, enc, dec, gpu, act, (enc_peak, dec_peak), host, tuple(notes),
                      stays, conv)


@dataclass(frozen=True)
class VAEPlan:
    """The VAE's part of a run's memory plan: tiles in ``encode_tiled`` / ``decode_tiled`` units ((0, 0): one pass),
    the estimated (encode, decode) peaks, weights excluded, and the conv band size (None: whole convs)."""
    encode_tiles: tuple
    decode_tiles: tuple
    peak_bytes: tuple
    conv_bytes: Optional[int]


def plan_vae(run: RunPlan, budget: Optional[int], vae_bytes: int, vae_dtype: torch.dtype = torch.bfloat16,
             vae_config: VAEConfig = SEEDVR2_VAE, whole_convs: bool = False) -> VAEPlan:
    """The tiles and conv bands of ``run``'s VAE calls within ``budget`` bytes of VRAM (None: unknown), the DiT off
    the GPU; ``plan_memory``'s choice, also what ``scripts/bench_vae.py --budgets`` times. Raises
    ``SeedVR2MemoryError`` when the smallest tile does not fit."""
    ph, pw = run.model
    elem = torch.empty((), dtype=vae_dtype).element_size()
    t = run.tiling
    conv = None if budget is None else min(CONV_BAND_MAX, max(CONV_BAND_MIN, budget // CONV_BAND_DIVISOR))

    def tiles(kind, vae_budget, bands=conv):
        mode, tile = (t.encode, t.encode_tile) if kind == "encode" else (t.decode, t.decode_tile)
        return choose_run_tiles(kind, mode, tile, t.overlap, ph, pw, vae_budget, elem, vae_config, VAE_PEAK_FACTOR,
                                bands, one_frame=run.chunk_frames == 1)

    if budget is None:
        (enc, enc_peak), (dec, dec_peak) = tiles("encode", None), tiles("decode", None)
        return VAEPlan(enc, dec, (enc_peak, dec_peak), conv)
    io = next_4n1(run.chunk_frames) * ph * pw * 3 * (elem + 4)     # a chunk's VAE input + float32 output
    vae_budget = budget - margin_bytes(budget) - vae_bytes - io
    (enc, enc_peak), (dec, dec_peak) = tiles("encode", vae_budget), tiles("decode", vae_budget)
    # Whole convs (NDHWC) are taken where their tiles fit and process at most WHOLE_CONV_AREA times the banded
    # tiles' area: bands copy every band in and out, which costs more than a little more overlap.
    (enc_w, enc_w_peak), (dec_w, dec_w_peak) = (tiles("encode", vae_budget, math.inf),
                                                tiles("decode", vae_budget, math.inf))
    area = functools.partial(tile_area_ratio, ph=ph, pw=pw, config=vae_config)
    if whole_convs and max(enc_w_peak, dec_w_peak) <= vae_budget and \
            area("encode", enc_w) <= WHOLE_CONV_AREA * area("encode", enc) and \
            area("decode", dec_w) <= WHOLE_CONV_AREA * area("decode", dec):
        conv, enc, dec, enc_peak, dec_peak = None, enc_w, dec_w, enc_w_peak, dec_w_peak
    if max(enc_peak, dec_peak) > vae_budget:
        raise SeedVR2MemoryError(
            f"the VAE needs {vae_bytes / GiB:.2f} GiB of weights plus {max(enc_peak, dec_peak) / GiB:.2f} GiB for its "
            f"smallest tile, and this run may use {budget / GiB:.2f} GiB of VRAM: close other programs on the GPU "
            f"or use a GPU with more memory.")
    return VAEPlan(enc, dec, (enc_peak, dec_peak), conv)


def _impossible(run: RunPlan, dit: DiTFootprint, budget: int, margin: int, act: int, gpu: int, buffers: int) -> str:
    ph, pw = run.model
    need = gpu + act + dit_margin_bytes(budget, act)
    # the largest output (shortest edge, 16 px steps) whose single-frame chunk fits with every block streamed
    streamed, _ = gpu_bytes(dit.block_bytes, dit.other_bytes, range(len(dit.block_bytes)), buffers, dit.block_extra)
    room = min(budget - margin - streamed, (budget - streamed) / (1 + DIT_FRAGMENTATION)) - ACT_FIXED
    fit_tokens = max(0, room // (ACT_PER_TOKEN_DIM * dit.dim))
    scale = (fit_tokens / max(1, dit_tokens(1, ph, pw))) ** 0.5
    short = int(min(run.target) * min(1.0, scale)) // 16 * 16
    hint = (f"an output shortest edge of about {short} px fits with batch_size 1" if short >= 16 else
            "no output size fits")
    return (f"this run needs at least {need / GiB:.2f} GiB of VRAM (DiT {gpu / GiB:.2f} GiB with every block "
            f"streamed from RAM + {act / GiB:.2f} GiB activations for one frame at {pw}x{ph}) and may use "
            f"{budget / GiB:.2f} GiB: {hint}; an fp8 or NVFP4 model file, or closing other programs on the GPU, "
            f"leaves more room. (Output limit: {MAX_OUTPUT_SIDE} px per side.)")
