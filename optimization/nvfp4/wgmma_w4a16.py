"""Hopper (sm_90a) fused NVFP4 x bf16 GEMM: the CUDA kernel in ``w4a16_wgmma.cu``, compiled at run time by NVRTC
(``torch.cuda._compile_kernel``: torch's CUDA wheels carry NVRTC, so users need no CUDA toolkit) and launched
through the driver with prebuilt argument arrays.

Why a CUDA kernel next to the Triton one: at M >= 256 the Triton kernel is bound by instruction issue (521
instructions per warp per K tile for 8 HGMMA, most of them layout shuffles between the decoder's output and the
wgmma register fragment; see docs/BENCHMARKS.md, session 6). Here each thread decodes exactly its own fragment
(3 integer instructions + 1 multiply per two weights) and wgmma reads it from registers.

Scope: bf16 activations, K % 64 == 0, N % 64 == 0 (every SeedVR2 / FLUX linear). Anything else, or any
compile / launch failure, returns None and the caller takes the Triton path.
"""
from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE_PATH = Path(__file__).with_name("w4a16_wgmma.cu")
ENABLED = [os.environ.get("SEEDVR2BW_WGMMA", "1") != "0"]
_KERNELS: dict = {}          # config key -> _Kernel, or None after a failure
_DISABLED_REASON: list = []


def wgmma_call(bm: int) -> str:
    """CUDA source of ``wgmma_bm``: one wgmma m64n{bm}k16, fp32 accumulators d[bm/2], A in registers, B by
    descriptor (K-major), accumulate into d."""
    n = bm // 2
    dl = ", ".join(f"%{i}" for i in range(n))
    asm = (f"{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{n + 5}, 0;\\n"
           f"wgmma.mma_async.sync.aligned.m64n{bm}k16.f32.bf16.bf16 {{{dl}}}, "
           f"{{%{n}, %{n + 1}, %{n + 2}, %{n + 3}}}, %{n + 4}, p, 1, 1, 0;\\n}}\\n")
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(n))
    return (f"static __device__ __forceinline__ void wgmma_bm(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u64 desc) {{\n"
            f'    asm volatile("{asm}"\n        : {outs}\n'
            f'        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1));\n}}\n')


def kernel_source(wg: int, bm: int, stages: int, min_blocks: int, split: bool, has_bias: bool) -> tuple[str, str]:
    """(kernel name, CUDA source) for one configuration."""
    name = f"w4a16_wgmma_{wg}_{bm}_{stages}_{min_blocks}_{int(split)}_{int(has_bias)}"
    head = (f"#define WG {wg}\n#define BM {bm}\n#define STAGES {stages}\n#define MINB {min_blocks}\n"
            f"#define SPLIT {int(split)}\n#define HAS_BIAS {int(has_bias)}\n#define KERNEL_NAME {name}\n")
    body = _SOURCE_PATH.read_text().replace("//%%WGMMA%%", wgmma_call(bm), 1)
    return name, head + body


def smem_bytes(wg: int, bm: int, stages: int) -> int:
    stage = -(-(bm * 128 + 64 * wg * 32 + 512) // 1024) * 1024
    return stages * stage + 1024          # + alignment slack (the kernel rounds its base up to 1024)


class _Kernel:
    """A compiled configuration and a cheap launcher (one cuLaunchKernel through ctypes)."""

    def __init__(self, wg, bm, stages, min_blocks, split, has_bias):
        from torch.cuda import _utils as cu
        name, src = kernel_source(wg, bm, stages, min_blocks, split, has_bias)
        self.kernel = torch.cuda._compile_kernel(src, name, compute_capability="90a")
        self.smem = smem_bytes(wg, bm, stages)
        self.kernel.set_shared_memory_config(self.smem)
        self.threads = 128 * wg
        self.wg, self.bm = wg, bm
        self._launch = cu._get_gpu_runtime_library().cuLaunchKernel
        self._check = cu._check_cuda

    def args(self, x, wp, wsc, g, bias, y, part, M, N, K, ncb4, tiles):
        vals = [ctypes.c_void_p(t.data_ptr()) for t in (x, wp, wsc, g, bias, y, part)]
        vals += [ctypes.c_int(v) for v in (M, N, K, x.stride(0), ncb4, tiles)]
        arr = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in vals])
        return vals, arr

    def launch(self, grid, arr, stream: int):
        self._check(self._launch(self.kernel.func, grid[0], grid[1], grid[2], self.threads, 1, 1, self.smem,
                                 ctypes.c_void_p(stream), arr, None))


def get_kernel(wg, bm, stages, min_blocks, split, has_bias):
    key = (wg, bm, stages, min_blocks, split, has_bias)
    if key not in _KERNELS:
        try:
            _KERNELS[key] = _Kernel(*key)
        except Exception as e:  # noqa: BLE001 - no NVRTC, old driver, compile error: the Triton path stays
            _KERNELS[key] = None
            _DISABLED_REASON.append(f"{key}: {type(e).__name__}: {str(e)[:300]}")
            log.warning("NVFP4 wgmma kernel %s unavailable (%s); the Triton kernel is used", key, e)
    return _KERNELS[key]


def supported(x: torch.Tensor, n: int, k: int) -> bool:
    """Shapes, dtype and device this kernel takes (the policy decides whether to use it)."""
    if not ENABLED[0] or not x.is_cuda or x.dtype != torch.bfloat16:
        return False
    if k % 64 or n % 64 or x.shape[-1] != k or x.stride(-1) != 1 or x.stride(0) % 8:
        return False
    major, minor = torch.cuda.get_device_capability(x.device)
    return (major, minor) == (9, 0)


def launches(x, packed, block_scale, g, bias, y, ws, M, n, K, cfg):
    """(kernel, grid, arg keepalive, arg array) for one product; cfg = (wg, bm, stages, min_blocks, split_k)."""
    wg, bm, stages, minb, sk = cfg
    tiles = K // 64
    if tiles % sk:
        raise ValueError(f"SPLIT_K={sk} does not divide the {tiles} K tiles")
    if n % (64 * wg):
        raise ValueError(f"N={n} is not a multiple of the {64 * wg}-row tile")
    kern = get_kernel(wg, bm, stages, minb, sk > 1, bias is not None)
    if kern is None:
        return None
    grid = (n // (64 * wg), -(-M // bm), sk)
    vals, arr = kern.args(x, packed, block_scale, g, bias if bias is not None else g, y, ws, M, n, K,
                          block_scale.shape[1] // 4, tiles // sk)
    return kern, grid, vals, arr


def default_min_blocks(wg: int, bm: int) -> int:
    """CTAs per SM the register budget is set for (``__launch_bounds__``' second argument)."""
    return 1 if wg * bm >= 512 else (2 if wg * bm >= 256 else 3)


def wgmma_linear(x: torch.Tensor, packed, block_scale, global_scale, n: int, bias=None, config=None):
    """y[M, n] = x[M, K] @ dequant(W)^T (+ bias) with the wgmma kernel; config = (wg, bm, stages, split_k).
    Returns None when this kernel cannot run (shape, dtype, device or compile failure)."""
    from . import kernels as K
    M, Kd = x.shape
    if not supported(x, n, Kd) or packed.shape[1] * 2 != Kd:
        return None
    wg, bm, stages, sk = config
    y = torch.empty((M, n), dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    g = global_scale.to(device=x.device, dtype=torch.float32).reshape(1)
    ws = torch.empty((sk, M, n), dtype=torch.float32, device=x.device) if sk > 1 else y
    got = launches(x, packed, block_scale, g, bias, y, ws, M, n, Kd,
                   (wg, bm, stages, default_min_blocks(wg, bm), sk))
    if got is None:
        return None
    kern, grid, _keep, arr = got
    kern.launch(grid, arr, torch.cuda.current_stream(x.device).cuda_stream)
    if sk > 1:
        b = bias if bias is not None else g
        mn = M * n
        K._launch(K._splitk_reduce_kernel, (-(-mn // 1024), 1, 1), (ws, g, b, y, mn, n),
                  dict(HAS_BIAS=bias is not None, SPLIT_K=sk, BLOCK=1024), 4, 3)
    return y
