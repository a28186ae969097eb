"""Which kernel runs a quantized linear: the one place that compares the rows M of an input with thresholds.

``decide(fmt, request, m, site)`` -> ``Decision(path, kernel, reason)`` for an ``NVFP4Linear`` (``fmt="nvfp4"``,
``request`` its path: ``auto`` or one of ``NVFP4_PATHS``) or an ``FP8Linear`` (``fmt="fp8"``, ``request`` its mode).
``site`` holds every other fact the choice depends on (device, Triton, dtype, the policy's path, which sm_90
kernels took their self-test); ``kernel_table`` walks the M ranges for the policy's summary. Nothing here touches a
GPU: the layers build the ``Site`` and run the kernel the decision names.

NVFP4 paths: ``fp4_tensorcore`` (sm_100 / sm_120, FP4 GEMM), ``fp8_speed`` (sm_89 / sm_90, FP8 GEMM on per-token FP8
activations), ``fidelity`` (bf16 activations x the 4-bit weight, by M below), ``reference`` (exact fp32, any device).
ComfyUI's other layouts: ``mxfp8`` (``MXFP8Linear``: the policy's speed paths run an FP8 GEMM, fidelity the exactly
dequantized weight) and ``int8`` (``Int8Linear``, ConvRot: the integer product through ``torch._int_mm`` where its
self-test passes, int8 tensor cores on a GPU, between fused Triton kernels where those pass theirs; else the exact
float64 reference).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

NVFP4_PATHS = ("fp4_tensorcore", "fp8_speed", "fidelity", "reference")
FP8_MODES = ("cast", "scaled_mm")
FIDELITY_KERNELS = ("auto", "fused", "rs", "dequant")    # NVFP4Linear.fidelity_kernel: auto, or force one
MXFP8_REQUESTS = ("auto", "fp8", "dequantize", "reference")
INT8_REQUESTS = ("auto", "int_mm", "reference")

# Thresholds on M (rows of the input), measured on H100 (docs/PERFORMANCE.md §8):
W4A16_MAX_M = 256    # up to here a fused W4A16 kernel (reads the 4-bit weight); beyond, dequantize + cuBLAS is faster
WGMMA_MIN_M = 65     # below, the Triton kernel's 16/32/64-token tiles waste less than the wgmma kernel's 128-token one
RS_MIN_M = 1024      # from here the RS kernel is timed against dequantize + cuBLAS once per shape (it lost at 3072^2)
RS_AUTO_M = 4096     # from here the RS kernel wins on every SeedVR2 shape (0.96-1.04x bf16, dequantize 0.90-0.99x)

KERNEL_DOC = {
    "reference": "fp32 dequantize + fp32 matmul",
    "fp4_gemm": "activations quantized to NVFP4 (Triton), FP4 tensor-core GEMM",
    "fp8_rowwise": "weight as FP8 per channel, activations FP8 per token (Triton), torch._scaled_mm",
    "w4a16_triton": "fused swap-AB W4A16 Triton kernel",
    "w4a16_wgmma": "fused W4A16 CUDA wgmma kernel (sm_90)",
    "rs_w4a16": "persistent RS W4A16 CUDA kernel (sm_90)",
    "rs_or_dequant": "the faster of rs_w4a16 and dequant_cublas, timed once per shape",
    "dequant_cublas": "weight dequantized to bf16 (Triton, kept in L2), one cuBLAS GEMM",
    "fp8_cast": "FP8 weight cast to the compute dtype, one GEMM",
    "fp8_scaled_mm": "activations FP8 per token, torch._scaled_mm",
    "mxfp8_fp8_rowwise": "MXFP8 weight as FP8 per channel (power-of-two shifts), activations FP8 per token, "
                         "torch._scaled_mm",
    "mxfp8_dequant": "MXFP8 weight dequantized exactly to the compute dtype, one GEMM",
    "int8_int_mm": "ConvRot: activations rotated and quantized to int8 per token by one fused Triton kernel, "
                   "torch._int_mm (int32, exact), rescaled and biased by a fused Triton epilogue",
    "int8_int_mm_eager": "ConvRot as int8_int_mm, the rotation, quantization and rescale as torch ops",
    "int8_reference": "ConvRot as int8_int_mm_eager, the integer product summed in float64 (exact, slow)",
}


def _no() -> bool:
    return False


@dataclass(frozen=True)
class Site:
    """What a choice depends on besides the request and M. The callables are asked only when M reaches them
    (the first answer on a device runs a kernel's self-test or the hardware policy)."""
    cuda: bool                                       # the input is on a CUDA device
    triton: bool = False                             # Triton kernels run there
    half: bool = True                                # bf16 / fp16 activations (the fused W4A16 kernels)
    dims16: bool = True                              # in and out features multiples of 16 (FP8 operands)
    w4a16_broken: str | None = None                  # why the Triton W4A16 kernel failed here (never tried again)
    policy_path: Callable[[], str] = lambda: "reference"               # the hardware policy's NVFP4 path
    fp4_gemm: Callable[[], tuple[bool, str]] = lambda: (False, "no FP4 GEMM")  # FP4 tensor cores + torch support
    wgmma: Callable[[], bool] = field(default=_no)   # the sm_90 wgmma kernel takes this call (self-tested)
    rs: Callable[[], bool] = field(default=_no)      # the sm_90 RS kernel takes this call (self-tested, no autograd)
    fp8: Callable[[], bool] = field(default=_no)     # the device has an FP8 GEMM (the policy's fp8_gemm)
    int_mm: Callable[[], bool] = field(default=_no)  # torch._int_mm gives the exact product here (self-tested)
    dims8: bool = True                               # in and out features multiples of 8 (torch._int_mm operands)
    # the INT8 layer's fused Triton kernels take its activations here (dtype, group size, self-test): (ok, why not)
    int8_fused: Callable[[], tuple[bool, str]] = lambda: (False, "no fused kernels")


@dataclass(frozen=True)
class Decision:
    path: str               # the NVFP4 path after the device's demotions (the FP8 mode for fp8)
    kernel: str             # a key of KERNEL_DOC
    path_reason: str        # why this path
    kernel_reason: str = ""  # why this kernel of the path (by M)

    @property
    def reason(self) -> str:
        return f"{self.path_reason}; {self.kernel_reason}" if self.kernel_reason else self.path_reason

    def line(self, fmt: str, m: int) -> str:
        return f"[SeedVR2-BW] {fmt} {self.path} M={m}: {self.kernel} ({self.reason})"


def decide(fmt: str, request: str, m: int, site: Site, fidelity_kernel: str = "auto") -> Decision:
    """The kernel that runs a ``fmt`` linear asked for ``request`` on an input of ``m`` rows at ``site``."""
    if fmt == "fp8":
        if request not in FP8_MODES:
            raise ValueError(f"FP8 mode must be one of {FP8_MODES}, got {request!r}")
        if request == "scaled_mm" and site.cuda and site.dims16:
            return Decision(request, "fp8_scaled_mm", "scaled_mm mode on CUDA")
        why = "cast mode" if request == "cast" else ("not CUDA" if not site.cuda else "features not multiples of 16")
        return Decision(request, "fp8_cast", why)
    if fmt == "mxfp8":
        return _mxfp8(request, site)
    if fmt == "int8":
        if request not in INT8_REQUESTS:
            raise ValueError(f"INT8 path must be one of {INT8_REQUESTS}, got {request!r}")
        if request == "reference":
            return Decision("reference", "int8_reference", "layer setting")
        why = "layer setting" if request == "int_mm" else "torch._int_mm"
        if not site.dims8:
            return Decision("reference", "int8_reference", f"{why}, but features not multiples of 8")
        if not site.int_mm():
            return Decision("reference", "int8_reference", f"{why}, but it failed its self-test on this device")
        why = f"{why}, which works here"
        if not site.triton:
            return Decision("int_mm", "int8_int_mm_eager", why, "not a CUDA device" if not site.cuda else "no Triton")
        fused, no = site.int8_fused()
        return Decision("int_mm", "int8_int_mm", why) if fused else Decision("int_mm", "int8_int_mm_eager", why, no)
    path, why = _nvfp4_path(request, site)
    if path == "reference":
        return Decision(path, "reference", why)
    if path == "fp4_tensorcore":
        return Decision(path, "fp4_gemm", why)
    if path == "fp8_speed":
        return Decision(path, "fp8_rowwise", why)
    kernel, kwhy = _fidelity_kernel(m, site, fidelity_kernel)
    return Decision(path, kernel, why, kwhy)


def _nvfp4_path(request: str, site: Site) -> tuple[str, str]:
    if request != "auto" and request not in NVFP4_PATHS:
        raise ValueError(f"NVFP4 path must be one of {NVFP4_PATHS} or 'auto', got {request!r}")
    if not site.cuda:
        return "reference", "not a CUDA device"
    path, why = (site.policy_path(), "hardware policy") if request == "auto" else (request, "layer setting")
    if path == "fp4_tensorcore":
        ok, no = site.fp4_gemm()
        if not ok:
            path, why = "fp8_speed", f"{why}, no FP4 GEMM here ({no})"
    if path == "fp8_speed" and not site.dims16:
        path, why = "fidelity", f"{why}, features not multiples of 16 (FP8 operands)"
    return path, why


def _mxfp8(request: str, site: Site) -> Decision:
    if request not in MXFP8_REQUESTS:
        raise ValueError(f"MXFP8 path must be one of {MXFP8_REQUESTS}, got {request!r}")
    if not site.cuda or request == "reference":
        return Decision("reference", "reference", "not a CUDA device" if not site.cuda else "layer setting")
    if request == "auto":
        nv = site.policy_path()
        request, why = ("fp8" if nv in ("fp4_tensorcore", "fp8_speed") else
                        "dequantize" if nv == "fidelity" else "reference"), f"hardware policy ({nv})"
    else:
        why = "layer setting"
    if request == "fp8" and not (site.fp8() and site.dims16):
        request, why = "dequantize", f"{why}, no FP8 GEMM here" if site.dims16 else f"{why}, features not multiples of 16"
    kernel = {"fp8": "mxfp8_fp8_rowwise", "dequantize": "mxfp8_dequant", "reference": "reference"}[request]
    return Decision(request, kernel, why)


def _fidelity_kernel(m: int, site: Site, forced: str) -> tuple[str, str]:
    fused = site.triton and site.half and site.w4a16_broken is None
    if forced not in FIDELITY_KERNELS:
        raise ValueError(f"fidelity_kernel must be one of {FIDELITY_KERNELS}, got {forced!r}")
    if forced == "dequant":
        return "dequant_cublas", "forced"
    if forced == "fused":
        return _w4a16(m, site, "forced") if fused else ("dequant_cublas", "fused forced, but no Triton kernel here")
    if forced == "rs":
        ok = m >= RS_MIN_M and site.rs()
        return ("rs_w4a16", "forced") if ok else ("dequant_cublas", f"rs forced, but M < {RS_MIN_M} or no RS kernel")
    if fused and m <= W4A16_MAX_M:
        return _w4a16(m, site, f"M <= {W4A16_MAX_M}")
    if m >= RS_MIN_M and site.rs():
        if m >= RS_AUTO_M:
            return "rs_w4a16", f"M >= {RS_AUTO_M}, sm_90"
        return "rs_or_dequant", f"{RS_MIN_M} <= M < {RS_AUTO_M}, sm_90"
    if not fused and m <= W4A16_MAX_M:
        return "dequant_cublas", f"no fused kernel ({site.w4a16_broken or 'Triton / bf16-fp16 needed'})"
    return "dequant_cublas", f"M > {W4A16_MAX_M}" + ("" if m < RS_MIN_M else ", no RS kernel here")


def _w4a16(m: int, site: Site, why: str) -> tuple[str, str]:
    if m >= WGMMA_MIN_M and site.wgmma():
        return "w4a16_wgmma", f"{why}, M >= {WGMMA_MIN_M}, sm_90 bf16"
    return "w4a16_triton", why + (f", M < {WGMMA_MIN_M}" if m < WGMMA_MIN_M else ", no wgmma kernel here")


RANGE_STARTS = (1, WGMMA_MIN_M, W4A16_MAX_M + 1, RS_MIN_M, RS_AUTO_M)


def kernel_table(site: Site, requests=(("nvfp4", "auto"),) + tuple(("nvfp4", p) for p in NVFP4_PATHS)
                 + tuple(("fp8", m) for m in FP8_MODES) + (("mxfp8", "auto"), ("int8", "auto"))) -> list[str]:
    """One line per (format, request): the kernel of each M range at ``site`` and why."""
    lines = []
    for fmt, request in requests:
        rows = []
        for i, lo in enumerate(RANGE_STARTS):
            hi = RANGE_STARTS[i + 1] - 1 if i + 1 < len(RANGE_STARTS) else None
            d = decide(fmt, request, lo, site)
            if rows and (rows[-1][2].kernel, rows[-1][2].kernel_reason) == (d.kernel, d.kernel_reason):
                rows[-1] = (rows[-1][0], hi, rows[-1][2])
            else:
                rows.append((lo, hi, d))
        first = rows[0][2]
        head = f"{fmt} {request}" + (f" -> {first.path}" if first.path != request else "")
        parts = []
        for lo, hi, d in rows:
            span = "all M" if len(rows) == 1 else (f"M >= {lo}" if hi is None else f"M {lo}-{hi}")
            parts.append(f"{span}: {d.kernel}" + (f" ({d.kernel_reason})" if d.kernel_reason else ""))
        lines.append(f"  {head} ({first.path_reason}): " + "; ".join(parts))
    return lines
