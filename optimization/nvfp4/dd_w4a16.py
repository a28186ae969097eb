"""Hopper (sm_90a) fused NVFP4 x bf16 GEMM for large M with the decode shared between CTAs: the persistent kernel in
``w4a16_dd.cu`` (each 64-k slice of a 128-row weight tile is decoded once, by one of the CTAs that need it, into a
bf16 scratch copy of W, flagged ready; every CTA then copies bf16 tiles by TMA as a bf16 GEMM would). Compiled at
run time by NVRTC like ``wgmma_w4a16.py``. Probe stage (``scripts/device/dd_probe.py``): not wired into a path.

Scope: bf16 activations with contiguous rows, K % 64 == 0, N % 128 == 0. Anything else, or any compile / launch failure, returns None and the caller keeps its other path.
"""
from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE_PATH = Path(__file__).with_name("w4a16_dd.cu")
_KERNELS: dict = {}
_DISABLED_REASON: list = []
MAX_SMEM = 232448            # sm_90 opt-in shared memory per block


def wgmma_call(tn: int) -> str:
    """CUDA source of ``wgmma_ss``: one wgmma m64n{tn}k16, fp32 accumulators d[tn/2], A and B by descriptor
    (both K-major), D = A B + (acc ? D : 0)."""
    n = tn // 2
    dl = ", ".join(f"%{i}" for i in range(n))
    asm = (f"{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{n + 2}, 0;\\n"
           f"wgmma.mma_async.sync.aligned.m64n{tn}k16.f32.bf16.bf16 {{{dl}}}, %{n}, %{n + 1}, p, 1, 1, 0, 0;\\n}}\\n")
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(n))
    return (f"static __device__ __forceinline__ void wgmma_ss(float* d, u64 desc_a, u64 desc_b, u32 acc) {{\n"
            f'    asm volatile("{asm}"\n        : {outs}\n'
            f'        : "l"(desc_a), "l"(desc_b), "r"(acc));\n}}\n')


def smem_bytes(tn: int, stages: int, epi_tok: int) -> int:
    """Dynamic shared memory: the ring (TN tokens + 128 weight rows, 64 k each, bf16), the epilogue staging of the
    two consumer warpgroups, 1024-byte alignment slack."""
    return stages * (tn + 128) * 128 + 2 * epi_tok * 128 + 1024


def kernel_source(tn, stages, epi_tok, cluster, has_bias, diag=0):
    name = f"w4a16_dd_{tn}_{stages}_{epi_tok}_{cluster}_{int(has_bias)}_{diag}"
    head = (f"#define TN {tn}\n#define STAGES {stages}\n#define EPI_TOK {epi_tok}\n#define CLUSTER {cluster}\n"
            f"#define DIAG {diag}\n#define HAS_BIAS {int(has_bias)}\n#define KERNEL_NAME {name}\n")
    body = _SOURCE_PATH.read_text().replace("//%%WGMMA%%", wgmma_call(tn), 1)
    return name, head + body


def tile_map(x: torch.Tensor, rows: int):
    """CUtensorMap of x[R, K] (bf16, row stride x.stride(0)) for TMA boxes of 64 k x `rows` rows, 128-byte swizzle,
    out-of-range rows read as zeros."""
    from torch.cuda import _utils as cu
    lib = cu._get_gpu_runtime_library()
    tmap = (ctypes.c_uint64 * 16)()
    dims = (ctypes.c_uint64 * 2)(x.shape[1], x.shape[0])
    strides = (ctypes.c_uint64 * 1)(x.stride(0) * 2)
    box = (ctypes.c_uint32 * 2)(64, rows)
    estr = (ctypes.c_uint32 * 2)(1, 1)
    uint16, no_interleave, swizzle_128b, l2_promote_128b, oob_zero = 1, 0, 3, 2, 0
    cu._check_cuda(lib.cuTensorMapEncodeTiled(tmap, uint16, 2, ctypes.c_void_p(x.data_ptr()), dims, strides, box,
                                              estr, no_interleave, swizzle_128b, l2_promote_128b, oob_zero))
    return tmap


class _LaunchConfig(ctypes.Structure):      # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("num_attrs", ctypes.c_uint)]


class _LaunchAttr(ctypes.Structure):        # CUlaunchAttribute: id, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_uint * 16)]


_CLUSTER_DIMENSION = 4                      # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION


class _Kernel:
    def __init__(self, tn, stages, epi_tok, cluster, has_bias, diag):
        from torch.cuda import _utils as cu
        if tn not in (128, 256) or tn % epi_tok or epi_tok % 16 or cluster not in (1, 2):
            raise ValueError(f"config {(tn, epi_tok)} does not tile")
        name, src = kernel_source(tn, stages, epi_tok, cluster, has_bias, diag)
        self.cluster = cluster
        self.smem = smem_bytes(tn, stages, epi_tok)
        if self.smem > MAX_SMEM:
            raise ValueError(f"{self.smem} B of shared memory > {MAX_SMEM}")
        self.kernel = torch.cuda._compile_kernel(src, name, compute_capability="90a")
        self.kernel.set_shared_memory_config(self.smem)
        self.threads = 384
        lib = cu._get_gpu_runtime_library()
        self._launch = lib.cuLaunchKernel
        self._launch_ex = lib.cuLaunchKernelEx
        self._check = cu._check_cuda
        # the whole grid must be resident at once (CTAs wait for each other's decode flags): at most this many CTAs
        self.max_ctas = None
        if cluster > 1:
            n = ctypes.c_int(0)
            sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
            attr = _LaunchAttr(_CLUSTER_DIMENSION, 0, (ctypes.c_uint * 16)(cluster, 1, 1))
            conf = _LaunchConfig((ctypes.c_uint * 3)(sms - sms % cluster, 1, 1), (ctypes.c_uint * 3)(self.threads, 1, 1),
                                 self.smem, None, ctypes.cast(ctypes.byref(attr), ctypes.c_void_p), 1)
            self._check(lib.cuOccupancyMaxActiveClusters(ctypes.byref(n), self.kernel.func, ctypes.byref(conf)))
            self.max_ctas = n.value * cluster

    def launch(self, grid: int, args: list, stream: int):
        arr = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in args])
        if self.cluster == 1:
            self._check(self._launch(self.kernel.func, grid, 1, 1, self.threads, 1, 1, self.smem,
                                     ctypes.c_void_p(stream), arr, None))
            return
        attr = _LaunchAttr(_CLUSTER_DIMENSION, 0, (ctypes.c_uint * 16)(self.cluster, 1, 1))
        conf = _LaunchConfig((ctypes.c_uint * 3)(grid, 1, 1), (ctypes.c_uint * 3)(self.threads, 1, 1), self.smem,
                             ctypes.c_void_p(stream), ctypes.cast(ctypes.byref(attr), ctypes.c_void_p), 1)
        self._check(self._launch_ex(ctypes.byref(conf), self.kernel.func, arr, None))


def get_kernel(tn, stages, epi_tok, cluster, has_bias):
    key = (tn, stages, epi_tok, cluster, has_bias, DIAG[0])
    if key not in _KERNELS:
        try:
            _KERNELS[key] = _Kernel(*key)
        except Exception as e:  # noqa: BLE001 - no NVRTC, old driver, compile error: the caller's path stays
            _KERNELS[key] = None
            _DISABLED_REASON.append(f"{key}: {type(e).__name__}: {str(e)[:400]}")
            log.warning("NVFP4 shared-decode kernel %s unavailable (%s)", key, e)
    return _KERNELS[key]


DEFAULT_CONFIG = (256, 4, 64, 1)  # (tokens per tile, stages, epilogue tokens per staging round, cluster size)
_SYNC: dict = {}                  # (device, weight tiles, k tiles) -> (flags, [epoch, done count]) int32 tensors


def _sync_buffers(device, num_nt: int, kt: int):
    key = (device, num_nt, kt)
    if key not in _SYNC:
        _SYNC[key] = (torch.zeros(num_nt * kt, dtype=torch.int32, device=device),
                      torch.zeros(2, dtype=torch.int32, device=device))
    return _SYNC[key]
DIAG = [0]                        # probe-only kernel knobs (see the .cu's DIAG); 0 in production


def dd_linear(x: torch.Tensor, packed, block_scale, global_scale, n: int, bias=None, config=None,
              grid: int | None = None):
    """y[M, n] = x[M, K] @ dequant(W)^T (+ bias) with this kernel, or None when it cannot run here."""
    from . import kernels as K
    M, Kd = x.shape
    tn, stages, epi_tok, cluster = config or DEFAULT_CONFIG
    bn = 128
    if (not x.is_cuda or x.dtype != torch.bfloat16 or x.stride(1) != 1 or x.stride(0) % 8 or Kd % 64
            or x.data_ptr() % 16
            or n % (bn * cluster) or packed.shape[1] * 2 != Kd
            or torch.cuda.get_device_capability(x.device) != (9, 0)):
        return None
    y = torch.empty((M, n), dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    num_mt, num_nt = -(-M // tn), n // bn
    kern = get_kernel(tn, stages, epi_tok, cluster, bias is not None)
    if kern is None:
        return None
    grid = min(num_mt * num_nt, grid or K._sm_count(x.device), kern.max_ctas or 1 << 30)
    grid -= grid % cluster
    g = global_scale.to(device=x.device, dtype=torch.float32).reshape(1)
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    scratch = torch.empty((n, Kd), dtype=torch.bfloat16, device=x.device)
    flags, sync = _sync_buffers(x.device, num_nt, Kd // 64)
    args = [tile_map(x, tn // cluster), tile_map(scratch, bn)]
    args += [ctypes.c_void_p(t.data_ptr()) for t in (packed, block_scale, g, bias if bias is not None else g, y,
                                                     scratch, flags, sync)]
    args += [ctypes.c_int(v) for v in (M, n, Kd, block_scale.shape[1] // 4)]
    kern.launch(grid, args, K.raw_stream(x.device.index))
    return y
