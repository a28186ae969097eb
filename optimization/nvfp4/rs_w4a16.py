"""Hopper (sm_90a) fused NVFP4 x bf16 GEMM for large M: the persistent, warp-specialized kernel in ``w4a16_rs.cu``
(TMA producer, two consumer warpgroups that decode the weight straight into wgmma's A registers while three wgmma
groups are queued, stream-K for the tiles of a last partial round). Compiled at run time by NVRTC
(``torch.cuda._compile_kernel``, no CUDA toolkit needed) and launched through the driver, like ``wgmma_w4a16.py``
(the small-M kernel).

Scope: bf16 activations with contiguous rows (16-byte aligned), K % 64 == 0, N % 128 == 0 (every SeedVR2 / FLUX
linear), sm_90. Anything else, or any compile / launch failure, returns None and the caller keeps its other path.
Which M it gets: ``dispatch.py``.
"""
from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from ..runtime import device_cache, knobs, selftests
from . import launch
from . import wgmma_w4a16 as W

log = logging.getLogger(__name__)

_SOURCE_PATH = Path(__file__).with_name("w4a16_rs.cu")
MAX_SMEM = 232448            # sm_90 opt-in shared memory per block
BN = 128                     # weight rows per tile
_KERNELS: dict = {}          # config key -> Kernel, or None after a failure
DISABLED_REASONS: list = []  # why a configuration did not compile, or the self-test failed


def kernel_source(tn: int, stages: int, has_bias: bool) -> tuple[str, str]:
    """(kernel name, CUDA source) for one configuration."""
    name = f"w4a16_rs_{tn}_{stages}_{int(has_bias)}"
    head = f"#define TN {tn}\n#define STAGES {stages}\n#define HAS_BIAS {int(has_bias)}\n#define KERNEL_NAME {name}\n"
    body = _SOURCE_PATH.read_text().replace("//%%WGMMA%%", W.wgmma_call(tn, acc_arg=True), 1)
    return name, head + W.COMMON_PATH.read_text() + body


def slot_bytes(tn: int) -> int:
    return -(-(tn * 128 + BN * 32 + 512) // 1024) * 1024


def smem_bytes(tn: int, stages: int) -> int:
    """Dynamic shared memory: the ring, the two consumer warpgroups' output tiles (TMA store staging), 1024-byte
    alignment slack."""
    return stages * slot_bytes(tn) + 2 * tn * 128 + 1024


def max_stages(tn: int) -> int:
    return (MAX_SMEM - 2 * tn * 128 - 1024) // slot_bytes(tn)


def check_config(tn, stages):
    # >= 3 stages: the consumers wait for k tile t + 1 before they release k tile t - 1
    if tn % 16 or not 64 <= tn <= 256 or stages < 3:
        raise ValueError(f"config {(tn, stages)} does not tile")
    if smem_bytes(tn, stages) > MAX_SMEM:
        raise ValueError(f"{smem_bytes(tn, stages)} B of shared memory > {MAX_SMEM}")


_CU_TENSOR_MAP = dict(uint8=0, uint16=1, no_interleave=0, no_swizzle=0, swizzle_128b=3, l2_promote_128b=2,
                      oob_zero=0)


def _encode_map(ptr: int, dtype_code: int, inner: int, rows: int, row_bytes: int, box_inner: int, box_rows: int,
                swizzle: int):
    """A CUtensorMap (128 bytes) of a row-major 2-D tensor: `inner` elements a row, `rows` rows `row_bytes` apart;
    TMA boxes of box_inner x box_rows; rows past the end read as zeros (and are not written by stores)."""
    from torch.cuda import _utils as cu
    lib = cu._get_gpu_runtime_library()
    tmap = (ctypes.c_uint64 * 16)()
    dims = (ctypes.c_uint64 * 2)(inner, rows)
    strides = (ctypes.c_uint64 * 1)(row_bytes)
    box = (ctypes.c_uint32 * 2)(box_inner, box_rows)
    estr = (ctypes.c_uint32 * 2)(1, 1)
    c = _CU_TENSOR_MAP
    cu._check_cuda(lib.cuTensorMapEncodeTiled(tmap, dtype_code, 2, ctypes.c_void_p(ptr), dims, strides, box, estr,
                                              c["no_interleave"], swizzle, c["l2_promote_128b"], c["oob_zero"]))
    return tmap


def x_map(x: torch.Tensor, rows: int):
    """Tensor map of a bf16 matrix x[R, C] (activations, or the output): boxes of 64 columns x `rows` rows, 128-byte
    swizzle."""
    return _encode_map(x.data_ptr(), _CU_TENSOR_MAP["uint16"], x.shape[1], x.shape[0], x.stride(0) * 2, 64, rows,
                       _CU_TENSOR_MAP["swizzle_128b"])


def w_map(packed: torch.Tensor):
    """Tensor map of the packed weight [N, K/2] (uint8): boxes of 32 bytes (64 k) x 128 rows, no swizzle."""
    return _encode_map(packed.data_ptr(), _CU_TENSOR_MAP["uint8"], packed.shape[1], packed.shape[0],
                       packed.stride(0), 32, BN, _CU_TENSOR_MAP["no_swizzle"])


class Kernel:
    """A compiled configuration and its launcher (one cuLaunchKernel through ctypes)."""
    threads = 384

    def __init__(self, tn, stages, has_bias):
        from torch.cuda import _utils as cu
        check_config(tn, stages)
        name, src = kernel_source(tn, stages, has_bias)
        self.smem = smem_bytes(tn, stages)
        self.kernel = torch.cuda._compile_kernel(src, name, compute_capability="90a")
        self.kernel.set_shared_memory_config(self.smem)
        lib = cu._get_gpu_runtime_library()
        self._launch, self._check = lib.cuLaunchKernel, cu._check_cuda

    def launch(self, grid: int, arr, stream: int):
        self._check(self._launch(self.kernel.func, grid, 1, 1, self.threads, 1, 1, self.smem,
                                 ctypes.c_void_p(stream), arr, None))


def get_kernel(tn, stages, has_bias):
    return launch.compiled(_KERNELS, DISABLED_REASONS, (tn, stages, has_bias), Kernel, "RS W4A16 kernel")


def supported(x: torch.Tensor, n: int, k: int) -> bool:
    """Shapes, dtype and device this kernel takes."""
    return W.supported(x, n, k, rows=BN)


TILE_TOKENS = (256, 224)


def tiles(m: int, n: int, tn: int) -> int:
    return -(-m // tn) * (n // BN)


def config_for(m: int, n: int, k: int, sms: int = 132) -> tuple:
    """(tn, stages): 256 tokens a tile, or 224 when that makes the rounds x tokens of the persistent grid >= 5 %
    less (each decoded weight feeds tn tokens, so fewer cost more than their share: 192 tokens measured 0.66-0.85x
    bf16, 128 0.65x, on the SeedVR2 shapes). The tail of a last partial round is stream-K (``split``), so rounds
    count fractionally here."""
    kt = k // 64

    def cost(tn):
        dp, sk, g_sk = split(tiles(m, n, tn), kt, sms)
        return (-(-dp // sms) * kt + (-(-sk * kt // g_sk) + SK_FIXUP if sk else 0)) * tn
    tn = 224 if cost(224) < 0.95 * cost(256) else 256
    return tn, min(4, max_stages(tn))


MIN_SK_UNITS = 8             # stream-K: at least this many k tiles a CTA
SK_FIXUP = 4                 # stream-K: the partial sums' write + read cost about this many k tiles


def split(n_tiles: int, kt: int, sms: int) -> tuple[int, int, int]:
    """(dp_tiles, sk_tiles, g_sk): data-parallel tiles (whole rounds of ``sms`` CTAs), then the remaining tiles
    stream-K over g_sk CTAs, when that saves at least 2 x SK_FIXUP k tiles on one more round (kt k tiles vs
    kt x sk_tiles / g_sk + the partial sums' cost). H100, bench_nvfp4 5c5f014: 120 tiles of 48 k tiles split over
    132 CTAs (a 0.4 k-tile gain, every tile through the workspace) ran at 0.50x bf16, dequantize + cuBLAS 0.76x."""
    rem = n_tiles % sms
    if rem == 0 or kt < 2 * MIN_SK_UNITS:
        return n_tiles, 0, 1
    g_sk = min(sms, rem * kt // MIN_SK_UNITS)
    if g_sk <= rem or -(-rem * kt // g_sk) + 3 * SK_FIXUP > kt:
        return n_tiles, 0, 1
    return n_tiles - rem, rem, g_sk


_SK_BUFFERS: dict = device_cache.cache()     # (device, stream) -> (workspace, flags); flags return to 0 after every launch


def _sk_buffers(device, stream: int, tn: int, ctas: int):
    key = (str(device), stream)
    need = ctas * 256 * (tn // 2)
    ws, flags = _SK_BUFFERS.get(key, (None, None))
    if ws is None or ws.numel() < need or flags.numel() < ctas:
        ws = torch.empty(need, dtype=torch.float32, device=device)
        flags = torch.zeros(ctas, dtype=torch.int32, device=device)
        _SK_BUFFERS[key] = (ws, flags)
    return ws, flags


def launch_args(xmap, wmap, ymap, block_scale, g, bias, ws, flags, ints):
    vals = [xmap, wmap, ymap]
    vals += [ctypes.c_void_p(t.data_ptr()) for t in (block_scale, g, bias, ws, flags)]
    vals += [ctypes.c_int(v) for v in ints]
    arr = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in vals])
    arr._values = vals          # the array holds bare addresses: the values must live as long as it does
    return arr


def _launch_setup(M, n, Kd, has_bias, sms, config=None, stream_k=True):
    """(kernel, tokens per tile, CTAs, the kernel's int arguments after ncb4) for a call, or None when the kernel
    did not compile."""
    tn, stages = config or config_for(M, n, Kd, sms)
    kern = get_kernel(tn, stages, has_bias)
    if kern is None:
        return None
    n_tiles = tiles(M, n, tn)
    dp, sk, g_sk = split(n_tiles, Kd // 64, sms) if stream_k else (n_tiles, 0, 1)
    return kern, tn, (min(n_tiles, sms) if sk == 0 else sms), (dp, sk, g_sk)


def rs_linear(x: torch.Tensor, packed, block_scale, global_scale, n: int, bias=None, config=None,
              grid: int | None = None, out: torch.Tensor | None = None, stream_k: bool = True):
    """y[M, n] = x[M, K] @ dequant(W)^T (+ bias) with this kernel, or None when it cannot run here.
    config = (tn, stages), default ``config_for``; grid: CTAs (default: the SM count); out: a contiguous [M, n]
    bf16 tensor to write (tests poison it first); stream_k=False: whole tiles only."""
    M, Kd = x.shape
    if (not supported(x, n, Kd) or packed.shape[1] * 2 != Kd or packed.shape[0] < n
            or (x.data_ptr() | packed.data_ptr() | block_scale.data_ptr()) % 16):
        return None
    sms = grid or launch.sm_count(x.device)
    y = out if out is not None else torch.empty((M, n), dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    setup = _launch_setup(M, n, Kd, bias is not None, sms, config, stream_k)
    if setup is None:
        return None
    kern, tn, ctas, work = setup
    stream = launch.raw_stream(x.device.index)
    ws, flags = _sk_buffers(x.device, stream, tn, sms)
    g = global_scale.to(device=x.device, dtype=torch.float32).reshape(1)
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    arr = launch_args(x_map(x, tn), w_map(packed), x_map(y, tn), block_scale, g, bias if bias is not None else g, ws,
                      flags, (M, n, Kd, block_scale.shape[1] // 4, *work))
    kern.launch(ctas, arr, stream)
    return y


def usable(x: torch.Tensor, n: int, k: int) -> bool:
    """Whether the product of x [M, k] with an [n, k] NVFP4 weight can run on this kernel here: switch, shape,
    device and the per-device self-test (``dispatch.py`` decides for which M)."""
    return knobs.get("RS_KERNEL") and supported(x, n, k) and selftest(x.device)


def rs_plan(x, packed, block_scale, global_scale, n: int, bias, out_shape):
    """A launcher for later calls with inputs like x (same shape, dtype, device, contiguous), made after
    ``rs_linear`` ran this exact call once. Per call: an alignment check, the output allocation, the tensor maps of
    x and the output (and of the weight, if block swap moved it), one cuLaunchKernel. None when no plan can be
    made."""
    M, Kd = x.shape
    if (not usable(x, n, Kd) or not x.is_contiguous() or global_scale.dtype != torch.float32
            or global_scale.numel() != 1 or global_scale.device != x.device
            or (bias is not None and bias.dtype != x.dtype)):
        return None
    sms = launch.sm_count(x.device)
    setup = _launch_setup(M, n, Kd, bias is not None, sms)
    if setup is None:
        return None
    kern, tn, ctas, work = setup
    from torch.cuda import _utils as cu
    replace, check = cu._get_gpu_runtime_library().cuTensorMapReplaceAddress, cu._check_cuda
    index = x.device.index
    b = bias if bias is not None else global_scale
    y0 = torch.empty((M, n), dtype=x.dtype, device=x.device)
    # the tensor maps are encoded once; a call only points them at its tensors (cuTensorMapReplaceAddress: host
    # only, a few us less than encoding them again)
    xm, ym, wm = x_map(x, tn), x_map(y0, tn), w_map(packed)
    stream0 = launch.raw_stream(index)
    ws, flags = _sk_buffers(x.device, stream0, tn, sms)
    arr = launch_args(xm, wm, ym, block_scale, global_scale, b, ws, flags,
                      (M, n, Kd, block_scale.shape[1] // 4, *work))
    p_s, p_g, p_b, p_ws, p_fl = arr._values[3:8]
    out_shape, flat = tuple(out_shape), len(out_shape) == 2
    wptr = [packed.data_ptr()]
    del y0

    def plan(xc):
        if (xc.data_ptr() | packed.data_ptr() | block_scale.data_ptr()) & 15:
            return None
        y = xc.new_empty((M, n))
        check(replace(xm, ctypes.c_void_p(xc.data_ptr())))
        check(replace(ym, ctypes.c_void_p(y.data_ptr())))
        if wptr[0] != packed.data_ptr():                 # block swap gives the weight new storage
            wptr[0] = packed.data_ptr()
            check(replace(wm, ctypes.c_void_p(wptr[0])))
        p_s.value, p_g.value, p_b.value = block_scale.data_ptr(), global_scale.data_ptr(), b.data_ptr()
        stream = launch.raw_stream(index)
        if stream != stream0:                            # stream-K workspace and flags are per stream
            ws2, fl2 = _sk_buffers(xc.device, stream, tn, sms)
            p_ws.value, p_fl.value = ws2.data_ptr(), fl2.data_ptr()
        else:
            p_ws.value, p_fl.value = ws.data_ptr(), flags.data_ptr()
        kern.launch(ctas, arr, stream)
        return y if flat else y.view(out_shape)
    return plan


def selftest(device) -> bool:
    """Once per device: the kernel against the fp32 product of the dequantized weight on a small problem with an M
    tail, bias, zero and subnormal block scales, 6 tiles on 5 and 4 CTAs (stream-K: one tile over 4 CTAs, two over
    2 each) and on the whole GPU. Logs one line either way; a failure turns the kernel off for this device
    (dequantize + cuBLAS takes its place)."""
    return selftests.run("rs_w4a16", device, check=_check)[0]


def _check(_variant, device) -> tuple[bool, str]:
    try:
        t, x, bias, ref = W.selftest_problem(256, 2048, 520, device)
        worst = 0.0
        for grid in (5, 4, None):
            for _ in range(2):                            # twice: the stream-K flags are back to 0 after a launch
                y = rs_linear(x, t.packed, t.block_scale, t.global_scale, 256, bias, (256, 4), grid,
                              out=torch.full_like(ref, float("nan"), dtype=torch.bfloat16))
                if y is None:
                    raise RuntimeError(DISABLED_REASONS[-1] if DISABLED_REASONS else "kernel unavailable")
                worst = max(worst, ((y.float() - ref).norm() / ref.norm()).item())
        if not worst < 1e-2:
            raise RuntimeError(f"self-test relative error {worst:.3g} (expected ~2e-3)")
    except Exception as exc:  # noqa: BLE001
        DISABLED_REASONS.append(f"self-test: {type(exc).__name__}: {str(exc)[:300]}")
        log.warning("[SeedVR2-BW] NVFP4 fidelity: sm_90a RS W4A16 kernel off for %s, dequantize + cuBLAS is used (%s)",
                    device, DISABLED_REASONS[-1])
        return False, DISABLED_REASONS[-1]
    log.info("[SeedVR2-BW] NVFP4 fidelity: sm_90a RS W4A16 kernel on for %s (self-test rel err %.2e; "
             "SEEDVR2BW_RS_KERNEL=off turns it off)", device, worst)
    return True, f"rel err {worst:.2e}"
