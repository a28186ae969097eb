"""SeedVR2 one-step upscaling pipeline (pure torch, no ComfyUI imports).

Follows the official inference (docs/SPEC.md §6) with the ComfyUI-port conveniences of docs/SPEC.md §7:

1. frames ``(T, H, W, C)`` float in [0, 1], C = 3 (RGB) or 4 (RGBA; the alpha channel does not go
   through the model: it is resized on its own, bicubic with antialiasing, clamped, and reattached).
2. **Target size** (the size of the returned frames, exact):
   * ``resolution`` mode: the shortest edge becomes ``resolution``; the other edge is
     ``floor(long * resolution / short + 0.5)`` (round half up); then, if ``max_resolution`` > 0 and the
     long edge exceeds it, both edges are scaled down so that the long edge equals ``max_resolution``.
   * ``scale_factor`` mode: each edge is ``floor(edge * scale + 0.5)``.
   The frames are resized to exactly that size (bicubic, antialiased when shrinking, clamped to [0, 1]).
3. **Model size**: the VAE needs multiples of 8 and the DiT's 1x2x2 patch needs an even latent, so
   the model works on the target size rounded **up** to a multiple of 16 pixels. The frames are padded
   bottom/right with replicated edge pixels (numz pads with black, the official script centre-crops and
   so changes the size); everything is cropped back to the exact target size after decoding.
4. Normalise to [-1, 1]. Split the clip into temporal chunks of ``batch_size`` frames (must be 4n+1)
   that overlap by ``temporal_overlap`` frames; a chunk whose length is not 4n+1 (the last one, or a
   clip shorter than ``batch_size``) is padded by **repeating its last frame** (docs/SPEC.md §6 step 3).
5. **VAE encode** (optionally spatially tiled by ``vae/tiling.py``), **sample** the posterior: mean + exp(0.5 logvar) * N(0,1),
   times the scaling factor 0.9152, channels-last ``(t, h, w, 16)``: the LQ latent.
6. **Noise** x_T ~ N(0, I) (seeded, drawn on CPU so results do not depend on the device),
   condition = [LQ latent, ones]: DiT input ``[x_T | LQ | 1]`` (33 channels). ``cond_noise_scale`` is 0
   for SeedVR2, so the condition is the clean LQ latent.
7. **One Euler step** at t = 1000 (steps = 1, cfg = 1, shift 1): ``v = DiT(x_T, cond, pos_emb, t=1000)``,
   ``x_0 = x_T - v``. Only the positive text embedding is used (cfg = 1 means the negative branch is
   never evaluated, docs/SPEC.md §6 step 8).
8. Divide by the scaling factor, **VAE decode** (optionally tiled), drop the padded frames, crop to
   the target size, map back to [0, 1].
9. **Colour correction** (``wavelet`` = official StableSR wavelet reconstruction, ``adain``, ``lab``,
   ``none``) against the resized input chunk, then chunks are blended linearly over the overlap.

Steps 2-4 and the tiling settings are ``plan(frames, settings)``, which the ComfyUI node also uses to size its
model loads. The work runs in three phases (all encodes, then all DiT steps, then all decodes) so that the VAE and
the DiT need not be resident at the same time; ``hooks`` lets the caller load/offload models between
phases. Latents are parked on ``offload_device`` between phases (they are 48x smaller than the frames).
"""
from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...optimization.runtime.device import free_device_bytes
from ...optimization.runtime.host_copy import copy_to_host, map_pages
from ...optimization.runtime.policy import get_policy, torch_settings
from .color import COLOR_CORRECTION_MODES, color_correct
from .dit import DiTInterrupted
from .dit.sequence_parallel import SequenceParallelDiT, TooFewWindows, stop_together
from .noise import SeededNoise
from .vae.row_parallel import TooFewRows, bands, decode_rows, encode_rows, gather_uneven
from .vae.tiling import plan_tiles

_log = logging.getLogger(__name__)

SIZE_MULTIPLE = 16          # VAE 8 x DiT patch 2
MIN_INPUT_SIDE = 8          # smaller inputs carry no content worth upscaling (and break the resize)
MIN_OUTPUT_SIDE = 16        # one 2x2 latent patch
MAX_OUTPUT_SIDE = 16384     # the nodes' resolution widgets end here
TIMESTEP = 1000.0


class SeedVR2InputError(ValueError):
    """Bad input or settings given to the pipeline; the message says what to change."""


# ------------------------------------------------------------------------------------------- settings
@dataclass
class VAETiling:
    """Spatial tiling of the VAE (docs/SPEC.md §7; not exact, unlike the VAE's own temporal slicing).

    ``encode``/``decode``: ``"auto"`` (tile only when the estimate says the frame does not fit into free
    memory), ``"on"`` or ``"off"``. ``*_tile``: tile edge in output pixels (encode: input pixels), 0 =
    choose from free memory. ``overlap``: pixels shared by neighbouring tiles, blended linearly.
    """
    encode: str = "auto"
    decode: str = "auto"
    encode_tile: int = 0
    decode_tile: int = 0
    overlap: int = 64

    def __post_init__(self):
        for name in ("encode", "decode"):
            if getattr(self, name) not in ("auto", "on", "off"):
                raise SeedVR2InputError(f"VAE tiling {name} must be auto/on/off, got {getattr(self, name)!r}")


@dataclass
class UpscaleSettings:
    resolution: int = 1080          # shortest edge of the output (used when scale_factor == 0)
    scale_factor: float = 0.0       # > 0: output = input * scale_factor
    max_resolution: int = 0         # cap on the longest output edge (0 = none); resolution mode only
    batch_size: int = 5             # frames per temporal chunk, 4n+1
    temporal_overlap: int = 0       # frames shared by consecutive chunks (blended linearly)
    color_correction: str = "wavelet"
    seed: int = 42
    tiling: VAETiling = field(default_factory=VAETiling)


@dataclass
class PipelineHooks:
    """Called between the phases so the caller can load/offload models (e.g. ComfyUI's model manager)."""
    before_encode: Callable[[], None] = lambda: None
    before_dit: Callable[[], None] = lambda: None
    after_dit: Callable[[], None] = lambda: None
    before_decode: Callable[[], None] = lambda: None


# ------------------------------------------------------------------------------------------- sizes
def _round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5))


def compute_target_size(height: int, width: int, resolution: int = 1080, scale_factor: float = 0.0,
                        max_resolution: int = 0) -> tuple[int, int]:
    """Exact output size (H, W); see the module docstring for the rule."""
    if height < MIN_INPUT_SIDE or width < MIN_INPUT_SIDE:
        raise SeedVR2InputError(
            f"input frames are {width}x{height} pixels; SeedVR2 needs at least {MIN_INPUT_SIDE}x{MIN_INPUT_SIDE}.")
    if scale_factor and scale_factor > 0:
        th, tw = _round_half_up(height * scale_factor), _round_half_up(width * scale_factor)
    else:
        if resolution <= 0:
            raise SeedVR2InputError(f"resolution must be positive, got {resolution}")
        short, long_ = min(height, width), max(height, width)
        long_t = _round_half_up(long_ * resolution / short)
        if max_resolution and max_resolution > 0 and long_t > max_resolution:
            long_t = max_resolution
            short_t = _round_half_up(short * max_resolution / long_)
        else:
            short_t = resolution
        th, tw = (short_t, long_t) if height <= width else (long_t, short_t)
    if th < MIN_OUTPUT_SIDE or tw < MIN_OUTPUT_SIDE:
        raise SeedVR2InputError(
            f"the output would be {tw}x{th} pixels; SeedVR2 needs at least {MIN_OUTPUT_SIDE}x{MIN_OUTPUT_SIDE}. "
            f"Raise resolution/scale_factor.")
    if max(th, tw) > MAX_OUTPUT_SIDE:
        raise SeedVR2InputError(
            f"the output would be {tw}x{th} pixels; the longest side may be at most {MAX_OUTPUT_SIDE}. Lower "
            f"{'scale_factor' if scale_factor and scale_factor > 0 else 'resolution or set max_resolution'}.")
    return th, tw


def model_size(th: int, tw: int) -> tuple[int, int]:
    """Target size rounded up to the multiple of 16 pixels the VAE + DiT patching need."""
    return (-(-th // SIZE_MULTIPLE) * SIZE_MULTIPLE, -(-tw // SIZE_MULTIPLE) * SIZE_MULTIPLE)


def next_4n1(n: int) -> int:
    return ((max(n, 1) - 1 + 3) // 4) * 4 + 1


def check_batch_settings(batch_size: int, temporal_overlap: int) -> None:
    if batch_size < 1 or (batch_size - 1) % 4 != 0:
        lower = max(1, ((batch_size - 1) // 4) * 4 + 1)
        raise SeedVR2InputError(
            f"batch_size must be 4n+1 (1, 5, 9, 13, 17, 21, ...), got {batch_size}; use {lower} or {lower + 4}.")
    if temporal_overlap < 0 or (temporal_overlap >= batch_size and batch_size > 1) or \
            (batch_size == 1 and temporal_overlap != 0):
        raise SeedVR2InputError(
            f"temporal_overlap must be between 0 and batch_size - 1 = {batch_size - 1}, got {temporal_overlap}.")


def plan_chunks(num_frames: int, batch_size: int, temporal_overlap: int) -> list[tuple[int, int]]:
    """Half-open frame ranges; consecutive ones share ``temporal_overlap`` frames (the last may be shorter
    but always has more than ``temporal_overlap`` frames)."""
    check_batch_settings(batch_size, temporal_overlap)
    stride = batch_size - temporal_overlap
    chunks, start = [], 0
    while True:
        end = min(start + batch_size, num_frames)
        chunks.append((start, end))
        if end >= num_frames:
            return chunks
        start += stride


def blend_ramp(o: int) -> torch.Tensor:
    """The later chunk's weights over an overlap of ``o`` frames, (j + 1) / (o + 1); the earlier one gets the rest."""
    return torch.arange(1, o + 1, dtype=torch.float32) / (o + 1)


def chunk_blend_weights(chunks: Sequence[tuple[int, int]], temporal_overlap: int) -> list[torch.Tensor]:
    """Per-chunk frame weights: linear cross-fades over each overlap; weights sum to 1 on every frame.

    In an overlap of o frames, the later chunk gets (j+1)/(o+1) on its j-th frame, the earlier one the rest.
    """
    o = temporal_overlap
    ramp = blend_ramp(o)
    out = []
    for i, (s, e) in enumerate(chunks):
        w = torch.ones(e - s, dtype=torch.float32)
        if o > 0 and i > 0:
            w[:o] = ramp
        if o > 0 and i + 1 < len(chunks):
            w[e - s - o:] = w[e - s - o:] * (1.0 - ramp)
        out.append(w)
    return out


def _check_frames(frames: torch.Tensor) -> None:
    if not isinstance(frames, torch.Tensor):
        raise SeedVR2InputError(f"frames must be a torch tensor (T, H, W, C), got {type(frames).__name__}")
    if frames.dim() == 3:
        raise SeedVR2InputError("frames must be (T, H, W, C); got a 3-D tensor (add the frame axis)")
    if frames.dim() != 4:
        raise SeedVR2InputError(f"frames must be (T, H, W, C), got shape {tuple(frames.shape)}")
    if frames.shape[0] == 0:
        raise SeedVR2InputError("no frames to upscale: the image batch is empty (0 frames).")
    if frames.shape[-1] not in (3, 4):
        raise SeedVR2InputError(f"frames must have 3 (RGB) or 4 (RGBA) channels, got {frames.shape[-1]}")


@dataclass(frozen=True)
class RunPlan:
    """What one upscale run works on (``plan``): exact output size, the size the models see, the temporal chunks
    with their blend weights, and the VAE tiling settings."""
    frames: int                            # input frames
    target: tuple[int, int]                # (th, tw): the returned frames' size
    model: tuple[int, int]                 # (ph, pw): target rounded up to SIZE_MULTIPLE, what the VAE encodes
    chunks: list[tuple[int, int]]          # half-open frame ranges (plan_chunks)
    weights: list[torch.Tensor]            # per-chunk frame blend weights (chunk_blend_weights)
    tiling: VAETiling

    @property
    def chunk_frames(self) -> int:
        """Frames of the longest chunk (the first), before padding to 4n+1."""
        s, e = self.chunks[0]
        return e - s

    def vae_tiles(self, kind: str, free_bytes: Callable[[], Optional[int]], dtype: torch.dtype,
                  config) -> tuple[int, int]:
        """(tile, overlap) of one VAE ``kind`` ("encode" / "decode") call on a model-size frame, as
        ``vae/tiling.py``'s ``plan_tiles`` decides from these settings and ``free_bytes()`` at that moment."""
        t = self.tiling
        tile = t.encode_tile if kind == "encode" else t.decode_tile
        mode = t.encode if kind == "encode" else t.decode
        return plan_tiles(kind, mode, tile, t.overlap, self.model[0], self.model[1], free_bytes, dtype, config)


def plan(frames: torch.Tensor, settings: UpscaleSettings) -> RunPlan:
    """Checks ``frames`` (T, H, W, C) and ``settings`` (SeedVR2InputError saying what to change) and computes the
    run's sizes, chunks and tiling settings; touches no model."""
    s = settings
    _check_frames(frames)
    if s.color_correction not in COLOR_CORRECTION_MODES:
        raise SeedVR2InputError(f"color_correction must be one of {', '.join(COLOR_CORRECTION_MODES)}, "
                                f"got {s.color_correction!r}")
    T, H, W, _ = frames.shape
    target = compute_target_size(H, W, s.resolution, s.scale_factor, s.max_resolution)
    chunks = plan_chunks(T, s.batch_size, s.temporal_overlap)
    return RunPlan(T, target, model_size(*target), chunks, chunk_blend_weights(chunks, s.temporal_overlap), s.tiling)


# ------------------------------------------------------------------------------------------- helpers
def resize_frames(x: torch.Tensor, th: int, tw: int) -> torch.Tensor:
    """(N, C, H, W) in [0, 1] -> (N, C, th, tw), bicubic (antialiased when shrinking), clamped."""
    if x.shape[-2:] == (th, tw):
        return x
    shrink = th < x.shape[-2] or tw < x.shape[-1]
    y = F.interpolate(x, size=(th, tw), mode="bicubic", align_corners=False, antialias=shrink)
    return y.clamp_(0.0, 1.0)


def pad_frames_4n1(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Pad along ``dim`` to 4n+1 by repeating the last frame (official ``cut_videos``)."""
    n = x.shape[dim]
    target = next_4n1(n)
    if target == n:
        return x
    last = x.narrow(dim, n - 1, 1)
    reps = [1] * x.dim()
    reps[dim] = target - n
    return torch.cat([x, last.repeat(*reps)], dim=dim)


class SeedVR2Cancelled(RuntimeError):
    """``should_stop()`` returned True."""


def _stop_checker(should_stop):
    """Wrap a ``should_stop`` that may raise (ComfyUI's interrupt check) or return True (-> raise);
    the wrapper returns False otherwise, so the models (which accept either style) keep going."""
    if should_stop is None:
        return lambda: False

    def check():
        if should_stop():
            raise SeedVR2Cancelled("SeedVR2 upscale cancelled")
        return False
    return check


_LOGGED: set = set()


def _log_once(line: str) -> None:
    if line not in _LOGGED:
        _LOGGED.add(line)
        _log.info(line)


def _agreed_stop(should_stop, group, device) -> Callable[[], bool]:
    """``should_stop`` asked by every rank of ``group`` at the same point (``stop_together``): all raise
    SeedVR2Cancelled (the asking rank its own exception) if any rank asks to stop."""
    def check():
        if stop_together(should_stop, group, device):
            raise SeedVR2Cancelled("SeedVR2 upscale cancelled")
        return False
    return check


# ------------------------------------------------------------------------------------------- model calls
class SeedVR2Runner:
    """Runs the models: ``dit`` a ``models.seedvr2.dit.NaDiT``, ``vae`` a ``models.seedvr2.vae.VideoAutoencoder``."""

    def __init__(self, dit, vae, text_embedding: torch.Tensor, device=None, dit_dtype=None, vae_dtype=None,
                 offload_device="cpu", should_stop: Optional[Callable[[], None]] = None,
                 free_memory: Optional[Callable[[], int]] = None, group=None):
        self.dit, self.vae = dit, vae
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.dit_dtype = dit_dtype or next(dit.parameters()).dtype
        self.vae_dtype = vae_dtype or vae.dtype
        self.offload_device = torch.device(offload_device)
        self.should_stop = self.dit_should_stop = _stop_checker(should_stop)
        self.group = group
        if group is not None:
            # sequence parallel: the DiT's windows and the VAE's rows split over the ranks, which stop together
            flag_device = self.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
            self.should_stop = _agreed_stop(self.dit_should_stop, group, flag_device)   # the DiT agrees per block
            self.dit = SequenceParallelDiT(dit, group)
        self.free_memory = free_memory
        self.scaling_factor = float(vae.scaling_factor)
        if text_embedding is None:
            raise SeedVR2InputError("SeedVR2 needs the positive text embedding (pos_emb); none was given.")
        self.txt = text_embedding
        self.policy = get_policy(self.device)

    @contextlib.contextmanager
    def _model_call(self, dtype):
        """One model call: autocast on CUDA for reduced precision, as the official script (bf16 autocast), and the
        hardware policy's TF32 / cuDNN settings, restored afterwards."""
        cast = self.device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
        with torch_settings(self.policy), (torch.autocast("cuda", dtype=dtype) if cast else contextlib.nullcontext()):
            yield

    def free_bytes(self) -> Optional[int]:
        """Free device memory now, the allocator's unused blocks included (the caller's ``free_memory`` if given),
        None where unknown (CPU)."""
        if self.free_memory is not None:
            return int(self.free_memory())
        if self.device.type == "cuda" and torch.cuda.is_available():
            return free_device_bytes(self.device)
        return None

    def encode(self, x: torch.Tensor, tile: int = 0, overlap: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """x (1, 3, T, H, W) in [-1, 1] -> mean, logvar (1, 16, t, H/8, W/8), float32; spatial tiles of ``tile``
        pixels overlapping by ``overlap`` when ``tile`` > 0."""
        x = x.to(self.device, self.vae_dtype)
        self.should_stop()
        with torch.no_grad(), self._model_call(self.vae_dtype):
            post = self._rows(encode_rows, x) if self.group is not None else None    # a band of rows per rank
            if post is None and tile:
                post = self.vae.encode_tiled(x, tile, overlap, should_stop=self.should_stop)
            elif post is None:
                post = self.vae.encode(x, should_stop=self.should_stop)
        return post.mean.float(), post.logvar.float()

    def decode(self, z: torch.Tensor, tile: int = 0, overlap: int = 0) -> torch.Tensor:
        """z (1, 16, t, h, w) (unscaled) -> pixels (1, 3, 4(t-1)+1, 8h, 8w) in about [-1, 1]; spatial tiles of
        ``tile`` latents overlapping by ``overlap`` when ``tile`` > 0."""
        z = z.to(self.device, self.vae_dtype)
        self.should_stop()
        with torch.no_grad(), self._model_call(self.vae_dtype):
            out = self._rows(decode_rows, z) if self.group is not None else None
            if out is not None:
                return out
            if tile:
                return self.vae.decode_tiled(z, tile, overlap, should_stop=self.should_stop)
            return self.vae.decode(z, should_stop=self.should_stop)

    def _rows(self, split_call, x):
        """``split_call`` (encode_rows / decode_rows) over the group, or None where the frame has too few rows for
        the ranks (known on every rank alike, before any collective): the caller then runs the whole call."""
        try:
            return split_call(self.vae, x, self.group, should_stop=self.should_stop)
        except TooFewRows as exc:
            _log_once(f"[SeedVR2-BW] sequence parallel: {exc}; every rank runs the whole VAE call")
            return None

    def frame_band(self, n: int) -> tuple[int, int]:
        """The frames [f0, f1) of ``n`` this rank colour-corrects and blends: a band of them under a group, all of
        them alone or where there are fewer frames than ranks."""
        if self.group is None or n < dist.get_world_size(self.group):
            return 0, n
        return bands(n, dist.get_world_size(self.group))[dist.get_rank(self.group)]

    def dit_step(self, lq_latent: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """One Euler step at t = 1000. lq_latent, noise: (t, h, w, 16) -> x_0 (t, h, w, 16) float32."""
        self.should_stop()
        t, h, w, c = lq_latent.shape
        dev, dt = self.device, self.dit_dtype
        x_t = noise.to(dev, torch.float32)
        cond = torch.cat([lq_latent.to(dev, torch.float32), torch.ones(t, h, w, 1, device=dev)], dim=-1)
        vid = torch.cat([x_t, cond], dim=-1).reshape(-1, 2 * c + 1).to(dt)
        txt = self.txt.to(dev, dt)
        vid_shape = torch.tensor([[t, h, w]], dtype=torch.long, device=dev)
        txt_shape = torch.tensor([[txt.shape[0]]], dtype=torch.long, device=dev)
        timestep = torch.tensor([TIMESTEP], device=dev, dtype=dt)
        with torch.no_grad(), self._model_call(dt):
            args = dict(vid=vid, txt=txt, vid_shape=vid_shape, txt_shape=txt_shape, timestep=timestep)
            try:
                v = self.dit(**args, should_stop=self.dit_should_stop)
            except DiTInterrupted as exc:     # the ranks' agreed stop inside a sequence-parallel step
                raise SeedVR2Cancelled("SeedVR2 upscale cancelled") from exc
            except TooFewWindows as exc:      # every rank alike, before any collective: each runs the whole step
                _log_once(f"[SeedVR2-BW] sequence parallel: {exc}; every rank runs the whole DiT step")
                v = self.dit.model(**args, should_stop=self.should_stop)
        v = v.float().reshape(t, h, w, c)
        return x_t - (TIMESTEP / 1000.0) * v


# ------------------------------------------------------------------------------------------- main entry
def upscale(frames: torch.Tensor, dit, vae, text_embedding: torch.Tensor, settings: UpscaleSettings = None,
            device=None, dit_dtype=None, vae_dtype=None, offload_device="cpu", output_device="cpu",
            should_stop: Optional[Callable[[], None]] = None,
            progress: Optional[Callable[[int, int], None]] = None,
            hooks: Optional[PipelineHooks] = None,
            free_memory: Optional[Callable[[], int]] = None, frame_group: int = 8, memory=None,
            group=None) -> torch.Tensor:
    """Upscale ``frames`` (T, H, W, C in [0, 1], C = 3 or 4) -> (T, th, tw, C) float32 on ``output_device``.

    ``should_stop()`` is called between chunks/tiles (and handed to the models);
    it must raise to stop (or return True). ``progress(done, total)`` is called after each chunk of each
    phase. ``frame_group``: frames resized / colour-corrected at a time (bounds device temporaries).
    ``memory``: the run's ``memory.MemoryPlan``; its settings replace ``settings`` and its VAE tiles are used for
    every call (without one, each VAE call sizes its tiles from the free memory at that moment).
    ``group``: a torch.distributed process group whose ranks all call ``upscale`` with the same arguments (sequence
    parallel: each runs a share of every DiT step and a band of rows of every VAE call; all return the whole output).
    """
    s = memory.settings if memory is not None else (settings or UpscaleSettings())
    hooks = hooks or PipelineHooks()
    p = plan(frames, s)
    T, H, W, C = frames.shape
    (th, tw), (ph, pw), chunks = p.target, p.model, p.chunks
    runner = SeedVR2Runner(dit, vae, text_embedding, device, dit_dtype, vae_dtype, offload_device,
                           should_stop, free_memory, group)
    dev, off = runner.device, torch.device(offload_device)
    total = 3 * len(chunks)
    _log.info("[SeedVR2-BW] %d frame(s) %dx%d -> %dx%d (model %dx%d), %d chunk(s) of <= %d frames, overlap %d",
              T, W, H, tw, th, pw, ph, len(chunks), s.batch_size, s.temporal_overlap)

    sub = max(1, int(frame_group))
    planned = memory is not None and memory.budget is not None      # the plan chose the conv bands
    # Without a plan each call's tiles fit the official-band estimate in 0.8 of the free memory (vae/tiling.py), and
    # on NDHWC whole convs peak within 1.1x that estimate (docs/PERFORMANCE.md §3): they run whole, as a plan would
    # choose (a sequence-parallel rank's band runs in one pass either way)
    whole = not planned and vae.layout_on(dev) == torch.channels_last_3d
    if planned or whole:
        vae.set_memory_limit(memory.vae_conv_bytes / 2**30 if planned and memory.vae_conv_bytes else None,
                             vae.config.norm_max_mem)
    try:
        return _run(frames, p, s, runner, vae, hooks, dev, off, output_device, memory, sub, total, progress)
    finally:
        if planned or whole:
            vae.set_memory_limit(vae.config.conv_max_mem, vae.config.norm_max_mem)


def _run(frames, p: RunPlan, s: UpscaleSettings, runner: SeedVR2Runner, vae, hooks: PipelineHooks, dev, off,
         output_device, memory, sub: int, total: int, progress) -> torch.Tensor:
    """The three phases of ``upscale`` on its plan."""
    T, H, W, C = frames.shape
    (th, tw), (ph, pw), chunks, weights = p.target, p.model, p.chunks, p.weights
    stop = runner.should_stop
    done = 0
    out_dev = torch.device(output_device)
    # the output's pages are mapped on a thread while the GPU works (host_copy.map_pages)
    out = torch.empty(T, th, tw, 3, dtype=torch.float32, device=out_dev)
    mapped = map_pages(out) if out_dev.type == "cpu" else None
    # the posterior's and the DiT's noise of each chunk's latent shape, drawn ahead (SeededNoise)
    sf, tf, lc = vae.spatial_factor, vae.temporal_factor, vae.config.latent_channels
    latents = [((next_4n1(e0 - s0) - 1) // tf + 1, ph // sf, pw // sf) for s0, e0 in chunks]
    eps_of = SeededNoise(s.seed, 1, [(1, lc) + t for t in latents])
    noise_of = SeededNoise(s.seed, 0, [t + (lc,) for t in latents])

    def tick():
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    def resized_rgb(s0, e0):
        x = frames[s0:e0, :, :, :3].to(dev, torch.float32).permute(0, 3, 1, 2)
        return resize_frames(x, th, tw)  # (n, 3, th, tw) in [0, 1]

    def vae_input(s0, e0):
        """(1, 3, T', ph, pw) in [-1, 1], VAE dtype; built ``sub`` frames at a time to bound float32 temporaries."""
        n = e0 - s0
        x = torch.empty(1, 3, next_4n1(n), ph, pw, device=dev, dtype=runner.vae_dtype)
        for i in range(0, n, sub):
            part = resized_rgb(s0 + i, min(s0 + i + sub, e0))
            if (ph, pw) != (th, tw):
                part = F.pad(part, (0, pw - tw, 0, ph - th), mode="replicate")
            x[0, :, i:i + part.shape[0]] = (part * 2.0 - 1.0).permute(1, 0, 2, 3)
        if x.shape[2] > n:  # 4n+1: repeat the last frame
            x[0, :, n:] = x[0, :, n - 1:n]
        return x

    # phase 1: encode + posterior sample
    hooks.before_encode()
    lq_latents = []
    for ci, (s0, e0) in enumerate(chunks):
        stop()
        x = vae_input(s0, e0)
        tiles = memory.encode_tiles if memory is not None else \
            p.vae_tiles("encode", runner.free_bytes, runner.vae_dtype, vae.config)
        mean, logvar = runner.encode(x, *tiles)
        eps = eps_of(mean.shape).to(mean.device)
        z = (mean + torch.exp(0.5 * logvar) * eps) * runner.scaling_factor
        lq_latents.append(z[0].permute(1, 2, 3, 0).contiguous().to(off))  # (t, h, w, 16)
        del x, mean, logvar, eps, z
        tick()

    # phase 2: one DiT step per chunk
    hooks.before_dit()
    samples = []
    try:
        for ci, lq in enumerate(lq_latents):
            stop()
            noise = noise_of(lq.shape)
            samples.append(runner.dit_step(lq, noise).to(off))
            tick()
    finally:
        hooks.after_dit()
    del lq_latents

    # phase 3: decode, crop, colour-correct, blend
    hooks.before_decode()
    # frames are copied into place the first time and added the second (chunk overlaps): no host temporary per part
    # (on a host output it costs more than the copy, e.g. 0.5 GB at 1080p x 21)
    if mapped is not None:
        mapped.join()
    written = [False] * T

    def put(first: int, part: torch.Tensor) -> None:
        n = part.shape[0]
        if not any(written[first:first + n]):
            copy_to_host(out[first:first + n], part)
        else:
            for j in range(n):
                if written[first + j]:
                    out[first + j] += part[j].to(out_dev)
                else:
                    copy_to_host(out[first + j], part[j])
        written[first:first + n] = [True] * n
    for ci, ((s0, e0), x0) in enumerate(zip(chunks, samples)):
        stop()
        z = (x0.to(dev) / runner.scaling_factor).permute(3, 0, 1, 2).unsqueeze(0)  # (1, 16, t, h, w)
        tiles = memory.decode_tiles if memory is not None else \
            p.vae_tiles("decode", runner.free_bytes, runner.vae_dtype, vae.config)
        px = runner.decode(z, *tiles)[0]                                            # (3, T', ph, pw)
        n = e0 - s0
        if px.shape[1] < n:
            raise RuntimeError(f"VAE decoded {px.shape[1]} frames for a chunk of {n}")
        # sequence parallel: each rank finishes a band of the frames and they are gathered (frames are independent)
        f0, f1 = runner.frame_band(n)
        mine = []
        for i in range(f0, f1, sub):
            k = min(sub, f1 - i)
            part = px[:, i:i + k, :th, :tw].permute(1, 0, 2, 3).float()              # (k, 3, th, tw)
            part = (part.clamp(-1.0, 1.0) + 1.0) * 0.5
            part = color_correct(part, resized_rgb(s0 + i, s0 + i + k), s.color_correction)
            w = weights[ci][i:i + k].to(part.device).reshape(-1, 1, 1, 1)
            part = (part * w).permute(0, 2, 3, 1)
            if (f0, f1) == (0, n):
                put(s0 + i, part)
            else:
                mine.append(part)
            del part
        if (f0, f1) != (0, n):
            put(s0, gather_uneven(torch.cat(mine), 0, runner.group))
            del mine
        samples[ci] = None
        del px, z
        tick()
    if not all(written):
        raise RuntimeError(f"the decoded chunks left frames {[i for i, w in enumerate(written) if not w][:8]} empty")
    out.clamp_(0.0, 1.0)

    if C == 4:
        alpha = frames[..., 3:].to(dev, torch.float32).permute(0, 3, 1, 2)
        alpha = resize_frames(alpha, th, tw).permute(0, 2, 3, 1).to(out_dev)
        out = torch.cat([out, alpha], dim=-1)
    return out
