"""Quantized linear modules with one interface, and the functions that put them into a model.

``NVFP4Linear`` holds an NVFP4 weight (ComfyUI's layout, see ``format.py``) and runs it on one of four paths:

* ``fp4_tensorcore`` (sm_100 / sm_120): activations quantized to NVFP4 by one Triton kernel (rows chunked),
  real FP4 GEMM through ``torch.nn.functional.scaled_mm`` (two-level NVFP4 recipe, global scales as
  cuBLASLt alpha) or, on torch without it, ``torch._scaled_mm`` with single-level scales and the global
  scales applied after; bias added after. The weight is stored swizzled once at load.
* ``fp8_speed`` (sm_89 / sm_90): the NVFP4 weight converted once (per device) to FP8 E4M3 with per-output-
  channel scales; activations quantized per token by a Triton kernel; ``torch._scaled_mm`` row-wise.
* ``fidelity``: bf16 activations x NVFP4 weight, by rows M (``fidelity_kernel="auto"``, thresholds below):
  M <= FUSED_MAX_M: a fused swap-AB W4A16 kernel (reads the packed 4-bit weight, decodes in registers,
  fp32 accumulation, split-K when the grid is small): on sm_90 with bf16 and M > 64 the CUDA wgmma kernel of
  ``wgmma_w4a16.py``, else the Triton kernel; on sm_90 with bf16 and M >= 4096 the persistent RS kernel of
  ``rs_w4a16.py`` (1024 <= M < 4096: timed against the next option once per shape); otherwise Triton dequant to
  bf16 + one cuBLAS call.
  Opt-in: ``"pipelined"`` (dequant of most of the weight on a side stream, overlapped with a first K-part
  GEMM), ``"pipelined_n"`` (N chunks), ``"timed"`` (time the candidates once per shape).
* ``reference``: exact dequantize (fp32) + fp32 matmul. The oracle for every test, and the CPU path.

Per-call host cost: the first call per input shape runs the full forward (every check, every path), then
records a launch plan for that shape (``NVFP4Linear._make_plan``; fused W4A16 fidelity kernel and fp8_speed
only): later calls are a dict lookup, a pointer-alignment check, the output allocation and the raw Triton
launch(es) (+ ``torch._scaled_mm`` for fp8_speed), with exactly the arguments the full forward passes.
``scripts/bench_nvfp4_host.py`` measures it on a CPU (GPU work stubbed): ~50-70 us -> ~5-10 us per call there.

``path="auto"`` asks the hardware policy (``optimization.hardware.get_policy(device).nvfp4_gemm``) once per
device; any explicit path overrides it. ``expected_output`` computes on the CPU, exactly, what a path should
return (same quantizers, exact arithmetic) so that each path can be checked against its own emulation.
"""
from __future__ import annotations

import logging
import re
from typing import Callable, Iterable, Mapping

import torch
import torch.nn.functional as F

from . import format as fmt
from . import kernels as K
from . import rs_w4a16 as R
from .checkpoint import detect_layer_format, load_fp8_layer, load_nvfp4_layer
from .format import NVFP4Tensor

log = logging.getLogger(__name__)

PATHS = ("fp4_tensorcore", "fp8_speed", "fidelity", "reference")
FIDELITY_KERNELS = ("auto", "fused", "rs", "dequant", "pipelined", "pipelined_n", "timed")
# fidelity path, kernel by rows M (bf16/fp16 activations on CUDA), fidelity_kernel="auto":
#   M <= FUSED_MAX_M           -> fused W4A16 Triton kernel (reads the 4-bit weight; no bf16 weight is written)
#   M >= rs_w4a16.AUTO_M, sm_90, bf16 -> the RS W4A16 kernel (rs_w4a16.py: persistent, TMA, the weight decoded
#                                  into wgmma's A registers, stream-K tail), SEEDVR2BW_RS_KERNEL=0 turns it off;
#                                  rs_w4a16.MIN_M <= M < AUTO_M: the faster of it and dequant, timed once per shape
#   M >= PIPELINE_MIN_M         -> the faster of dequant and pipelined (K split in two: the larger part of the
#                                  weight is dequantized on a side stream while cuBLAS multiplies the first part),
#                                  timed once per (M bucket, shape) on the device (None: never)
#   otherwise                   -> dequant (whole weight -> bf16, one cuBLAS call)
# Measured on H100 (torch 2.11, Triton 3.6, scripts/bench_nvfp4.py --inner 8 --variants, 6 SeedVR2 shapes,
# 2026-11-22, two runs; ms per call, medians):
#   run 1 (old W4A16 tiles, N-split pipeline): M>=1024 dequant fastest everywhere (0.69-0.95x bf16); N-split
#     pipeline 2/4/8 chunks slower at every M (M=4096, 3072x12288: 0.58 / 0.80 / 2.0 vs dequant 0.49): each
#     chunk costs a Triton launch and the bias pre-fill of its output slice (as much traffic as it hides).
#   run 2 (current tiles, K-split pipeline, cached launcher):
#     M=256:  fused beat dequant on 5 of 6 shapes (e.g. 3072x9216 0.128 vs 0.209, 3072x12288 0.081 vs 0.115;
#             lost 2560x6912 0.122 vs 0.102)
#     M=1024: dequant beat fused on 4 of 6 (3072x12288 0.158 vs 0.245, 12288x3072 0.155 vs 0.310)
#     M=4096: dequant 0.83-0.98x bf16; K-split pipeline (2/4/8) 0.77-0.91x on the big shapes, never faster than
#             dequant beyond noise; M=16384: all ~1.0x  -> PIPELINE_MIN_M = None (opt-in only)
#   At M<=256 every path here (and comfy-kitchen) is host-bound on that machine (0.08-0.2 ms for 10-50 us of GPU
#   work) and varied up to 2x between runs, so the small-M numbers decide only coarse choices.
#   run 3 (session 2, tile x SPLIT_K sweep, single calls with the L2 flushed): at M=256 dequant + cuBLAS
#     (0.027-0.092 ms of GPU time) beat the best fused tile on 4 of 6 shapes; but with calls queued back to back
#     (--inner 8, as in a model) the dequant path is host-bound at M=256 (0.063-0.164 ms: no launch plan, two
#     launches + an allocation) where the fused kernel runs from a cached plan  -> FUSED_MAX_M stays 256
#   run 4 (session 7, sm_90 wgmma kernel, scripts/device/wgmma_probe.py, CUDA-graph times, commit 613454a):
#     M=512: the wgmma kernel's default config beat dequant on 3 of 6 shapes (a draw: 0.85-1.10x); M=1024:
#     dequant faster on all 6 (0.0389-0.1446 vs 0.0437-0.1716 ms)  -> FUSED_MAX_M stays 256
#   run 5 (session 8, wgmma kernel with the mbarrier pipeline and 2-4 warpgroup tiles, commit a9007c6 / 9e7131e):
#     M=4096 / 16384: best tile 0.64-0.84x bf16, dequant + cuBLAS 0.90-1.03x (the decode costs the kernel
#     13-27 %: without it the same pipeline reaches 0.79-1.00x)  -> FUSED_MAX_M stays 256
#   run 6 (session 9, commit 15343dd): M=4096 dequant + cuBLAS 0.927-0.945x bf16, the ceiling of any path writing
#     the bf16 weight to HBM (~0.94x: 2.56 B/weight at 3.35 TB/s vs 2*4096 FLOP/weight at ~670 TFLOP/s). Slab-wise
#     dequant into L2 + cuBLASLt (commit cf7a84a) and dequant overlapped on a side stream with SM-limited GEMMs
#     (1676810) measured no faster / slower and were reverted (docs/BENCHMARKS.md, session 9)
#   run 7 (session 10, commits ac73630..9b4bf9f): a warp-specialized persistent fused kernel (decode into shared
#     memory, SS wgmma) reached 0.53-0.67x bf16 at M=4096 and 0.69-0.83x at 16384, below dequant + cuBLAS on
#     every shape; reverted (docs/BENCHMARKS.md, session 10)
#   run 8 (session 11, commits 0bcb8aa..bf4c45f): the same kind of kernel with a TMA-fed loader warpgroup that does
#     only the decode and two consumer warpgroups that do only wgmma m64n256k16: at best 0.71-0.87x bf16 at M=4096
#     (commit 3a4781d; dequant + cuBLAS 0.90-0.93x in the same run); reverted (docs/BENCHMARKS.md, session 11)
#   run 9 (session 12, commits cf9b0ae..ff52f38): each weight tile's decode shared between the CTAs that need it
#     (bf16 scratch in L2, per-slice flags, 2-CTA clusters): 0.76-0.92x bf16 at M=4096 (dequant + cuBLAS 0.84-0.95x
#     in the same run); reverted (docs/BENCHMARKS.md, session 12, part 2)
#   run 10 (session 14, scripts/device/l2_persist_probe.py): dequant + cuBLAS ran at 0.78-0.82x bf16 at M=4096
#     whenever other GEMMs had gone through the L2 since its last call; the dequantize's stores with the L2
#     evict_last hint into one shared scratch weight: 0.87-1.02x in the same order (L2_KEEP below)
#   run 11 (session 15, bench_nvfp4.py, commit 0aa2725): the RS kernel (rs_w4a16.py) 0.96-1.01x bf16 at M=4096,
#     1.00-1.04x at 16384, dequant + cuBLAS 0.90-0.96x / 0.98-0.99x in the same run  -> RS from M >= 4096
FUSED_MAX_M = 256
PIPELINE_MIN_M = None        # set (e.g. 1024) to let "auto" time pipelined against dequant once per shape
PIPELINE_CHUNKS = 4          # pipelined: first K part = Kp / PIPELINE_CHUNKS (exposed); N split: N chunks
PIPELINE_ALIGN = 128         # N split: chunk boundaries on 128-row multiples (the swizzled scales slice per chunk)
SMALL_M = FUSED_MAX_M        # kept for older callers
_FIDELITY_CHOICE: dict = {}  # (m bucket, N, K, device) -> kernel name, decided by timing once ("timed")


MAX_PLANS = 64               # launch plans kept per layer (input shapes); more: start over
_PLAN_INPUTS = frozenset({"weight", "weight_scale", "weight_scale_2", "bias", "input_scale", "pre_quant_scale", "path",
                          "fidelity_kernel", "pipeline_chunks", "fp8_fast_accum", "in_features", "out_features"})
_WEIGHT_NAMES = frozenset({"weight", "weight_scale", "weight_scale_2"})
_FUSED_BROKEN: list = []   # reason the fused W4A16 kernel failed to build/run here (then never tried again)
_FP8_NO_FAST_ACCUM: set = set()   # (M, K, N, device) where cuBLASLt refused bias + fast accumulation (fp8_speed)


def plan_chunks(n: int, chunks: int, align: int = PIPELINE_ALIGN) -> list[tuple[int, int]]:
    """Split rows [0, n) into at most ``chunks`` contiguous ranges whose starts are multiples of ``align``
    (all but the last have the same size, a multiple of ``align``)."""
    if n <= 0:
        return []
    chunks = max(1, int(chunks))
    size = fmt.roundup(-(-n // chunks), align)
    return [(n0, min(n0 + size, n)) for n0 in range(0, n, size)]


_SIDE_STREAM: dict = {}
_SCRATCH: dict = {}


def _side_stream(device):
    key = str(device)
    st = _SIDE_STREAM.get(key)
    if st is None:
        lo, hi = torch.cuda.Stream.priority_range()
        st = _SIDE_STREAM[key] = torch.cuda.Stream(device=device, priority=hi)   # dequant CTAs go first
    return st


def _scratch(device, dtype, numel: int, count: int = 2):
    """Two flat buffers (double buffering), one pair per device/dtype shared by every layer, grown on demand.
    Growing frees the old pair on the current stream; every earlier side-stream write to it was waited for
    by the current stream (each chunk's GEMM waits for its dequant), so the allocator may reuse it."""
    key = (str(device), dtype, count)
    bufs = _SCRATCH.get(key)
    if bufs is None or bufs[0].numel() < numel:
        _SCRATCH.pop(key, None)
        bufs = _SCRATCH[key] = [torch.empty(numel, dtype=dtype, device=device) for _ in range(count)]
    return bufs


def scratch_nbytes() -> int:
    return sum(b.numel() * b.element_size() for bufs in _SCRATCH.values() for b in bufs)


def _time_choice(fns: dict, reps: int = 5) -> str:
    """Run each candidate once (warm-up, includes Triton autotuning), then time ``reps`` calls with CUDA events;
    return the fastest name. A candidate that raises is dropped (the last one is the safe fallback)."""
    best, best_t = None, float("inf")
    for name, fn in fns.items():
        try:
            fn()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - e.g. a Triton compile failure on this GPU / version
            log.warning("[SeedVR2-BW] NVFP4 %s kernel unavailable, using the next one: %s: %s", name,
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            if name == "fused":
                _FUSED_BROKEN.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        t = start.elapsed_time(end)
        log.debug("fidelity candidate %s: %.4f ms", name, t / reps)
        if t < best_t:
            best, best_t = name, t
    return best


# ----------------------------------------------------------------------------------------------------------
# path resolution
# ----------------------------------------------------------------------------------------------------------
def _policy_path(device: torch.device) -> str:
    """The path the hardware policy chose (self-tested) for this device: the one place that decides."""
    from ..hardware import get_policy
    return get_policy(device).nvfp4_gemm


def resolve_path(path: str | None, device) -> str:
    device = torch.device(device)
    if path in (None, "auto"):
        path = _policy_path(device)
    if path not in PATHS:
        raise ValueError(f"NVFP4 path must be one of {PATHS} or 'auto', got {path!r}")
    if not K.device_is_cuda(device) and path != "reference":
        return "reference"
    return path


def fp4_gemm_supported(device) -> tuple[bool, str]:
    device = torch.device(device)
    if device.type != "cuda":
        return False, "not a CUDA device"
    cap = torch.cuda.get_device_capability(device)
    if cap[0] not in (10, 12):
        return False, f"sm_{cap[0]}{cap[1]} has no FP4 tensor cores (needs sm_100/sm_120)"
    if not hasattr(torch, "float4_e2m1fn_x2"):
        return False, "this torch has no float4_e2m1fn_x2"
    return True, "ok"


# ----------------------------------------------------------------------------------------------------------
# FP4 GEMM operands (checked bit-exactly on CPU) and the call
# ----------------------------------------------------------------------------------------------------------
def activation_global_scale(x: torch.Tensor, input_scale: torch.Tensor | None) -> torch.Tensor:
    if input_scale is not None:
        return input_scale.to(device=x.device, dtype=torch.float32).reshape(())
    return fmt.global_scale_for(x)


def quantize_activation_nvfp4(x2: torch.Tensor, g: torch.Tensor):
    """[M, Kp] -> (packed uint8 [M, Kp/2] hi_first, swizzled e4m3 [roundup(M,128), roundup(Kp/16,4)])."""
    if K.triton_usable(x2):
        return K.quantize_act_nvfp4(x2, g)
    packed, scales, _ = fmt.quantize_nvfp4(x2, g, pad_rows=1)
    return packed, scales


def fp4_gemm_operands(x2: torch.Tensor, weight: NVFP4Tensor, input_scale: torch.Tensor | None = None) -> dict:
    """Every tensor the FP4 GEMM receives. ``x2`` must be [M, Kp] (padded like the weight)."""
    g_a = activation_global_scale(x2, input_scale)
    a, sa = quantize_activation_nvfp4(x2, g_a)
    return {"a": a, "scale_a": sa, "global_a": g_a, "b": weight.packed, "scale_b": weight.block_scale,
            "global_b": weight.global_scale.to(x2.device)}


def fp4_gemm(ops: dict, out_dtype=torch.bfloat16, bias: torch.Tensor | None = None) -> torch.Tensor:
    """out[M, Np] = dequant(a) @ dequant(b)^T on FP4 tensor cores (sm_100 / sm_120 only)."""
    fp4 = torch.float4_e2m1fn_x2
    a = ops["a"].view(fp4)
    b = ops["b"].view(fp4).t()
    if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
        ST, SW = F.ScalingType, F.SwizzleType
        out = F.scaled_mm(a, b,
                          scale_a=[ops["scale_a"].reshape(-1), ops["global_a"].reshape(())],
                          scale_recipe_a=[ST.BlockWise1x16, ST.TensorWise],
                          scale_b=[ops["scale_b"].reshape(-1), ops["global_b"].reshape(())],
                          scale_recipe_b=[ST.BlockWise1x16, ST.TensorWise],
                          swizzle_a=[SW.SWIZZLE_32_4_4, SW.NO_SWIZZLE],
                          swizzle_b=[SW.SWIZZLE_32_4_4, SW.NO_SWIZZLE],
                          output_dtype=out_dtype)
    else:
        out = torch._scaled_mm(a, b, scale_a=ops["scale_a"].reshape(-1), scale_b=ops["scale_b"].reshape(-1),
                               out_dtype=out_dtype)
        out = out * (ops["global_a"] * ops["global_b"]).to(out_dtype)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out


# ----------------------------------------------------------------------------------------------------------
# modules
# ----------------------------------------------------------------------------------------------------------
class _QuantLinearBase(torch.nn.Module):
    in_features: int
    out_features: int

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class NVFP4Linear(_QuantLinearBase):
    """nn.Linear replacement holding an NVFP4 weight. Buffers use ComfyUI's key names, so ``state_dict()``
    yields a ComfyUI NVFP4 layer (``weight``, ``weight_scale``, ``weight_scale_2``, [``input_scale``],
    ``comfy_quant``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=torch.bfloat16, path: str = "auto", fp8_fast_accum: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        pr, pc = fmt.roundup(out_features, 16), fmt.roundup(in_features, 16)
        sr, sc = fmt.swizzled_scale_shape(pr, pc // 16)
        self.register_buffer("weight", torch.zeros((pr, pc // 2), dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.zeros((sr, sc), dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("weight_scale_2", torch.ones((), dtype=torch.float32, device=device))
        self.register_buffer("input_scale", None)
        self.register_buffer("pre_quant_scale", None)
        self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device),
                                       requires_grad=False) if bias else None
        self.path = path
        self.fp8_fast_accum = fp8_fast_accum
        # fidelity path kernel: "auto" (by M, thresholds FUSED_MAX_M / PIPELINE_MIN_M), "fused" (Triton W4A16),
        # "dequant" (whole weight -> bf16 + one cuBLAS call), "pipelined" (chunked, dequant overlapped with the
        # GEMM), "timed" (time the candidates once per M bucket and shape, keep the fastest)
        self.fidelity_kernel = "auto"
        self.pipeline_chunks = None      # None: PIPELINE_CHUNKS
        self._derived: dict = {}
        # launch plans: (x.shape, x.dtype, x.get_device()) -> callable(x) -> y (or None: no plan for that input).
        # Built after the first call per input shape (see ``_make_plan``); cleared whenever anything they were
        # built from changes (buffers / attributes assigned, ``.to()``, ``load_state_dict``).
        self._plans: dict = {}

    def __setattr__(self, name, value):
        if name in _PLAN_INPUTS:
            plans = self.__dict__.get("_plans")
            if plans:
                plans.clear()
            if name in _WEIGHT_NAMES and self.__dict__.get("_derived"):
                self._derived.clear()       # e.g. the FP8 copy of the weight
        super().__setattr__(name, value)

    def __getstate__(self):
        # copy.deepcopy / pickle: the plans' closures hold this layer's tensors; a copy makes its own
        state = super().__getstate__()
        state = dict(state)
        state["_plans"] = {}
        return state

    def __setstate__(self, state):
        state.setdefault("_plans", {})     # pickled before launch plans existed
        super().__setstate__(state)

    def register_buffer(self, name, tensor, persistent=True):
        plans = self.__dict__.get("_plans")
        if plans:
            plans.clear()
        super().register_buffer(name, tensor, persistent)

    # -- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_nvfp4(cls, t: NVFP4Tensor, bias=None, input_scale=None, path="auto", dtype=torch.bfloat16,
                   pre_quant_scale=None):
        n, k = t.shape
        m = cls(k, n, bias=bias is not None, device="meta", dtype=dtype, path=path)
        m.weight = t.packed
        m.weight_scale = t.block_scale
        m.weight_scale_2 = t.global_scale.float().reshape(())
        if bias is not None:
            m.bias = torch.nn.Parameter(bias.detach().to(dtype).to(t.packed.device), requires_grad=False)
        if input_scale is not None:
            m.register_buffer("input_scale", input_scale.float().reshape(()).to(t.packed.device))
        if pre_quant_scale is not None:
            m.register_buffer("pre_quant_scale", pre_quant_scale.to(t.packed.device))
        return m

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, path="auto", recipe="comfy", input_scale=None, dtype=None):
        w = linear.weight.detach()
        t = fmt.quantize_nvfp4(w.float() if w.dtype not in (torch.float32, torch.bfloat16, torch.float16) else w,
                               recipe=recipe, return_tensor=True)
        return cls.from_nvfp4(t, bias=linear.bias, input_scale=input_scale, path=path,
                              dtype=dtype or (linear.bias.dtype if linear.bias is not None else torch.bfloat16))

    @property
    def nvfp4(self) -> NVFP4Tensor:
        return NVFP4Tensor(self.weight, self.weight_scale, self.weight_scale_2, (self.out_features, self.in_features))

    def dequantize_weight(self, dtype=torch.float32) -> torch.Tensor:
        if dtype != torch.float32 and K.triton_usable(self.weight):
            return K.dequantize_nvfp4_triton(self.weight, self.weight_scale, self.weight_scale_2,
                                             (self.out_features, self.in_features), dtype=dtype)
        return self.nvfp4.dequantize(dtype)

    def weight_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.weight_scale, self.weight_scale_2))

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        from .checkpoint import comfy_quant_tensor
        destination[prefix + "comfy_quant"] = comfy_quant_tensor({"format": "nvfp4", "nibble_order": fmt.NIBBLE_ORDER})

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        state_dict.pop(prefix + "comfy_quant", None)
        for name in ("input_scale", "pre_quant_scale"):
            v = state_dict.get(prefix + name)
            if v is not None:
                if v.numel() == 1:
                    v = state_dict[prefix + name] = v.float().reshape(())
                self.register_buffer(name, torch.empty_like(v, device=self.weight.device))
        self._derived.clear()
        self._plans.clear()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _apply(self, fn, recurse=True):
        self._derived.clear()
        self._plans.clear()
        return super()._apply(fn, recurse)

    # -- forward --------------------------------------------------------------------------------------------
    def effective_path(self, device) -> str:
        key = ("path", self.path, str(device))
        path = self._derived.get(key)
        if path is None:
            path = self._derived[key] = self._decide_path(device)
        return path

    def _decide_path(self, device) -> str:
        path = resolve_path(self.path, device)
        if path == "fp4_tensorcore" and not fp4_gemm_supported(device)[0]:
            path = "fp8_speed"
        if path == "fp8_speed" and (self.in_features % 16 or self.out_features % 16):
            path = "fidelity"
        return path

    def _padded_input(self, x2):
        kp = self.weight.shape[1] * 2
        if x2.shape[1] != kp:
            x2 = F.pad(x2, (0, kp - x2.shape[1]))
        return x2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plans = self._plans
        if plans:
            plan = plans.get((x.shape, x.dtype, x.get_device()))
            if plan is not None and x.is_contiguous():
                try:
                    y = plan(x)
                except Exception:  # noqa: BLE001 - launcher API differs in this Triton: normal launches from now on
                    K._FAST_LAUNCH[0] = False
                    K._FAST_CACHE.clear()
                    plans.clear()
                    y = None
                if y is not None:
                    return y
        return self._forward_full(x)

    def _forward_full(self, x: torch.Tensor) -> torch.Tensor:
        """The complete forward (every check, every path). After it, a launch plan is made for x's shape."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.pre_quant_scale is not None:
            x2 = x2 * self.pre_quant_scale.to(x2.dtype)
        path = self.effective_path(x.device)
        y = getattr(self, "_forward_" + path)(x2)
        y = y.reshape(*shape[:-1], self.out_features)
        if path in ("fidelity", "fp8_speed"):
            key = (shape, x.dtype, x.get_device())
            if key not in self._plans:
                if len(self._plans) >= MAX_PLANS:
                    self._plans.clear()
                self._plans[key] = self._make_plan(x, x2, path)
        return y

    def _make_plan(self, x, x2, path):
        """A callable doing what ``_forward_full`` just did for inputs like ``x`` (same shape, dtype, device,
        contiguous), with everything that does not depend on the input's values decided now: the path, the
        fidelity kernel for this M, the kernel config, the compiled kernels and their argument tuples, the
        weight-side tensors. Per call it is left with: checking pointer alignment, allocating the output
        (and split-K partials / the FP8 activation), the launch(es) - bias is in the kernel epilogue / the
        cuBLASLt call. None when the call is not of that kind (reference / dequant / pipelined kernels,
        pre_quant_scale, K padding, non-contiguous input, fast launch off, ...): then every call is full."""
        if (self.pre_quant_scale is not None or not x.is_contiguous() or not K._FAST_LAUNCH[0]
                or not K.on_cuda(x) or self.weight.shape[1] * 2 != self.in_features or x2.shape[0] == 0):
            return None
        out_shape = tuple(x.shape[:-1]) + (self.out_features,)
        try:
            if path == "fidelity":
                kern = self._fidelity_kernel_for(x2)
                if kern == "dequant":
                    return self._dequant_plan(x2, out_shape)
                if kern == "rs":
                    return R.rs_plan(x2, self.weight, self.weight_scale, self.weight_scale_2, self.out_features,
                                     self._bias_as(x2.dtype), out_shape)
                if kern != "fused":
                    return None
                return K.w4a16_plan(x2, self.weight, self.weight_scale, self.weight_scale_2, self.out_features,
                                    self.bias, out_shape)
            return self._fp8_plan(x2, out_shape)
        except Exception as exc:  # noqa: BLE001 - no plan: the full forward keeps working
            log.debug("NVFP4 launch plan not made: %s: %s", type(exc).__name__, exc)
            return None

    def _dequant_plan(self, x2, out_shape):
        """Dequantize (cached launch) + cuBLAS for inputs like x2: what ``_fidelity_dequant`` does, decided once."""
        dtype = x2.dtype
        if dtype not in (torch.bfloat16, torch.float16) or (self.bias is not None and self.bias.dtype != dtype):
            return None
        dq = K.dequant_plan(self.weight, self.weight_scale, self.weight_scale_2,
                            (self.out_features, self.in_features), dtype, l2_keep=True)
        if dq is None:
            return None
        bias, flat, linear = self.bias, len(out_shape) == 2, F.linear
        scratch_weight = self._scratch_weight

        def plan(xc):
            w = dq(scratch_weight(xc, dtype))      # None (autograd keeps the weight): a fresh buffer
            if w is None:
                return None
            y = linear(xc, w, bias)
            return y if flat else y.view(out_shape)
        return plan

    def _fp8_plan(self, x2, out_shape):
        if x2.dtype != torch.bfloat16 or (self.bias is not None and self.bias.dtype != torch.bfloat16):
            return None
        dev = x2.device
        m, k = x2.shape
        block_k, warps = K.act_fp8_config(k)
        q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=dev)
        s = torch.empty((m, 1), dtype=torch.float32, device=dev)
        kern = K.cached_kernel(K._act_fp8_row_kernel, (x2, q, s, k, x2.stride(0)), dict(BLOCK_K=block_k), warps,
                               K.ACT_FP8_STAGES)
        if kern is None:
            return None
        w8, sw = self._fp8_weight(dev)
        w8t, swr = w8.t(), sw.reshape(1, -1)
        b, fast_accum = self.bias, self._fp8_fast_accum_for(m, dev)
        run, f, md = kern.run, kern.function, kern.packed_metadata
        tail = (k, x2.stride(0), block_k)
        q_shape, s_shape, index = (m, k), (m, 1), dev.index
        fp8, f32, bf16 = torch.float8_e4m3fn, torch.float32, torch.bfloat16
        flat = len(out_shape) == 2
        del q, s

        def plan(xc):
            if xc.data_ptr() & 15:
                return None
            xq = xc.new_empty(q_shape, dtype=fp8)
            sx = xc.new_empty(s_shape, dtype=f32)
            run(m, 1, 1, K.raw_stream(index), f, md, None, None, None, xc, xq, sx, *tail)
            y = torch._scaled_mm(xq, w8t, scale_a=sx, scale_b=swr, out_dtype=bf16, bias=b,
                                 use_fast_accum=fast_accum)
            return y if flat else y.view(out_shape)
        return plan

    def _forward_reference(self, x2):
        w = self.nvfp4.dequantize(torch.float32)
        b = self.bias.float() if self.bias is not None else None
        return F.linear(x2.float(), w, b).to(x2.dtype)

    def _rs_vs_dequant(self, x2) -> dict:
        """The two candidates as later calls run them: through their launch plans (the host time of a full call
        is several times a plan's and decided the choice at M = 1024 - 2048 on the H100)."""
        def planned(full, make):
            full()                                       # compiles, self-tests, then the plan can be made
            try:
                plan = make()
            except Exception:  # noqa: BLE001 - no plan: time the full call
                plan = None
            return (lambda: plan(x2)) if plan is not None and x2.is_contiguous() else full
        out_shape = (x2.shape[0], self.out_features)
        bias = self._bias_as(x2.dtype)
        return {"rs": planned(lambda: self._fidelity_rs(x2),
                              lambda: R.rs_plan(x2, self.weight, self.weight_scale, self.weight_scale_2,
                                                self.out_features, bias, out_shape)),
                "dequant": planned(lambda: self._fidelity_dequant(x2),
                                   lambda: self._dequant_plan(x2, out_shape))}

    def _fidelity_rs(self, x2):
        """The RS W4A16 kernel (rs_w4a16.py), or None where it cannot run."""
        return R.rs_linear(x2.contiguous(), self.weight, self.weight_scale, self.weight_scale_2, self.out_features,
                           self._bias_as(x2.dtype))

    def _bias_as(self, dtype):
        """The bias in the activations' dtype (None without a bias); the last conversion is kept while the bias
        keeps its storage (block swap gives it new storage: converted again, the old copy dropped)."""
        b = self.bias
        if b is None or b.dtype == dtype:
            return b
        key = (b.data_ptr(), b.device, dtype)
        hit = self._derived.get("bias_as")
        if hit is None or hit[0] != key:
            hit = self._derived["bias_as"] = (key, b.to(dtype))
        return hit[1]

    def _fidelity_fused(self, x2):
        return K.w4a16_linear(self._padded_input(x2), self.weight, self.weight_scale, self.weight_scale_2,
                              self.out_features, bias=self._bias_as(x2.dtype))

    def _scratch_weight(self, x2, dtype):
        """[N, K] view of the device's shared scratch weight for the dequantize + GEMM kernel, or None where it
        must not be used: off CUDA / Triton, or when autograd would keep the weight for the backward (the next
        layer overwrites the scratch)."""
        if (not (K.on_cuda(x2) and K.triton_usable(self.weight))
                or (torch.is_grad_enabled() and x2.requires_grad)):
            return None
        n, k = self.out_features, self.in_features
        return _scratch(x2.device, dtype, n * k, count=1)[0][: n * k].view(n, k)

    def _fidelity_dequant(self, x2):
        """Dequantize into the shared scratch weight (stores kept in L2: the GEMM reads them straight back) +
        one cuBLAS call."""
        dtype = x2.dtype if x2.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        w = self._scratch_weight(x2, dtype)
        if w is None:
            w = self.dequantize_weight(dtype)
        else:
            K.dequantize_nvfp4_triton(self.weight, self.weight_scale, self.weight_scale_2,
                                      (self.out_features, self.in_features), dtype=dtype, out=w, l2_keep=True)
        b = self.bias.to(dtype) if self.bias is not None else None
        return F.linear(x2.to(dtype), w, b).to(x2.dtype)

    def _dequant_rows(self, n0: int, n1: int, dtype, out=None) -> torch.Tensor:
        """Rows [n0, n1) of the dequantized weight ([n1-n0, in_features]); n0 a multiple of 128."""
        rows_p = min(fmt.roundup(n1 - n0, 16), self.weight.shape[0] - n0)
        packed = self.weight[n0:n0 + rows_p]
        scales = self.weight_scale[n0:n0 + fmt.roundup(rows_p, 128)]
        shape = (n1 - n0, self.in_features)
        if K.triton_usable(packed) and packed.is_cuda:
            return K.dequantize_nvfp4_triton(packed, scales, self.weight_scale_2, shape, dtype=dtype, out=out)
        w = fmt.dequantize_nvfp4(packed, scales, self.weight_scale_2, dtype=dtype, shape=shape)
        if out is not None:
            out.copy_(w)
            return out
        return w

    def _fidelity_pipelined_n(self, x2, chunks: int | None = None):
        """(Opt-in, measured slower: see the note at the top.) The weight is split along N into
        ``chunks`` row ranges; chunk i+1 is dequantized on a (high-priority) side stream into one of two
        scratch buffers while the current stream multiplies chunk i straight into its column slice of the
        output (cuBLAS takes the slice as a strided C, ldc = N; no copy). Bias: the side stream fills the
        chunk's output slice with it and the GEMM accumulates (beta = 1). Off CUDA the same chunking runs
        sequentially (tests)."""
        dtype = x2.dtype if x2.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        x2 = x2.to(dtype)
        m, n, k = x2.shape[0], self.out_features, self.in_features
        bounds = plan_chunks(n, chunks or getattr(self, "pipeline_chunks", None) or PIPELINE_CHUNKS)
        out = torch.empty((m, n), dtype=dtype, device=x2.device)
        bias = self.bias.to(dtype) if self.bias is not None else None
        if not x2.is_cuda:
            for n0, n1 in bounds:
                w = self._dequant_rows(n0, n1, dtype)
                o = out[:, n0:n1]
                if bias is not None:
                    o.copy_(bias[n0:n1].expand(m, n1 - n0))
                    torch.addmm(o, x2, w.t(), out=o)
                else:
                    torch.mm(x2, w.t(), out=o)
            return out
        main = torch.cuda.current_stream(x2.device)
        side = _side_stream(x2.device)
        bufs = _scratch(x2.device, dtype, (bounds[0][1] - bounds[0][0]) * k)
        side.wait_stream(main)        # previous users of the scratch buffers (earlier layers' GEMMs) are done
        done = [None, None]
        for i, (n0, n1) in enumerate(bounds):
            buf = bufs[i % 2][: (n1 - n0) * k].view(n1 - n0, k)
            o = out[:, n0:n1]
            with torch.cuda.stream(side):
                if done[i % 2] is not None:
                    side.wait_event(done[i % 2])     # GEMM i-2 has finished reading this buffer
                self._dequant_rows(n0, n1, dtype, out=buf)
                if bias is not None:
                    o.copy_(bias[n0:n1].expand(m, n1 - n0))
                ready = torch.cuda.Event()
                ready.record(side)
            main.wait_event(ready)
            if bias is not None:
                torch.addmm(o, x2, buf.t(), out=o)
            else:
                torch.mm(x2, buf.t(), out=o)
            d = torch.cuda.Event()
            d.record(main)
            done[i % 2] = d
        return out

    def _dequant_cols(self, c0: int, c1: int, dtype, out=None) -> torch.Tensor:
        """Columns [c0, c1) of the dequantized, K-padded weight ([out_features, c1-c0]); c0 a multiple of 16."""
        n = self.out_features
        if K.triton_usable(self.weight) and self.weight.is_cuda:
            return K.dequantize_nvfp4_triton(self.weight, self.weight_scale, self.weight_scale_2, (n, c1 - c0),
                                             dtype=dtype, out=out, col0=c0)
        w = fmt.dequantize_nvfp4(self.weight, self.weight_scale, self.weight_scale_2, dtype=dtype)[:n, c0:c1]
        if out is not None:
            out.copy_(w)
            return out
        return w

    def _fidelity_pipelined(self, x2, chunks: int | None = None):
        """dequant + cuBLAS with most of the dequantization hidden behind the GEMM, split along K in two:
        columns [0, k1) (k1 = Kp / chunks) are dequantized first (exposed), then on a high-priority side stream
        columns [k1, Kp) are dequantized while cuBLAS computes ``out = x[:, :k1] @ W0^T + bias`` (contiguous
        output, bias in the cuBLASLt epilogue); finally ``out += x[:, k1:] @ W1^T`` (beta = 1). Both parts
        land in one scratch buffer per device/dtype (the size of the largest bf16 weight, shared by all
        layers). Cost vs dequant: 1/chunks of the dequant exposed, one extra read of the output (beta = 1),
        and one bf16 rounding of the first partial sum."""
        dtype = x2.dtype if x2.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        xp = self._padded_input(x2.to(dtype))
        m, kp = xp.shape
        n = self.out_features
        chunks = max(1, int(chunks or getattr(self, "pipeline_chunks", None) or PIPELINE_CHUNKS))
        k1 = min(kp, fmt.roundup(-(-kp // chunks), 64))
        bias = self.bias.to(dtype) if self.bias is not None else None
        if not xp.is_cuda:
            out = F.linear(xp[:, :k1], self._dequant_cols(0, k1, dtype), bias)
            if k1 < kp:
                out.addmm_(xp[:, k1:], self._dequant_cols(k1, kp, dtype).t())
            return out
        main = torch.cuda.current_stream(xp.device)
        buf = _scratch(xp.device, dtype, n * kp, count=1)[0]
        w0 = self._dequant_cols(0, k1, dtype, out=buf[: n * k1].view(n, k1))
        if k1 == kp:
            return F.linear(xp, w0, bias)
        side = _side_stream(xp.device)
        side.wait_stream(main)       # W0 written; earlier readers of the scratch (previous layers) finished
        with torch.cuda.stream(side):
            w1 = self._dequant_cols(k1, kp, dtype, out=buf[n * k1: n * kp].view(n, kp - k1))
            ready = torch.cuda.Event()
            ready.record(side)
        out = F.linear(xp[:, :k1], w0, bias)
        main.wait_event(ready)
        out.addmm_(xp[:, k1:], w1.t())
        return out

    def _rs_ok(self, x2) -> bool:
        """The RS kernel takes this call: no autograd through it (a backward needs the dequantized weight)."""
        return (not (torch.is_grad_enabled() and x2.requires_grad)
                and R.usable(x2, self.out_features, self.in_features))

    def _fidelity_kernel_for(self, x2) -> str:
        m = x2.shape[0]
        kern = self.fidelity_kernel
        fused_ok = (K.triton_usable(x2) and K.on_cuda(x2) and x2.dtype in (torch.bfloat16, torch.float16)
                    and not _FUSED_BROKEN)
        if kern == "fused":
            return "fused" if fused_ok else "dequant"
        if kern in ("dequant", "pipelined", "pipelined_n"):
            return kern
        if kern == "rs":
            return "rs" if self._rs_ok(x2) else "dequant"
        if not K.on_cuda(x2):
            return "dequant"
        pipe_ok = self.weight.shape[1] * 2 >= 256
        if kern == "timed":
            key = (K._m_bucket(m), self.out_features, self.in_features, str(x2.device))
            choice = _FIDELITY_CHOICE.get(key)
            if choice is None:
                cands = {}
                if fused_ok and m <= 1024:
                    cands["fused"] = lambda: self._fidelity_fused(x2)
                if pipe_ok:
                    cands["pipelined"] = lambda: self._fidelity_pipelined(x2)
                cands["dequant"] = lambda: self._fidelity_dequant(x2)
                choice = _FIDELITY_CHOICE[key] = _time_choice(cands)
            return choice
        if fused_ok and m <= FUSED_MAX_M:
            return "fused"
        if self._rs_ok(x2):
            if m >= R.AUTO_M:
                return "rs"
            # 1024 <= M < 4096: whichever of the RS kernel and dequant + cuBLAS is faster here, timed once per shape
            # (H100, bench_nvfp4 a9c4148: RS 0.87-1.00x bf16 where dequant + cuBLAS gives 0.78-0.91x, except
            # 3072 x 3072, where RS took 0.11 ms at M = 1024 and 2048: 0.27-0.55x)
            key = ("rs", m, self.out_features, self.in_features, str(x2.device))
            choice = _FIDELITY_CHOICE.get(key)
            if choice is None:
                choice = _FIDELITY_CHOICE[key] = _time_choice(self._rs_vs_dequant(x2), reps=10)
            return choice
        if pipe_ok and PIPELINE_MIN_M is not None and m >= PIPELINE_MIN_M:
            # large M: pipelined vs dequant timed once per (M bucket, shape) on this device (see the note)
            key = ("auto", K._m_bucket(m), self.out_features, self.in_features, str(x2.device))
            choice = _FIDELITY_CHOICE.get(key)
            if choice is None:
                choice = _FIDELITY_CHOICE[key] = _time_choice(
                    {"pipelined": lambda: self._fidelity_pipelined(x2), "dequant": lambda: self._fidelity_dequant(x2)},
                    reps=10)
            return choice
        return "dequant"

    def _forward_fidelity(self, x2):
        kern = self._fidelity_kernel_for(x2)
        if kern == "fused":
            try:
                return self._fidelity_fused(x2).to(x2.dtype)
            except Exception as exc:  # noqa: BLE001 - Triton compile failure on this GPU / version
                _FUSED_BROKEN.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                log.warning("[SeedVR2-BW] NVFP4 fused W4A16 kernel unavailable, using dequant + cuBLAS: %s",
                            _FUSED_BROKEN[-1])
                return self._fidelity_dequant(x2)
        if kern == "rs":
            y = self._fidelity_rs(x2)
            if y is not None:
                return y
        if kern == "pipelined":
            return self._fidelity_pipelined(x2).to(x2.dtype)
        if kern == "pipelined_n":
            return self._fidelity_pipelined_n(x2).to(x2.dtype)
        return self._fidelity_dequant(x2)

    def _fp8_weight(self, device):
        key = ("fp8", str(device))
        if key not in self._derived:
            self._derived[key] = fmt.nvfp4_to_fp8_rowwise(self.nvfp4)
        return self._derived[key]

    def _fp8_shape(self, m: int, device) -> tuple:
        return (m, self.in_features, self.out_features, str(device))

    def _fp8_fast_accum_for(self, m: int, device) -> bool:
        return self.fp8_fast_accum and self._fp8_shape(m, device) not in _FP8_NO_FAST_ACCUM

    def _forward_fp8_speed(self, x2):
        w8, sw = self._fp8_weight(x2.device)
        if K.triton_usable(x2):
            xq, sx = K.quantize_act_fp8_rowwise(x2)
        else:
            xq, sx = fmt.quantize_act_fp8_rowwise_reference(x2)
        b = self.bias.to(torch.bfloat16) if self.bias is not None else None
        fast = self._fp8_fast_accum_for(x2.shape[0], x2.device)

        def mm(fast_accum):
            return torch._scaled_mm(xq, w8.t(), scale_a=sx.reshape(-1, 1), scale_b=sw.reshape(1, -1),
                                    out_dtype=torch.bfloat16, bias=b, use_fast_accum=fast_accum)
        try:
            y = mm(fast)
        except RuntimeError as exc:
            # cuBLASLt (H100, torch 2.11 / CUDA 13) has no row-wise FP8 kernel with a bias epilogue and fast
            # accumulation for M <= 48 at K >= 6912 (scripts/device/fp8_small_m_probe.py); it does have one with
            # full-precision accumulation, so this shape uses that from now on (the launch plan too)
            if not (fast and b is not None and "NOT_SUPPORTED" in str(exc)):
                raise
            _FP8_NO_FAST_ACCUM.add(self._fp8_shape(x2.shape[0], x2.device))
            log.info("[SeedVR2-BW] NVFP4 fp8_speed: cuBLASLt has no FP8 GEMM with bias and fast accumulation for "
                     "%dx%dx%d; this shape accumulates in full precision", x2.shape[0], self.in_features,
                     self.out_features)
            y = mm(False)
        return y.to(x2.dtype)

    def _forward_fp4_tensorcore(self, x2):
        out_dtype = x2.dtype if x2.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        ops = fp4_gemm_operands(self._padded_input(x2), self.nvfp4, self.input_scale)
        y = fp4_gemm(ops, out_dtype, None)
        y = y[:, : self.out_features]
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x2.dtype)


class FP8Linear(_QuantLinearBase):
    """nn.Linear replacement holding an FP8 E4M3 weight (w ~= weight * weight_scale, scale 0-d or per row).

    The weight stays FP8 in memory; each call casts it to the compute dtype (``mode="cast"``, default, any
    device). ``mode="scaled_mm"`` (sm_89+) runs ``torch._scaled_mm`` with per-token FP8 activations instead.
    """

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=torch.bfloat16, mode="cast"):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros((out_features, in_features), dtype=torch.float8_e4m3fn,
                                                   device=device))
        self.register_buffer("weight_scale", torch.ones((), dtype=torch.float32, device=device))
        self.register_buffer("input_scale", None)
        self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device),
                                       requires_grad=False) if bias else None
        self.mode = mode
        self.compute_dtype = dtype

    @classmethod
    def from_fp8(cls, w8, scale=None, bias=None, dtype=torch.bfloat16, mode="cast", input_scale=None):
        n, k = w8.shape
        m = cls(k, n, bias=bias is not None, device="meta", dtype=dtype, mode=mode)
        m.weight = w8 if w8.dtype == torch.float8_e4m3fn else w8.to(torch.float8_e4m3fn)
        m.weight_scale = (scale if scale is not None else torch.ones(())).float().to(w8.device)
        if bias is not None:
            m.bias = torch.nn.Parameter(bias.detach().to(dtype).to(w8.device), requires_grad=False)
        if input_scale is not None:
            m.register_buffer("input_scale", input_scale.float().reshape(()).to(w8.device))
        return m

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, dtype=None, mode="cast"):
        w8, s = fmt.quantize_fp8_per_tensor(linear.weight.detach())
        return cls.from_fp8(w8, s, linear.bias, dtype=dtype or linear.weight.dtype, mode=mode)

    def weight_nbytes(self) -> int:
        return self.weight.numel() + self.weight_scale.numel() * 4

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        from .checkpoint import comfy_quant_tensor
        destination[prefix + "comfy_quant"] = comfy_quant_tensor({"format": "float8_e4m3fn"})

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        state_dict.pop(prefix + "comfy_quant", None)
        v = state_dict.get(prefix + "input_scale")
        if v is not None:
            v = state_dict[prefix + "input_scale"] = v.float().reshape(())
            self.register_buffer("input_scale", torch.empty_like(v, device=self.weight.device))
        ws = state_dict.get(prefix + "weight_scale")
        if ws is not None and ws.shape != self.weight_scale.shape:
            self.weight_scale = torch.empty_like(ws, dtype=torch.float32, device=self.weight_scale.device)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def dequantize_weight(self, dtype=torch.bfloat16):
        s = self.weight_scale
        s = s.reshape(-1, 1) if s.numel() > 1 else s
        return (self.weight.to(dtype) * s.to(dtype)) if dtype != torch.float32 else self.weight.float() * s

    def forward(self, x):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.mode == "scaled_mm" and x.is_cuda and self.in_features % 16 == 0 and self.out_features % 16 == 0:
            xq, sx = K.quantize_act_fp8_rowwise(x2) if K.triton_usable(x2) else fmt.quantize_act_fp8_rowwise_reference(x2)
            sw = self.weight_scale.float()
            sw = sw.reshape(1, -1) if sw.numel() > 1 else sw.reshape(1, 1).expand(1, self.out_features).contiguous()
            b = self.bias.to(torch.bfloat16) if self.bias is not None else None
            y = torch._scaled_mm(xq, self.weight.t(), scale_a=sx.reshape(-1, 1), scale_b=sw,
                                 out_dtype=torch.bfloat16, bias=b).to(x.dtype)
        else:
            dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else self.compute_dtype
            w = self.dequantize_weight(dtype)
            y = F.linear(x2.to(dtype), w, self.bias.to(dtype) if self.bias is not None else None).to(x.dtype)
        return y.reshape(*shape[:-1], self.out_features)


# ----------------------------------------------------------------------------------------------------------
# expected outputs (CPU, exact) for each path
# ----------------------------------------------------------------------------------------------------------
def expected_output(layer: NVFP4Linear, x: torch.Tensor, path: str) -> torch.Tensor:
    """What ``path`` should compute for ``x``, emulated on the CPU in float64 with the pack's quantizers."""
    layer_cpu_w = NVFP4Tensor(layer.weight.cpu(), layer.weight_scale.cpu(), layer.weight_scale_2.cpu(),
                              (layer.out_features, layer.in_features))
    x2 = x.reshape(-1, x.shape[-1]).detach().cpu()
    if layer.pre_quant_scale is not None:
        x2 = x2 * layer.pre_quant_scale.cpu().to(x2.dtype)
    w = layer_cpu_w.dequantize(torch.float32).double()
    b = layer.bias.detach().cpu().double() if layer.bias is not None else None
    if path in ("reference", "fidelity"):
        y = x2.double() @ w.t()
    elif path == "fp8_speed":
        w8, sw = fmt.nvfp4_to_fp8_rowwise(layer_cpu_w)
        xq, sx = fmt.quantize_act_fp8_rowwise_reference(x2)
        y = (xq.double() * sx.double()[:, None]) @ (w8.double() * sw.double()[:, None]).t()
    elif path == "fp4_tensorcore":
        kp = layer.weight.shape[1] * 2
        xp = F.pad(x2, (0, kp - x2.shape[1])) if x2.shape[1] != kp else x2
        g = activation_global_scale(xp, layer.input_scale.cpu() if layer.input_scale is not None else None)
        pa, sa, _ = fmt.quantize_nvfp4(xp, g, pad_rows=1)
        xa = fmt.dequantize_nvfp4(pa, sa, g, torch.float32).double()[:, : layer.in_features]
        y = xa @ w.t()
    else:
        raise ValueError(path)
    if b is not None:
        y = y + b
    return y.reshape(*x.shape[:-1], layer.out_features)


# ----------------------------------------------------------------------------------------------------------
# keep rule, replace_linears, quantize_model_linears
# ----------------------------------------------------------------------------------------------------------
DEFAULT_KEEP_PATTERNS = (
    r"(^|\.)[^.]*(embed|embedding)[^.]*(\.|$)",                      # embeddings (x_embedder, pos_embed, ...)
    r"(^|\.)(emb_in|time_in|vector_in|guidance_in|t_embedder|y_embedder|time_text_embed|timestep\w*)(\.|$)",
    r"(^|\.)[^.]*norm[^.]*(\.|$)",                                   # norms
    r"(^|\.)(ada\w*|adaln\w*|\w*_mod|mod|modulation|\w*modulation\w*)(\.|$)",  # modulation / adaLN
    r"^(vid_in|vid_out|img_in|txt_in|patch_in|patch_out|patch_embed|final_layer|proj_in|proj_out|"
    r"conv_in|conv_out|x_embedder|norm_out|head)(\.|$)",             # patch-in / patch-out, first / last
)


def make_keep_rule(keep=None) -> Callable[[str, torch.nn.Module], bool]:
    """Build the "keep in high precision" rule.

    ``keep`` may be None (defaults), a callable ``(name, module) -> bool``, or an iterable of regular
    expressions (searched in the module name, case-insensitive) which *replace* the default name patterns.
    Layers whose K (in_features) is not a multiple of 16 are always kept.
    """
    if callable(keep):
        user = keep
    else:
        pats = [re.compile(p, re.IGNORECASE) for p in (DEFAULT_KEEP_PATTERNS if keep is None else keep)]

        def user(name, module):
            return any(p.search(name) for p in pats)

    def rule(name: str, module) -> bool:
        k = getattr(module, "in_features", None)
        if k is None and hasattr(module, "weight"):
            k = module.weight.shape[-1]
        if k is not None and k % 16:
            return True
        return bool(user(name, module))

    return rule


def _set_module(model: torch.nn.Module, name: str, new: torch.nn.Module):
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def _path_from_policy(policy) -> str:
    if policy is None:
        return "auto"
    if isinstance(policy, str):
        return policy
    return getattr(policy, "nvfp4_gemm", "auto")


def replace_linears(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], policy=None,
                    keep_high_precision=None, prefix: str = "", dtype=torch.bfloat16, metadata: Mapping | None = None,
                    nvfp4_source: str = "auto", fp8_mode: str = "cast", load_rest: bool = False) -> dict:
    """Swap every ``nn.Linear`` of ``model`` for the format ``state_dict`` holds for it and load its tensors.

    NVFP4 keys -> ``NVFP4Linear`` (path from ``policy.nvfp4_gemm``, a path string, or "auto"); FP8 weights ->
    ``FP8Linear``; plain weights are copied into the existing ``nn.Linear``. ``keep_high_precision=None``
    (default) honours the file's choice for every layer; ``"default"`` applies the default keep rule, or give a
    callable / list of patterns (see ``make_keep_rule``): a layer the rule selects is loaded as a plain
    ``nn.Linear`` in ``dtype`` even if the file holds it quantized (dequantized exactly).
    ``prefix`` is prepended to module names to form state-dict keys. ``load_rest=True`` then loads every
    other matching key with ``load_state_dict(strict=False)``. Returns a report
    ``{"nvfp4": [...], "fp8": [...], "plain": [...], "kept": [...], "missing": [...]}``.
    """
    if keep_high_precision is None:
        keep = lambda name, module: False  # noqa: E731 - honour the file
    else:
        keep = make_keep_rule(None if keep_high_precision == "default" else keep_high_precision)
    path = _path_from_policy(policy)
    report = {"nvfp4": [], "fp8": [], "plain": [], "kept": [], "missing": []}
    used = set()
    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear):
            continue
        key = prefix + name
        kind = detect_layer_format(state_dict, key, metadata)
        if kind is None:
            report["missing"].append(name)
            continue
        device = module.weight.device if module.weight.device.type != "meta" else torch.device("cpu")
        used.update(k for k in state_dict if k.startswith(key + "."))
        if kind == "nvfp4":
            d = load_nvfp4_layer(state_dict, key, module.out_features, module.in_features, nvfp4_source, metadata)
            if keep(name, module):
                _load_plain(module, d["weight"].dequantize(torch.float32), d["bias"], dtype, device)
                report["kept"].append(name)
                continue
            new = NVFP4Linear.from_nvfp4(d["weight"].to(device), d["bias"], d["input_scale"], path=path, dtype=dtype,
                                         pre_quant_scale=d["pre_quant_scale"])
            _set_module(model, name, new)
            report["nvfp4"].append(name)
        elif kind == "fp8":
            d = load_fp8_layer(state_dict, key)
            if keep(name, module):
                s = d["weight_scale"]
                w = d["weight"].float() * (s.reshape(-1, 1) if s.numel() > 1 else s)
                _load_plain(module, w, d["bias"], dtype, device)
                report["kept"].append(name)
                continue
            new = FP8Linear.from_fp8(d["weight"].to(device), d["weight_scale"], d["bias"], dtype=dtype, mode=fp8_mode,
                                     input_scale=d["input_scale"])
            _set_module(model, name, new)
            report["fp8"].append(name)
        else:
            _load_plain(module, state_dict[key + ".weight"], state_dict.get(key + ".bias"), None, device)
            report["plain"].append(name)
    if load_rest:
        rest = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix) and k not in used}
        model.load_state_dict(rest, strict=False)
    return report


def _load_plain(module: torch.nn.Linear, w, b, dtype, device):
    dtype = dtype or w.dtype
    module.weight = torch.nn.Parameter(w.detach().to(device=device, dtype=dtype), requires_grad=False)
    if b is not None:
        module.bias = torch.nn.Parameter(b.detach().to(device=device, dtype=dtype), requires_grad=False)


def quantize_model_linears(model: torch.nn.Module, policy=None, keep=None, fmt_name: str = "nvfp4",
                           recipe: str = "comfy", fp8_mode: str = "cast") -> dict:
    """Quantize an in-memory model's ``nn.Linear`` layers (NVFP4 or FP8) in place, layer by layer."""
    rule = make_keep_rule(keep)
    path = _path_from_policy(policy)
    report = {"quantized": [], "kept": []}
    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear):
            continue
        if rule(name, module):
            report["kept"].append(name)
            continue
        if fmt_name == "nvfp4":
            new = NVFP4Linear.from_linear(module, path=path, recipe=recipe, dtype=module.weight.dtype
                                          if module.weight.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16)
        elif fmt_name == "fp8":
            new = FP8Linear.from_linear(module, mode=fp8_mode)
        else:
            raise ValueError(f"format must be 'nvfp4' or 'fp8', got {fmt_name!r}")
        _set_module(model, name, new)
        report["quantized"].append(name)
    return report


def iter_quantized(model: torch.nn.Module) -> Iterable[tuple[str, torch.nn.Module]]:
    for name, m in model.named_modules():
        if isinstance(m, (NVFP4Linear, FP8Linear)):
            yield name, m
