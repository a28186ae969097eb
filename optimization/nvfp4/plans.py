"""Launch plans: the per-call host path of ``NVFP4Linear``.

The first call of a layer per input shape runs the full forward (every check, the dispatch, the kernel); then a
plan is recorded for that shape: a callable with everything that does not depend on the input's values decided
once (kernel, config, compiled kernels and their argument tuples, weight-side tensors). Per call it is left with a
pointer-alignment check, the output allocation and the raw launch(es) (+ ``torch._scaled_mm`` / cuBLAS).
``scripts/bench_nvfp4_host.py`` measures it on a CPU (GPU work stubbed): ~50-70 us -> ~5-10 us per call there.

A plan holds the layer's tensor objects, not their storage: ``t.data = ...`` (block swap) is seen at each call.
A plan returns None when it cannot take a call (misaligned pointer): the full forward runs instead.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from . import kernels, launch
from . import rs_w4a16 as R
from . import wgmma_w4a16 as W

log = logging.getLogger(__name__)


class LaunchPlans(dict):
    """(input shape, dtype, device index) -> the plan for such inputs, or None (every call runs the full forward).
    Dropped by the layer whenever anything a plan was built from changes (buffers, attributes, ``.to()``, load)."""
    MAX = 64             # plans kept per layer (input shapes); more: start over

    def run(self, layer, x: torch.Tensor) -> torch.Tensor:
        """The layer's forward: its plan for x, else its full forward (which records a plan)."""
        if self:
            plan = self.get((x.shape, x.dtype, x.get_device()))
            if plan is not None and x.is_contiguous():
                try:
                    y = plan(x)
                except Exception:  # noqa: BLE001 - launcher API differs in this Triton: normal launches from now on
                    launch.fast_launch_off()
                    self.clear()
                    y = None
                if y is not None:
                    return y
        return layer.forward_full(x)

    def record(self, x: torch.Tensor, plan) -> None:
        if len(self) >= self.MAX:
            self.clear()
        self[(x.shape, x.dtype, x.get_device())] = plan

    def for_input(self, x: torch.Tensor):
        """The plan recorded for inputs like x (KeyError: none recorded yet)."""
        return self[(x.shape, x.dtype, x.get_device())]


def make_plan(layer, x: torch.Tensor, x2: torch.Tensor, kernel: str):
    """The plan doing what the full forward just did with ``kernel`` for inputs like ``x`` (2-D view ``x2``), or
    None when such a call is not a planned one (pre_quant_scale, K padding, non-contiguous input, fast launch off,
    a kernel without plans, ...): then every call is full."""
    if (layer.pre_quant_scale is not None or not x.is_contiguous() or not launch.FAST_LAUNCH[0]
            or not launch.on_cuda(x) or layer.weight.shape[1] * 2 != layer.in_features or x2.shape[0] == 0):
        return None
    try:
        return kernel_plan(layer, x2, kernel, tuple(x.shape[:-1]) + (layer.out_features,))
    except Exception as exc:  # noqa: BLE001 - no plan: the full forward keeps working
        log.debug("NVFP4 launch plan not made: %s: %s", type(exc).__name__, exc)
        return None


def kernel_plan(layer, x2: torch.Tensor, kernel: str, out_shape: tuple):
    """The plan of one kernel of the dispatch for inputs like x2 (None for kernels without plans)."""
    w, s, g, n = layer.weight, layer.weight_scale, layer.weight_scale_2, layer.out_features
    if kernel == "dequant_cublas":
        return dequant_gemm_plan(layer, x2, out_shape)
    if kernel == "rs_w4a16":
        return R.rs_plan(x2, w, s, g, n, layer.bias_as(x2.dtype), out_shape)
    if kernel == "w4a16_wgmma":
        return W.wgmma_plan(x2, w, s, g, n, layer.bias, out_shape)
    if kernel == "w4a16_triton":
        return w4a16_plan(x2, w, s, g, n, layer.bias, out_shape)
    if kernel == "fp8_rowwise":
        return fp8_plan(layer, x2, out_shape)
    return None


def w4a16_plan(x, packed, block_scale, global_scale, n: int, bias, out_shape):
    """A launcher for later ``kernels.w4a16_linear(x', packed, block_scale, global_scale, n, bias)`` calls with x'
    of x's shape, dtype and device (contiguous), after this exact call has run once through ``w4a16_linear`` (so
    the compiled kernels are cached). Everything that does not depend on x' is decided here, once: config,
    grids, the kernels' argument tuples, the compiled kernels' handles. ``plan(x')`` allocates the output
    (``out_shape``, same memory layout as [M, n]) and the split-K partials, launches, returns the output;
    it returns None when a pointer is not 16-byte aligned (the caller then takes the normal path).
    Returns None when no plan can be made (fast launch off, global scale not fp32 on x's device, ...)."""
    if not launch.FAST_LAUNCH[0] or launch.INTERPRET or not x.is_contiguous():
        return None
    M, K = x.shape
    dev = x.device
    if (M == 0 or packed.shape[1] * 2 != K or x.dtype not in (torch.bfloat16, torch.float16)
            or global_scale.dtype != torch.float32 or global_scale.numel() != 1 or global_scale.device != dev
            or (bias is not None and bias.dtype != x.dtype)):
        return None
    cfg = kernels.w4a16_config(M, n, K, dev)
    sk = cfg[3]
    y = torch.empty((M, n), dtype=x.dtype, device=dev)
    ws = torch.empty((sk, M, n), dtype=torch.float32, device=dev) if sk > 1 else y
    g = global_scale.reshape(1)
    launches = kernels.w4a16_launches(x, packed, block_scale, g, bias, y, ws, M, n, K, cfg)
    kerns = [launch.cached_kernel(fn, args, consts, nw, ns) for fn, grid, args, consts, nw, ns in launches]
    if any(k is None for k in kerns):
        return None
    b = bias if bias is not None else global_scale
    k1 = kerns[0]
    _, (ga, gb, gc), args1, consts1, _, _ = launches[0]
    run1, f1, md1 = k1.run, k1.function, k1.packed_metadata
    tail1 = tuple(args1[7:]) + tuple(consts1.values())     # M, n, K, stride, NCB4, TILES_PER, constexprs
    out_shape = tuple(out_shape)
    index = dev.index
    if sk == 1:
        del y, ws, launches, args1

        def plan(xc):
            if (xc.data_ptr() | packed.data_ptr() | block_scale.data_ptr() | global_scale.data_ptr()
                    | b.data_ptr()) & 15:
                return None
            out = xc.new_empty(out_shape)          # x's dtype and device (cheaper than torch.empty(...))
            run1(ga, gb, gc, launch.raw_stream(index), f1, md1, None, None, None, xc, packed, block_scale,
                 global_scale, b, out, out, *tail1)
            return out
        return plan

    k2 = kerns[1]
    _, (ha, hb, hc), args2, consts2, _, _ = launches[1]
    run2, f2, md2 = k2.run, k2.function, k2.packed_metadata
    tail2 = tuple(args2[4:]) + tuple(consts2.values())     # MN, N, constexprs
    ws_shape = (sk, M, n)
    f32 = torch.float32
    del y, ws, launches, args1, args2

    def plan_split(xc):
        if (xc.data_ptr() | packed.data_ptr() | block_scale.data_ptr() | global_scale.data_ptr()
                | b.data_ptr()) & 15:
            return None
        out = xc.new_empty(out_shape)
        part = xc.new_empty(ws_shape, dtype=f32)
        stream = launch.raw_stream(index)
        run1(ga, gb, gc, stream, f1, md1, None, None, None, xc, packed, block_scale, global_scale, b, out, part,
             *tail1)
        run2(ha, hb, hc, stream, f2, md2, None, None, None, part, global_scale, b, out, *tail2)
        return out
    return plan_split


def dequant_plan(packed, block_scale, global_scale, shape, dtype, l2_keep: bool = False):
    """A launcher for later ``kernels.dequantize_nvfp4_triton(packed, block_scale, global_scale, shape, dtype,
    l2_keep=l2_keep)`` calls, after that exact call has run once (its autotuned config and compiled kernel are
    cached). Per call it only checks alignment, allocates the output (or takes ``out``: ``plan(out)``) and
    launches (~10 us of host time instead of ~50-150 us: at M = 4096 the 3072 x 3072 GEMM takes 0.12 ms, so the
    full call's host time showed in the GPU time). None when no plan can be made."""
    if (not launch.FAST_LAUNCH[0] or launch.INTERPRET or global_scale.dtype != torch.float32
            or global_scale.numel() != 1 or global_scale.device != packed.device):
        return None
    n, k = shape
    dev = packed.device
    l2_keep = bool(l2_keep)
    args, key, half_c = kernels.dequant_args(packed, block_scale, global_scale.reshape(1),
                                             torch.empty((n, k), dtype=dtype, device=dev), n, k, 0, l2_keep)
    ent = launch.FAST_CACHE.get(key)
    if ent is None:
        return None
    kern, br, bc = ent
    run, fn, md = kern.run, kern.function, kern.packed_metadata
    grid = (-(-n // br), -(-half_c // bc), 1)
    lut, tail = args[2], tuple(args[5:]) + (br, bc, kernels.W4A16_ASM_DECODE, l2_keep)
    index = dev.index
    del args

    def plan(out=None):
        if (packed.data_ptr() | block_scale.data_ptr() | global_scale.data_ptr()) & 15:
            return None
        w = torch.empty((n, k), dtype=dtype, device=dev) if out is None else out
        run(grid[0], grid[1], grid[2], launch.raw_stream(index), fn, md, None, None, None, packed, block_scale, lut,
            global_scale, w, *tail)
        return w
    return plan


def dequant_gemm_plan(layer, x2, out_shape):
    """Dequantize (cached launch) + cuBLAS for inputs like x2: what the layer's ``dequant_cublas`` kernel does."""
    dtype = x2.dtype
    if dtype not in (torch.bfloat16, torch.float16) or (layer.bias is not None and layer.bias.dtype != dtype):
        return None
    dq = dequant_plan(layer.weight, layer.weight_scale, layer.weight_scale_2,
                      (layer.out_features, layer.in_features), dtype, l2_keep=True)
    if dq is None:
        return None
    bias, flat, linear = layer.bias, len(out_shape) == 2, F.linear
    scratch_weight = layer.scratch_weight

    def plan(xc):
        w = dq(scratch_weight(xc, dtype))      # None (autograd keeps the weight): a fresh buffer
        if w is None:
            return None
        y = linear(xc, w, bias)
        return y if flat else y.view(out_shape)
    return plan


def fp8_plan(layer, x2, out_shape):
    """Per-token FP8 activations (cached launch) + ``torch._scaled_mm``: the layer's ``fp8_rowwise`` kernel."""
    if x2.dtype != torch.bfloat16 or (layer.bias is not None and layer.bias.dtype != torch.bfloat16):
        return None
    dev = x2.device
    m, k = x2.shape
    block_k, warps = kernels.act_fp8_config(k)
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=dev)
    s = torch.empty((m, 1), dtype=torch.float32, device=dev)
    kern = launch.cached_kernel(kernels.act_fp8_row_kernel, (x2, q, s, k, x2.stride(0)), dict(BLOCK_K=block_k), warps,
                                kernels.ACT_FP8_STAGES)
    if kern is None:
        return None
    # the FP8 copy is read through the layer at each call, never held here: BlockSwap and the stager drop it with
    # the weights (drop_derived), and a plan holding it kept a whole model's FP8 copies on the GPU after release
    fp8_weight = layer.fp8_weight
    b, fast_accum = layer.bias, layer.fp8_fast_accum_for(m, dev)
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
        run(m, 1, 1, launch.raw_stream(index), f, md, None, None, None, xc, xq, sx, *tail)
        w8, sw = fp8_weight(dev)
        y = torch._scaled_mm(xq, w8.t(), scale_a=sx, scale_b=sw.reshape(1, -1), out_dtype=bf16, bias=b,
                             use_fast_accum=fast_accum)
        return y if flat else y.view(out_shape)
    return plan
