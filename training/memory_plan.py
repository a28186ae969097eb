"""The memory plan of a FLUX LoRA training run, made before anything is loaded, from the VRAM and host RAM it may
use: base precision (as loaded / fp8 / NVFP4), blocks to swap, selective-checkpointing budget, batch size within
the user's limit. Every choice the user fixed is kept; when nothing fits, ``TrainMemoryError`` names the smallest
settings that would.

Pure arithmetic on the model's dimensions (``FluxDims``) and a ``DeviceBudget`` (a fake one in the tests). The
constants are estimates from docs/PERFORMANCE.md §6 (full FLUX.1, rank 16, 1024², batch 1, H100/H200) and are to
be calibrated on smaller cards with ``scripts/bench_flux_lora.py --budgets``: peaks bf16 38.2 / 25.2 GiB
(selective / full checkpointing), fp8 base 28.2 / 15.1, NVFP4 base 23.4; steps 0.433 / 0.556 s (bf16),
0.405 / 0.507 s (fp8), 0.510 s (NVFP4, selective).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..optimization.blockswap.config import spread_indices
from ..optimization.runtime.device import available_host_bytes
from ..optimization.runtime.policy import get_policy

GiB = 1 << 30
MiB = 1 << 20

# Estimates to calibrate (see the module docstring). Bytes per block parameter by base precision: fp8 has one
# scale per tensor, NVFP4 one e4m3 scale per 16 values.
WEIGHT_BYTES = {"fp8": 1.0, "nvfp4": 0.5 + 1 / 16}
# Working memory a quantized base adds (fp8: per-token activation copies and a transposed weight; NVFP4: one
# block's dequantized weights kept from the recompute for its backward): fitted to the measured peaks above.
PRECISION_EXTRA = {"as_loaded": 0, "fp8": 512 * MiB, "nvfp4": 400 * MiB}
LORA_BYTES_PER_PARAM = 18      # fp32 master + fp32 grad + AdamW's two fp32 moments + the compute-dtype cast
RECOMPUTE_BLOCKS = 3           # one block's recompute and backward hold about 3x its kept outputs
NO_CKPT_FACTOR = 2.5           # without checkpointing a block keeps ~2.5x what selective checkpointing keeps (unmeasured)
HEADROOM = 2 * GiB             # cuBLAS/cuDNN workspaces and allocator fragmentation (as selective_checkpoint.py)
HOST_MARGIN = 2 * GiB          # host RAM left to the OS and ComfyUI
TEXT_TOKENS = 256              # ComfyUI pads T5 to 256 tokens
# Seconds per step at 1024², batch 1 on an H100 (§6): (full checkpointing, every block selective).
STEP_S = {"as_loaded": (0.556, 0.433), "fp8": (0.507, 0.405), "nvfp4": (0.610, 0.510)}
FP8_WITHOUT_TENSORCORES = 1.3  # the fp8 base dequantizes per call where FP8 GEMMs are not available (estimate)
# pinned host->GPU rate a swapped step reaches: 14.2-16.7 GB/s on an H100 (PERFORMANCE §6, budget rows: each
# swapped step took its swapped blocks' bytes twice over at that rate), below the link's nominal 20+
HOST_LINK_BYTES_S = 15e9
SWAP_SLOWDOWN = 1.2            # BlockSwap turns CUDA graphs off: §6 measured graphs 1.17-1.22x faster
# A swapped step costs this much more than both bounds above: §6's budget rows took 0.72-0.86 s with 4.4 to 6.6 GB
# streamed (fp8 and NVFP4 alike), flat in the bytes, where compute and copy each predict 0.5-0.7 s
SWAP_OVERHEAD_S = 0.15
REF_TOKENS = 4096 + TEXT_TOKENS
# A lower base precision is chosen only where it is estimated this much faster (it changes the base's numerics).
PRECISION_PREFERENCE = {"as_loaded": 1.0, "fp8": 1.15, "nvfp4": 1.3}


class TrainMemoryError(ValueError):
    """No setting fits the memory this run may use; the message names settings that would."""


@dataclass(frozen=True)
class FluxDims:
    """What the plan needs of a FLUX model (defaults: FLUX.1)."""
    hidden: int = 3072
    mlp_ratio: float = 4.0
    heads: int = 24
    double_blocks: int = 19
    single_blocks: int = 38
    other_params: int = 70_000_000     # embedders and final layer, resident in their stored dtype
    stored_bytes: float = 2.0          # bytes per parameter as loaded (bf16 2, fp8 1)
    patch: int = 2

    def double_params(self) -> int:
        h, m = self.hidden, self.mlp_ratio
        return int(2 * (4 + 2 * m + 6) * h * h)        # per stream: qkv, proj, mlp in/out, modulation (6h)

    def single_params(self) -> int:
        h, m = self.hidden, self.mlp_ratio
        return int((3 + m) * h * h + (1 + m) * h * h + 3 * h * h)   # linear1, linear2, modulation (3h)

    def block_params(self) -> list:
        """Parameters per block in run order (double blocks, then single blocks)."""
        return [self.double_params()] * self.double_blocks + [self.single_params()] * self.single_blocks

    def lora_params(self, rank: int) -> int:
        """Parameters of a rank-``rank`` LoRA on the kohya targets (10 Linears per double block, 3 per single)."""
        h, m = self.hidden, self.mlp_ratio
        per_stream = (h + 3 * h) + 2 * h + 2 * (h + m * h) + (h + 6 * h)
        single = (h + (3 + m) * h) + ((1 + m) * h + h) + 4 * h
        return int(rank * (2 * per_stream * self.double_blocks + single * self.single_blocks))

    def kept_bytes(self, batch: int, t_img: int, rank: int, elem: int = 2) -> list:
        """Bytes selective checkpointing keeps per block (GEMM outputs with their LoRA down-projections, attention
        output and log-sum-exp), as ``selective_checkpoint.saved_bytes`` counts them on a real block."""
        h, m, t_txt = self.hidden, self.mlp_ratio, TEXT_TOKENS
        t = t_img + t_txt
        stream = (3 * h + h + m * h + h + 4 * rank)
        attn = t * h * elem + self.heads * t * 4
        double = batch * ((t_img + t_txt) * stream * elem + attn)
        single = batch * (t * ((3 + m) * h + h + 2 * rank) * elem + attn)
        return [int(double)] * self.double_blocks + [int(single)] * self.single_blocks


def flux_dims(dm) -> FluxDims:
    """The ``FluxDims`` of a ComfyUI FLUX ``diffusion_model`` (shapes only: nothing moves)."""
    blocks = list(dm.double_blocks) + list(dm.single_blocks)
    in_blocks = sum(p.numel() for b in blocks for p in b.parameters())
    total = sum(p.numel() for p in dm.parameters())
    first = next(p for b in blocks for p in b.parameters() if p.dim() == 2)
    hidden = int(dm.hidden_size)
    mlp = getattr(dm.single_blocks[0], "mlp_hidden_dim", 4 * hidden) if len(dm.single_blocks) else 4 * hidden
    return FluxDims(hidden=hidden, mlp_ratio=mlp / hidden, heads=int(dm.num_heads),
                    double_blocks=len(dm.double_blocks), single_blocks=len(dm.single_blocks),
                    other_params=int(total - in_blocks), stored_bytes=float(first.element_size()),
                    patch=int(getattr(dm, "patch_size", 2)))


@dataclass(frozen=True)
class DeviceBudget:
    """``vram``: bytes the run may use on the GPU (None: CPU, nothing to plan); ``host``: free host RAM (0: not
    known, not checked); what the GPU computes fast: FP8 GEMMs, NVFP4 dequantization (Triton)."""
    vram: int | None
    host: int = 0
    fp8_tensorcores: bool = True
    nvfp4: bool = True

    @classmethod
    def of(cls, device, vram: int | None) -> "DeviceBudget":
        """``vram`` bytes on ``device`` (None: nothing to plan), the free host RAM, and what the device's hardware
        policy computes fast."""
        device = torch.device(device)
        pol = get_policy(device) if device.type == "cuda" else None
        return cls(vram=vram, host=available_host_bytes() if vram is not None else 0,
                   fp8_tensorcores=bool(pol and pol.fp8_gemm), nvfp4=bool(pol and pol.nvfp4_gemm != "reference"))


@dataclass(frozen=True)
class PlanRequest:
    """The user's settings: ``base_precision`` auto | bf16 | fp8 | nvfp4, ``blocks_to_swap`` -1 (auto) or a count,
    ``selective`` auto | on | off, ``batch_size`` the limit; ``cache_bytes`` the cached latents/conditioning."""
    resolution: int = 1024
    batch_size: int = 1
    grad_accum: int = 1
    rank: int = 16
    base_precision: str = "auto"
    blocks_to_swap: int = -1
    selective: str = "auto"
    gradient_checkpointing: bool = True
    cache_bytes: int = 0
    buffers: int = 2


@dataclass(frozen=True)
class TrainPlan:
    precision: str                 # as_loaded | fp8 | nvfp4
    blocks_to_swap: int
    selective_blocks: int
    selective_budget: int | None   # bytes of kept outputs (None: no GPU, the trainer decides)
    batch_size: int
    grad_accum: int
    gpu_bytes: int
    host_bytes: int
    step_s: float                  # estimated, for ranking the candidates
    budget: int | None
    resolution: int = 1024

    def describe(self) -> str:
        ckpt = "full checkpointing" if self.selective_blocks == 0 else f"selective checkpointing on {self.selective_blocks} blocks"
        return (f"base {self.precision.replace('_', ' ')}, {self.blocks_to_swap} blocks swapped, {ckpt}, "
                f"batch {self.batch_size} x {self.grad_accum} accumulated, {self.resolution}²")

    def line(self) -> str:
        where = "no GPU budget (CPU): settings as given" if self.budget is None else \
            f"{self.gpu_bytes / GiB:.1f} of {self.budget / GiB:.1f} GiB VRAM, {self.host_bytes / GiB:.1f} GiB host, " \
            f"~{self.step_s:.2f} s/step (estimate)"
        return f"[FluxLoraTrain] memory plan: {self.describe()}; latents and text cached on the host; {where}"

    def apply(self, cfg):
        """``cfg`` (a ``TrainConfig``) with the plan's choices (same effective batch: batch x accumulation)."""
        sel = cfg.selective_checkpointing
        if self.budget is not None and str(sel).lower() == "auto":
            sel = "auto" if self.selective_blocks else "off"
        return dataclasses.replace(
            cfg, base_precision="auto" if self.precision == "as_loaded" else self.precision,
            blocks_to_swap=self.blocks_to_swap, batch_size=self.batch_size, grad_accum=self.grad_accum,
            selective_checkpointing=sel,
            selective_budget_gib=-1.0 if self.selective_budget is None else self.selective_budget / GiB)


def _precisions(req: PlanRequest, dev: DeviceBudget, dims: FluxDims) -> list:
    if req.base_precision in ("fp8", "nvfp4"):
        return [req.base_precision]
    if req.base_precision == "bf16":
        return ["as_loaded"]
    out = ["as_loaded"]
    if dims.stored_bytes > 1:
        out.append("fp8")
    if dev.nvfp4:
        out.append("nvfp4")
    return out


def _evaluate(dims, req, dev, precision, swap, batch, resolution, selective_cap=None):
    """The candidate's GPU/host bytes with as many selective blocks as fit (or None if it does not fit)."""
    n_blocks = dims.double_blocks + dims.single_blocks
    t_img = (resolution // (8 * dims.patch)) ** 2
    per_param = dims.stored_bytes if precision == "as_loaded" else WEIGHT_BYTES[precision]
    weights = [p * per_param for p in dims.block_params()]
    swapped = spread_indices(n_blocks, swap) if swap else []
    out = set(swapped)
    resident = sum(w for i, w in enumerate(weights) if i not in out)
    ring = req.buffers * max((weights[i] for i in swapped), default=0)
    kept = dims.kept_bytes(batch, t_img, req.rank)
    boundary = n_blocks * batch * (t_img + TEXT_TOKENS) * dims.hidden * 2
    fixed = (resident + ring + dims.other_params * dims.stored_bytes + PRECISION_EXTRA[precision]
             + dims.lora_params(req.rank) * LORA_BYTES_PER_PARAM)
    if req.gradient_checkpointing:
        acts = boundary + RECOMPUTE_BLOCKS * max(kept)
    else:
        acts = int(NO_CKPT_FACTOR * sum(kept))
    need = int(fixed + acts + HEADROOM)
    # the model's host copy is already in RAM; a quantized base adds its quantized blocks there (made on the host,
    # staging.py), the base as loaded its swapped blocks' pinned arenas (conservatively: staging repacks in place)
    host = int(req.cache_bytes + HOST_MARGIN + (sum(weights[i] for i in swapped) if precision == "as_loaded"
                                                else sum(weights) + sum(dims.block_params()) * dims.stored_bytes))
    if dev.vram is not None and need > dev.vram:
        return None
    if dev.host and host > dev.host:
        return None
    n_sel = 0
    if req.gradient_checkpointing and req.selective != "off":
        room = (dev.vram - need) if dev.vram is not None else 0
        n_sel, used = 0, 0
        for c in kept:
            if used + c > room:
                break
            used, n_sel = used + c, n_sel + 1
        if req.selective == "on":
            if n_sel < n_blocks:
                return None
        if selective_cap is not None:
            n_sel = min(n_sel, selective_cap)
        need += sum(kept[:n_sel])
    full_s, sel_s = STEP_S[precision]
    step = full_s - (full_s - sel_s) * n_sel / n_blocks
    if precision == "fp8" and not dev.fp8_tensorcores:
        step *= FP8_WITHOUT_TENSORCORES
    step *= batch * (t_img + TEXT_TOKENS) / REF_TOKENS
    if swap:
        copy = 2 * sum(weights[i] for i in swapped) / HOST_LINK_BYTES_S   # forward and backward recompute
        step = max(step * SWAP_SLOWDOWN, copy) + SWAP_OVERHEAD_S
    budget_sel = sum(kept[:n_sel]) if dev.vram is not None else None
    return TrainPlan(precision, swap, n_sel, budget_sel, batch, req.grad_accum * (req.batch_size // batch), need,
                     host, step, dev.vram, resolution)


def _candidates(dims, req, dev, resolution, precisions=None, swaps=None, batches=None):
    n_blocks = dims.double_blocks + dims.single_blocks
    precisions = precisions or _precisions(req, dev, dims)
    if swaps is None:
        swaps = [req.blocks_to_swap] if req.blocks_to_swap >= 0 else list(range(n_blocks + 1))
    if batches is None:
        batches = [b for b in range(req.batch_size, 0, -1) if req.batch_size % b == 0]
    for b in batches:
        found = []
        for p in precisions:
            for s in swaps:
                # BlockSwap needs checkpointing (trainer.py refuses the rest); it streams any base precision
                if s and not req.gradient_checkpointing:
                    continue
                plan = _evaluate(dims, req, dev, p, min(s, n_blocks), b, resolution)
                if plan is not None:
                    found.append(plan)
        if found:
            yield b, found


def plan_training(dims: FluxDims, req: PlanRequest, dev: DeviceBudget) -> TrainPlan:
    """The fastest estimated settings (``PRECISION_PREFERENCE`` weighing the base's precision) at the largest batch (a divisor of the limit, the rest accumulated) that fit;
    ``TrainMemoryError`` naming the smallest settings that would fit when none does."""
    if dev.vram is None:
        prec = {"bf16": "as_loaded", "auto": "as_loaded"}.get(req.base_precision, req.base_precision)
        return TrainPlan(prec, max(0, req.blocks_to_swap), 0, None, req.batch_size, req.grad_accum, 0, 0, 0.0,
                         None, req.resolution)
    for _, found in _candidates(dims, req, dev, req.resolution):
        return min(found, key=lambda p: p.step_s * PRECISION_PREFERENCE[p.precision])
    raise TrainMemoryError(_no_fit_message(dims, req, dev))


def smallest(dims: FluxDims, req: PlanRequest, dev: DeviceBudget, resolution: int) -> TrainPlan:
    """The settings needing the least VRAM at ``resolution`` (batch 1, full checkpointing), whatever fits."""
    free = dataclasses.replace(dev, vram=1 << 50, host=0)
    one = dataclasses.replace(req, batch_size=1, grad_accum=req.grad_accum * req.batch_size, selective="off")
    best = None
    for _, found in _candidates(dims, one, free, resolution, batches=[1]):
        for p in found:
            if best is None or p.gpu_bytes < best.gpu_bytes:
                best = p
    return best


def _no_fit_message(dims, req, dev) -> str:
    auto = dataclasses.replace(req, base_precision="auto", blocks_to_swap=-1, selective="auto")
    mine = smallest(dims, req, dev, req.resolution)
    least = smallest(dims, auto, dev, req.resolution)
    have = f"{dev.vram / GiB:.1f} GiB of VRAM" + (f" and {dev.host / GiB:.1f} GiB of host RAM" if dev.host else "")
    msg = f"FLUX LoRA training does not fit in {have} at {req.resolution}² (batch limit {req.batch_size})."
    if mine is not None:
        msg += (f" The smallest settings allowed by yours need {mine.gpu_bytes / GiB:.1f} GiB VRAM and "
                f"{mine.host_bytes / GiB:.1f} GiB host RAM: {mine.describe()}.")
    fixes = []
    if least is not None and (mine is None or least.gpu_bytes < mine.gpu_bytes):
        fixes.append(f"set base_precision, blocks_to_swap and selective_checkpointing to auto (smallest: "
                     f"{least.describe()}, {least.gpu_bytes / GiB:.1f} GiB)")
    for res in (768, 512):
        if res < req.resolution:
            p = smallest(dims, auto, dev, res)
            if p is not None and p.gpu_bytes <= dev.vram and (not dev.host or p.host_bytes <= dev.host):
                fixes.append(f"train at resolution {res} ({p.describe()}, {p.gpu_bytes / GiB:.1f} GiB)")
                break
    fixes.append("free VRAM / host RAM (close other programs, unload other models)")
    return msg + " Fix: " + "; or ".join(fixes) + "."
