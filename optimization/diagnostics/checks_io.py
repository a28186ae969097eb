"""IO vs compute for SeedVR2 3B and 7B on this GPU: would BlockSwap's copies hide behind the blocks' compute?

Per-block sizes come from the real state dicts (tests/data/keys_dit_*.json; ``tests/test_diagnostic.py`` checks
these constants against them). Times come from this run's measurements: copy time = block bytes / pinned H2D
bandwidth, compute time = block FLOPs / bf16 GEMM rate, a lower bound (a real block also runs norms, RoPE and attention
glue at lower efficiency). A full run on CUDA also measures one block of the pack's own DiT (random bf16 weights)
per case and bases the verdict on that.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..blockswap.config import default_reserve_bytes, plan_blockswap
from .result import FAIL, PASS, SKIP, WARN, CheckResult

SECTION = "IO vs compute"
GiB = 2**30
TEXT_TOKENS = 58


@dataclass(frozen=True)
class BlockGroup:
    count: int
    linear_weights: int   # elements of the 2-D projection weights (quantizable)
    other: int            # biases, norms, ada, rope buffers (kept in bf16)
    video_linear: int     # elements of the weights applied to video tokens
    text_linear: int      # elements of separate text-branch weights (0 for shared blocks)


@dataclass(frozen=True)
class DiTShape:
    name: str
    dim: int
    groups: tuple
    non_block: int        # elements outside the blocks (embeddings, in/out projections)

    @property
    def num_blocks(self) -> int:
        return sum(g.count for g in self.groups)


SEEDVR2_DITS = {
    "3B": DiTShape("SeedVR2-3B", 2560, (
        BlockGroup(10, 158_597_120, 36_373, 79_298_560, 79_298_560),   # blocks 0-9: separate vid/txt weights
        BlockGroup(22, 79_298_560, 18_197, 79_298_560, 0),             # blocks 10-31: shared ("all") weights
    ), 60_172_864),
    "7B": DiTShape("SeedVR2-7B", 3072, (
        BlockGroup(36, 226_492_416, 74_250, 113_246_208, 113_246_208),
    ), 83_208_256),
}

# bytes per element of the quantizable weights in each storage format (NVFP4: 4 bits + one e4m3 scale per 16)
STORAGE = {"bf16": 2.0, "fp8": 1.0, "nvfp4": 0.5625}


def block_bytes(g: BlockGroup, storage: str) -> int:
    return int(g.linear_weights * STORAGE[storage] + g.other * 2)


# (label, video tokens per forward, latent frames). Tokens: VAE 8x spatial, 4x temporal (4n+1 frames), patch 2x2.
CASES = (
    ("720p x 1 frame", 45 * 80, 1),
    ("1080p x 1 frame", 68 * 120, 1),
    ("720p x 21 frames", 45 * 80 * 6, 6),
    ("1080p x 21 frames", 68 * 120 * 6, 6),
)
# the same cases as (label, height, width, frames) for the measured block timing
CASE_FRAMES = {"720p x 1 frame": (720, 1280, 1), "1080p x 1 frame": (1080, 1920, 1),
               "720p x 21 frames": (720, 1280, 21), "1080p x 21 frames": (1080, 1920, 21)}
DIT_CONFIGS = {"3B": "SEEDVR2_3B", "7B": "SEEDVR2_7B"}


def measure_blocks(ctx, key: str) -> dict:
    """Measured ms per block for each case (full runs on CUDA only); {} when skipped, {'error': why} on failure."""
    if ctx.quick or getattr(ctx.device, "type", "") != "cuda":
        return {}
    try:
        from ...models.seedvr2 import dit as dit_mod
        from .block_timing import measure_block_ms
        cfg = getattr(dit_mod, DIT_CONFIGS[key])
        attention = getattr(ctx.measured.get("policy"), "attention", "auto") or "auto"
        return measure_block_ms(cfg, [(label, *CASE_FRAMES[label]) for label, _, _ in CASES], ctx.device,
                                reps=5, attention=attention)
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"}


def window_tokens(latent_frames: int) -> int:
    """Video tokens in one attention window: ~15x27 spatial (the adaptive 720p window), ceil(min(t,30)/4) frames."""
    return 15 * 27 * math.ceil(min(latent_frames, 30) / 4)


def block_flops(g: BlockGroup, dim: int, tokens: int, latent_frames: int) -> float:
    """FLOPs of one block's forward: the linears (2 per weight per token), attention (QK^T and PV: 4*dim per
    token pair, each window also attending to the text tokens) and the text branch."""
    w = window_tokens(latent_frames)
    video = tokens * (2 * g.video_linear + 4 * dim * (w + TEXT_TOKENS))
    windows = max(1, math.ceil(tokens / w))
    text_weights = g.text_linear or g.video_linear
    text = TEXT_TOKENS * 2 * text_weights + windows * TEXT_TOKENS * 4 * dim * (w + TEXT_TOKENS)
    return float(video + text)


def _plan(shape: DiTShape, storage: str, free_vram: int, total_vram: int):
    sizes = []
    for g in shape.groups:
        sizes += [block_bytes(g, storage)] * g.count
    other = int(shape.non_block * 2)
    return plan_blockswap(sizes, other, free_vram, default_reserve_bytes(total_vram))


def cuda_ready(ctx) -> bool:
    return ctx.is_cuda


def vram_info(ctx) -> tuple[int, int]:
    """(free, total) bytes of the device (tests monkeypatch this)."""
    import torch
    torch.cuda.empty_cache()  # the diagnostic's own cached blocks are not the user's
    return torch.cuda.mem_get_info(ctx.device)


def check_io_vs_compute(ctx) -> list[CheckResult]:
    if not cuda_ready(ctx):
        return [CheckResult(f"SeedVR2-{m} swap vs compute", SKIP, None, "", "no CUDA device") for m in SEEDVR2_DITS]
    bw = ctx.measured.get("h2d_pinned_gbps")
    rate = ctx.measured.get("bf16_tflops")
    if not bw or not rate:
        missing = [n for n, v in (("pinned H2D bandwidth", bw), ("bf16 GEMM rate", rate)) if not v]
        return [CheckResult(f"SeedVR2-{m} swap vs compute", SKIP, None, "", f"needs the {' and '.join(missing)} "
                            "measured above") for m in SEEDVR2_DITS]
    free, total = vram_info(ctx)
    out = []
    for key, shape in SEEDVR2_DITS.items():
        name = f"SeedVR2-{key} swap vs compute"
        biggest = max(shape.groups, key=lambda g: g.linear_weights)
        copy_ms = {s: block_bytes(biggest, s) / (bw * 1e9) * 1e3 for s in STORAGE}
        plans, plan_error = {}, None
        for s in STORAGE:
            try:
                plans[s] = _plan(shape, s, free, total)
            except Exception as exc:  # noqa: BLE001
                plan_error = f"{type(exc).__name__}: {exc}"
                break
        planned = plans["bf16"].blocks_to_swap if "bf16" in plans else 0
        nb = shape.num_blocks
        lines = ["per-block copy at the measured " + f"{bw:.1f} GB/s: " + ", ".join(
            f"{s} {block_bytes(biggest, s) / 2**20:.0f} MiB {copy_ms[s]:.2f} ms" for s in STORAGE)]
        if plan_error:
            lines.append(f"plan_blockswap failed: {plan_error}")
        else:
            lines.append(f"{free / GiB:.1f} GiB free, bf16 weights: {plans['bf16'].summary()}")
            lines.append("fp8 weights: " + plans["fp8"].summary() + " | NVFP4 weights: " + plans["nvfp4"].summary())
        cases = []
        measured = measure_blocks(ctx, key)
        if "error" in measured:
            lines.append(f"block timing failed ({measured['error']}): compute below is the GEMM-rate bound")
        elif measured:
            lines.append("compute = measured time of one block (the pack's DiT, random bf16 weights, attention "
                         f"{getattr(ctx.measured.get('policy'), 'attention', 'auto')}); in brackets the bound "
                         "FLOPs / bf16 GEMM rate")
        else:
            lines.append("compute = FLOPs / measured bf16 GEMM rate, a lower bound (a full run also times real blocks)")
        for label, tokens, frames in CASES:
            comp = sum(block_flops(g, shape.dim, tokens, frames) * g.count for g in shape.groups) / nb
            bound_ms = comp / (rate * 1e12) * 1e3
            got = measured.get(label)
            comp_ms = got if isinstance(got, float) else bound_ms
            s_free = {s: min(nb, int(nb * comp_ms / copy_ms[s])) for s in STORAGE}
            extra = max(0.0, planned * copy_ms["bf16"] - nb * comp_ms)   # copy-bound time added per forward
            cases.append({"case": label, "video_tokens": tokens, "compute_ms_per_block": comp_ms,
                          "compute_ms_bound": bound_ms,
                          "compute_ms_measured": got if isinstance(got, float) else None,
                          "measure_error": got if isinstance(got, str) else None,
                          "hidden": {s: comp_ms >= copy_ms[s] for s in STORAGE}, "free_swap_blocks": s_free,
                          "planned_swap_extra_ms": extra})
            verdict = ""
            if planned:
                verdict = (f" -> the planned {planned} bf16 swaps are hidden" if extra == 0 else
                           f" -> the planned {planned} bf16 swaps are copy-bound: +{extra:.0f} ms per forward")
            shown = (f"{comp_ms:.2f} ms/block [>= {bound_ms:.2f}]" if isinstance(got, float) else
                     f">= {bound_ms:.2f} ms/block" + (f" (not measured: {got})" if isinstance(got, str) else ""))
            lines.append(f"{label} ({tokens} tokens): compute {shown}; swaps hidden for up to "
                         + ", ".join(f"{s} {s_free[s]}" for s in STORAGE) + f" of {nb} blocks" + verdict)
        data = {"blocks": nb, "largest_block_bytes": {s: block_bytes(biggest, s) for s in STORAGE},
                "copy_ms_per_block": copy_ms, "h2d_pinned_gbps": bw, "bf16_tflops": rate, "free_vram_bytes": free,
                "cases": cases,
                "blockswap_plan": {s: {"blocks_to_swap": p.blocks_to_swap, "fits": p.fits, "summary": p.summary()}
                                   for s, p in plans.items()}}
        if plan_error:
            status, value = FAIL, None
        else:
            status, value = PASS, planned
            if not plans["bf16"].fits:
                status = WARN
                lines.append("bf16 weights do not fit even fully swapped: use fp8/NVFP4 weights or free VRAM")
            elif planned and cases[2]["planned_swap_extra_ms"] > 0:
                status = WARN
                lines.append("copy-bound at 720p x 21 frames: use fp8/NVFP4 weights (fewer bytes per block) or "
                             "larger batches")
        out.append(CheckResult(name, status, value, "blocks swapped", "\n".join(lines), data=data))
    return out


CHECKS = (check_io_vs_compute,)
