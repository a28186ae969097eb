"""Hopper (sm_90a) fused NVFP4 x bf16 GEMM: the CUDA kernel in ``w4a16_wgmma.cu``, compiled at run time by NVRTC
(``torch.cuda._compile_kernel``: torch's CUDA wheels carry NVRTC, so users need no CUDA toolkit) and launched
through the driver with prebuilt argument arrays.

Why a CUDA kernel next to the Triton one: at M >= 256 the Triton kernel is bound by instruction issue (521
instructions per warp per K tile for 8 HGMMA, most of them layout shuffles between the decoder's output and the
wgmma register fragment; see docs/PERFORMANCE.md §8). Here each thread decodes exactly its own fragment
(3 integer instructions + 1 multiply per two weights) and wgmma reads it from registers.

Scope: bf16 activations, K % 64 == 0, N % 64 == 0 (every SeedVR2 / FLUX linear). Anything else, or any
compile / launch failure, returns None and the caller takes the Triton path.
"""
from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from ..runtime import knobs, selftests
from . import format as fmt
from . import launch

log = logging.getLogger(__name__)

_SOURCE_PATH = Path(__file__).with_name("w4a16_wgmma.cu")
_KERNELS: dict = {}          # config key -> Kernel, or None after a failure
DISABLED_REASONS: list = []  # why a configuration did not compile, or the self-test failed


def wgmma_call(bm: int, acc_arg: bool = False) -> str:
    """CUDA source of ``wgmma_bm``: one wgmma m64n{bm}k16, fp32 accumulators d[bm/2], A in registers, B by
    descriptor (K-major), accumulate into d; with acc_arg a last argument ``u32 acc``: D = A B + (acc ? D : 0)."""
    n = bm // 2
    dl = ", ".join(f"%{i}" for i in range(n))
    asm = (f"{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{n + 5}, 0;\\n"
           f"wgmma.mma_async.sync.aligned.m64n{bm}k16.f32.bf16.bf16 {{{dl}}}, "
           f"{{%{n}, %{n + 1}, %{n + 2}, %{n + 3}}}, %{n + 4}, p, 1, 1, 0;\\n}}\\n")
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(n))
    sig = ", u32 acc" if acc_arg else ""
    return (f"static __device__ __forceinline__ void wgmma_bm(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u64 desc{sig}) "
            f"{{\n"
            f'    asm volatile("{asm}"\n        : {outs}\n'
            f'        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"({"acc" if acc_arg else "1"}));\n}}\n')


COMMON_PATH = Path(__file__).with_name("sm90_common.cuh")


def kernel_source(wg: int, bm: int, stages: int, min_blocks: int, split: bool, has_bias: bool) -> tuple[str, str]:
    """(kernel name, CUDA source) for one configuration."""
    name = f"w4a16_wgmma_{wg}_{bm}_{stages}_{min_blocks}_{int(split)}_{int(has_bias)}"
    head = (f"#define WG {wg}\n#define BM {bm}\n#define STAGES {stages}\n#define MINB {min_blocks}\n"
            f"#define SPLIT {int(split)}\n#define HAS_BIAS {int(has_bias)}\n#define KERNEL_NAME {name}\n")
    body = _SOURCE_PATH.read_text().replace("//%%WGMMA%%", wgmma_call(bm), 1)
    return name, head + COMMON_PATH.read_text() + body


def smem_bytes(wg: int, bm: int, stages: int) -> int:
    stage = -(-(bm * 128 + 64 * wg * 32 + 512 * -(-wg // 2)) // 1024) * 1024
    return stages * stage + 1024          # + alignment slack (the kernel rounds its base up to 1024)


class Kernel:
    """A compiled configuration and a cheap launcher (one cuLaunchKernel through ctypes)."""

    def __init__(self, wg, bm, stages, min_blocks, split, has_bias):
        from torch.cuda import _utils as cu
        name, src = kernel_source(wg, bm, stages, min_blocks, split, has_bias)
        self.kernel = torch.cuda._compile_kernel(src, name, compute_capability="90a")
        self.smem = smem_bytes(wg, bm, stages)
        self.kernel.set_shared_memory_config(self.smem)
        self.threads = 128 * wg
        self._launch = cu._get_gpu_runtime_library().cuLaunchKernel
        self._check = cu._check_cuda

    def args(self, x, wp, wsc, g, bias, y, part, M, N, K, ncb4, tiles):
        vals = [ctypes.c_void_p(t.data_ptr()) for t in (x, wp, wsc, g, bias, y, part)]
        vals += [ctypes.c_int(v) for v in (M, N, K, x.stride(0), ncb4, tiles)]
        arr = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in vals])
        arr._values = vals          # the array holds bare addresses: the values must live as long as it does
        return vals, arr

    def launch(self, grid, arr, stream: int):
        self._check(self._launch(self.kernel.func, grid[0], grid[1], grid[2], self.threads, 1, 1, self.smem,
                                 ctypes.c_void_p(stream), arr, None))


def get_kernel(wg, bm, stages, min_blocks, split, has_bias):
    return launch.compiled(_KERNELS, DISABLED_REASONS, (wg, bm, stages, min_blocks, split, has_bias), Kernel,
                           "wgmma kernel (the Triton kernel is used)")


def supported(x: torch.Tensor, n: int, k: int, rows: int = 64) -> bool:
    """Shapes, dtype and device this kernel takes (``usable`` adds the switch and the self-test); ``rows``: the
    weight rows N must be a multiple of (the RS kernel's tile: 128)."""
    if not x.is_cuda or x.dtype != torch.bfloat16 or x.dim() != 2:
        return False
    if k % 64 or n % rows or x.shape[1] != k or x.stride(1) != 1 or x.stride(0) % 8:
        return False
    return torch.cuda.get_device_capability(x.device) == (9, 0)


def usable(x: torch.Tensor, n: int, k: int) -> bool:
    """Whether the fused W4A16 product of x [M, k] with an [n, k] NVFP4 weight can run on this kernel here:
    switch, shape, device, self-test (``dispatch.py`` decides for which M)."""
    return knobs.get("WGMMA") and supported(x, n, k) and selftest(x.device)


def default_min_blocks(wg: int, bm: int) -> int:
    """CTAs per SM the register budget is set for (``__launch_bounds__``' second argument): bm / 2 accumulator
    registers + ~56 others per thread (ptxas: 117-194 for the tiles in use), at most 3."""
    return max(1, min(3, 65536 // (128 * wg * (bm // 2 + 56))))


def config_for(m: int, n: int, k: int, device) -> tuple:
    """(wg, bm, stages, split_k). H100, device probe wgmma_probe.py at M = 256 on the six SeedVR2 shapes
    (commit e8b3e3a): one warpgroup x 128 tokens x 3 stages (3 CTAs per SM) was the fastest or within 5 % of it
    on every shape; SPLIT_K from the wave model of the Triton kernel with 3 CTA slots per SM picks the measured
    best split on 5 of 6 (1 / 3-4 / 1 / 4 / 1 / 4)."""
    wg, bm, stages = 1, 128, 3
    tiles = (n // (64 * wg)) * -(-m // bm)
    sk = launch.splitk_for(tiles, k // 64, m, n, 3 * launch.sm_count(torch.device(device)))
    return wg, bm, stages, sk


def _prepare(x, packed, block_scale, global_scale, n, bias, config, y, ws):
    wg, bm, stages, sk = config
    M, Kd = x.shape
    tiles = Kd // 64
    if tiles % sk:
        raise ValueError(f"SPLIT_K={sk} does not divide the {tiles} K tiles")
    if wg not in (1, 2, 4):     # a tile of more than one 128-row scale group must start on a group boundary
        raise ValueError(f"{wg} warpgroups: the kernel takes 1, 2 or 4")
    if n % (64 * wg):
        raise ValueError(f"N={n} is not a multiple of the {64 * wg}-row tile")
    kern = get_kernel(wg, bm, stages, default_min_blocks(wg, bm), sk > 1, bias is not None)
    if kern is None:
        return None
    g = global_scale.reshape(1)
    grid = (n // (64 * wg), -(-M // bm), sk)
    vals, arr = kern.args(x, packed, block_scale, g, bias if bias is not None else g, y, ws, M, n, Kd,
                          block_scale.shape[1] // 4, tiles // sk)
    return kern, grid, vals, arr


def wgmma_linear(x: torch.Tensor, packed, block_scale, global_scale, n: int, bias=None, config=None):
    """y[M, n] = x[M, K] @ dequant(W)^T (+ bias, x's dtype) with this kernel; config = (wg, bm, stages, split_k),
    default ``config_for``. x: bf16, contiguous rows, K = the packed weight's K. None when it cannot run here
    (``supported`` is false, or the kernel did not compile)."""
    M, Kd = x.shape
    if not supported(x, n, Kd) or packed.shape[1] * 2 != Kd:
        return None
    config = tuple(config or config_for(M, n, Kd, x.device))
    sk = config[3]
    y = torch.empty((M, n), dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    g = global_scale.to(device=x.device, dtype=torch.float32).reshape(1)
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    ws = torch.empty((sk, M, n), dtype=torch.float32, device=x.device) if sk > 1 else y
    got = _prepare(x, packed, block_scale, g, n, bias, config, y, ws)
    if got is None:
        return None
    kern, grid, _keep, arr = got
    kern.launch(grid, arr, launch.raw_stream(x.device.index))
    if sk > 1:
        launch.launch(*launch.reduce_launch(ws, g, bias, y, M, n, sk))
    return y


def wgmma_plan(x, packed, block_scale, global_scale, n: int, bias, out_shape):
    """Like ``kernels.w4a16_plan`` for this kernel: a launcher for later calls with inputs like x (same shape,
    dtype, device, contiguous), made after ``wgmma_linear`` ran this exact call once. Per call: an alignment
    check, the output (and split-K partials) allocation, the weight-side pointers re-read from the tensor objects
    (block swap replaces their storage), one cuLaunchKernel (+ the reduce). None when no plan can be made."""
    M, Kd = x.shape
    if (not usable(x, n, Kd) or not x.is_contiguous() or global_scale.dtype != torch.float32
            or global_scale.numel() != 1 or global_scale.device != x.device
            or (bias is not None and bias.dtype != x.dtype)):
        return None
    config = config_for(M, n, Kd, x.device)
    sk = config[3]
    y = torch.empty((M, n), dtype=x.dtype, device=x.device)
    ws = torch.empty((sk, M, n), dtype=torch.float32, device=x.device) if sk > 1 else y
    got = _prepare(x, packed, block_scale, global_scale, n, bias, config, y, ws)
    if got is None:
        return None
    kern, grid, vals, arr = got
    b = bias if bias is not None else global_scale
    reduce = None
    if sk > 1:
        fn, rgrid, rargs, consts, nw, ns = launch.reduce_launch(ws, global_scale.reshape(1), bias, y, M, n, sk)
        rk = launch.cached_kernel(fn, rargs, consts, nw, ns)
        if rk is None:
            return None
        reduce = (rk.run, rk.function, rk.packed_metadata, rgrid, tuple(rargs[4:]) + tuple(consts.values()))
    p_x, p_w, p_s, p_g, p_b, p_y, p_ws = vals[:7]
    index, out_shape, ws_shape, f32 = x.device.index, tuple(out_shape), (sk, M, n), torch.float32
    del y, ws

    def plan(xc):
        if (xc.data_ptr() | packed.data_ptr() | block_scale.data_ptr() | global_scale.data_ptr()
                | b.data_ptr()) & 15:
            return None
        out = xc.new_empty(out_shape)
        part = xc.new_empty(ws_shape, dtype=f32) if reduce is not None else out
        p_x.value, p_w.value, p_s.value = xc.data_ptr(), packed.data_ptr(), block_scale.data_ptr()
        p_g.value, p_b.value, p_y.value, p_ws.value = (global_scale.data_ptr(), b.data_ptr(), out.data_ptr(),
                                                       part.data_ptr())
        stream = launch.raw_stream(index)
        kern.launch(grid, arr, stream)
        if reduce is not None:
            run, f, md, (ga, gb, gc), tail = reduce
            run(ga, gb, gc, stream, f, md, None, None, None, part, global_scale, b, out, *tail)
        return out
    return plan


def selftest_problem(n: int, k: int, m: int, device):
    """(weight, x, bias, fp32 reference) of a self-test: an [n, k] NVFP4 weight with a zero block and subnormal
    block scales, m bf16 tokens, a bf16 bias."""
    gen = torch.Generator(device="cpu").manual_seed(7)
    w = torch.randn(n, k, generator=gen) * 0.02
    w[0, :16] = 0.0
    w[1, 16:32] *= 1e-5
    t = fmt.quantize_nvfp4(w, return_tensor=True).to(device)
    x = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
    bias = (torch.randn(n, generator=gen) * 0.1).to(device, torch.bfloat16)
    return t, x, bias, torch.nn.functional.linear(x.float(), t.dequantize(torch.float32), bias.float())


def selftest(device) -> bool:
    """Once per device: the kernel (plain and split-K, with bias) against the fp32 product of the dequantized
    weight on a small problem with edge rows and subnormal / zero block scales. Logs one line either way; a
    failure turns the kernel off for this device (the Triton kernel takes its place)."""
    return selftests.run("wgmma_w4a16", device, check=_check)[0]


def _check(_variant, device) -> tuple[bool, str]:
    try:
        t, x, bias, ref = selftest_problem(128, 256, 130, device)
        worst = 0.0
        for cfg in ((1, 128, 3, 1), (1, 128, 3, 2)):
            y = wgmma_linear(x, t.packed, t.block_scale, t.global_scale, 128, bias, cfg)
            if y is None:
                raise RuntimeError(DISABLED_REASONS[-1] if DISABLED_REASONS else "kernel unavailable")
            worst = max(worst, ((y.float() - ref).norm() / ref.norm()).item())
        if not worst < 1e-2:
            raise RuntimeError(f"self-test relative error {worst:.3g} (expected ~2e-3)")
    except Exception as exc:  # noqa: BLE001
        DISABLED_REASONS.append(f"self-test: {type(exc).__name__}: {str(exc)[:300]}")
        log.warning("[SeedVR2-BW] NVFP4 fidelity: sm_90a wgmma W4A16 kernel off for %s, the Triton kernel is "
                    "used (%s)", device, DISABLED_REASONS[-1])
        return False, DISABLED_REASONS[-1]
    log.info("[SeedVR2-BW] NVFP4 fidelity: sm_90a wgmma W4A16 kernel on for %s (self-test rel err %.2e; "
             "SEEDVR2BW_WGMMA=off turns it off)", device, worst)
    return True, f"rel err {worst:.2e}"
