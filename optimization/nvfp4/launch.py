"""What the NVFP4 kernel modules share to launch: Triton (if it imports), the GPU seams the host tests replace,
the cached relaunch of compiled Triton kernels, the SM count and split-K model, the split-K reduce kernel both
W4A16 kernels use, and the cache of NVRTC-compiled CUDA kernels.

Seams: ``on_cuda`` / ``device_is_cuda`` / ``raw_stream`` (``tests/test_nvfp4_host.py`` and
``scripts/bench_nvfp4_host.py`` replace them to run the host side on a CPU); every module calls them through this
module (``launch.on_cuda(t)``) so that a replacement is seen everywhere.
"""
from __future__ import annotations

import inspect
import logging

import torch

from ..runtime import knobs

try:  # pragma: no cover - exercised on GPU machines
    import triton
    import triton.language as tl
    HAS_TRITON = True
except Exception:  # noqa: BLE001
    triton = None
    tl = None
    HAS_TRITON = False

log = logging.getLogger(__name__)

INTERPRET = knobs.external("TRITON_INTERPRET") == "1"   # lets the CPU run the kernels (tests only)

# Triton >= 3.2 can keep an autotuner's choice in its on-disk cache: the dequantize kernel's 7-config sweep
# (~1 s per weight shape and process) then runs once per machine instead of at every ComfyUI start
AUTOTUNE_DISK_CACHE = ({"cache_results": True}
                       if HAS_TRITON and "cache_results" in inspect.signature(triton.autotune).parameters else {})


def on_cuda(t: torch.Tensor) -> bool:
    """``t.is_cuda`` (a seam, see the module doc)."""
    return t.is_cuda


def device_is_cuda(device: torch.device) -> bool:
    """``device.type == "cuda"`` (a seam)."""
    return device.type == "cuda"


def raw_stream(index):
    """The current CUDA stream's handle for device ``index`` (a seam)."""
    return torch._C._cuda_getCurrentRawStream(index)


def triton_usable(t: torch.Tensor) -> bool:
    return HAS_TRITON and (on_cuda(t) or INTERPRET)


def check_triton(t: torch.Tensor):
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed")
    if not (on_cuda(t) or INTERPRET):
        raise RuntimeError("Triton kernels need a CUDA tensor")


# ----------------------------------------------------------------------------------------------------------
# low-overhead relaunch. Measured on the H100 lease (Triton 3.6, torch 2.11): a plain ``kernel[grid](...)``
# costs ~40 us of host time and an autotuned one ~60-70 us, more than the GPU time of these kernels at small M.
# The first call per specialization goes through Triton (compile / autotune) and returns the CompiledKernel; later
# calls with the same specialization key (dtypes, 16-byte pointer alignment, int == 1 / % 16 / int32 range,
# constexprs) call its launcher directly. SEEDVR2BW_NVFP4_FAST_LAUNCH=off turns it off; a launcher error too.
# ----------------------------------------------------------------------------------------------------------
FAST_LAUNCH = [knobs.get("NVFP4_FAST_LAUNCH") and not INTERPRET]
FAST_CACHE: dict = {}


def fast_launch_off() -> None:
    """The launcher API differs in this Triton: normal launches from now on."""
    FAST_LAUNCH[0] = False
    FAST_CACHE.clear()


def spec_key(args) -> tuple:
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, bool):
            key.append(("b", a))
        elif isinstance(a, int):
            key.append((a == 1, a % 16 == 0, -2 ** 31 <= a < 2 ** 31))
        else:
            key.append(type(a))
    return tuple(key)


def hook_active(h) -> bool:
    """A launch hook is installed: not None, and (newer Triton: a ``HookChain``) with at least one call."""
    if h is None:
        return False
    calls = getattr(h, "calls", None)
    return bool(calls) if isinstance(calls, list) else True


def hooks_set() -> bool:
    try:
        from triton import knobs as triton_knobs
        return (hook_active(triton_knobs.runtime.launch_enter_hook)
                or hook_active(triton_knobs.runtime.launch_exit_hook))
    except Exception:  # noqa: BLE001 - older Triton: no knobs module, never use the fast path
        return True


def relaunch(entry, grid, args, consts, device) -> bool:
    k = entry
    try:
        k.run(grid[0], grid[1], grid[2], raw_stream(device.index), k.function,
              k.packed_metadata, None, None, None, *args, *consts)
        return True
    except Exception:  # noqa: BLE001 - launcher API differs in this Triton: use the normal launch from now on
        fast_launch_off()
        return False


def cached_kernel(fn, args, consts: dict, num_warps: int, num_stages: int):
    """The compiled kernel ``launch`` cached for exactly these arguments' specialization (None if it has not
    launched them yet, or fast launch is off). Used to build per-layer launch plans."""
    if not FAST_LAUNCH[0]:
        return None
    return FAST_CACHE.get((id(fn), args[0].device.index, spec_key(args), tuple(consts.values()), num_warps,
                           num_stages))


def launch(fn, grid, args, consts: dict, num_warps: int, num_stages: int):
    """``fn[grid](*args, **consts, num_warps=, num_stages=)`` with the compiled kernel cached per
    specialization. ``consts`` must be the kernel's trailing constexpr parameters, in declaration order."""
    dev = args[0].device
    key = None
    if FAST_LAUNCH[0]:
        key = (id(fn), dev.index, spec_key(args), tuple(consts.values()), num_warps, num_stages)
        k = FAST_CACHE.get(key)
        if k is not None and relaunch(k, grid, args, tuple(consts.values()), dev):
            return
    k = fn[grid](*args, **consts, num_warps=num_warps, num_stages=num_stages)
    if hasattr(k, "result"):
        k = k.result()
    if key is not None and FAST_LAUNCH[0] and k is not None and hasattr(k, "packed_metadata") and not hooks_set():
        FAST_CACHE[key] = k


# ----------------------------------------------------------------------------------------------------------
# split-K: the SM count, the wave / partial-sum cost model, and the reduce of the fp32 partials
# ----------------------------------------------------------------------------------------------------------
SM_COUNT: dict = {}


def sm_count(device) -> int:
    key = str(device)
    if key not in SM_COUNT:
        SM_COUNT[key] = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    return SM_COUNT[key]


def splitk_for(tiles: int, k_tiles: int, m: int, n: int, sms: int) -> int:
    """SPLIT_K for ``tiles`` output tiles of ``k_tiles`` K tiles each on ``sms`` SMs: the smallest estimated
    time, in K-tile steps (~0.9 us each on the H100 at the M=256 tile): waves x K tiles per split, plus for a split
    ~3 steps (the reduce launch) and its fp32 partials (written and read: 8 B per output per split, ~4 TB/s).
    Fits the M=256 sweep of commit fa97e0e on all six SeedVR2 shapes (chooses 1, 3, 1, 4, 1, 1; measured best)."""
    best, best_est = 1, None
    for sk in (1, 2, 3, 4, 6, 8, 12):
        if k_tiles % sk or (sk > 1 and k_tiles // sk < 4):
            continue
        est = -(-tiles * sk // sms) * (k_tiles // sk)
        if sk > 1:
            est += 3 + sk * m * n * 8 / 4e6
        if best_est is None or est < best_est:
            best, best_est = sk, est
    return best


if HAS_TRITON:

    @triton.jit
    def splitk_reduce_kernel(ws_ptr, g_ptr, b_ptr, y_ptr, MN, N, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                             BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < MN
        acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
        for i in tl.static_range(1, SPLIT_K):
            acc += tl.load(ws_ptr + i * MN + offs, mask=mask, other=0.0)
        acc = acc * tl.load(g_ptr)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def reduce_launch(ws, g, bias, y, M: int, n: int, sk: int):
    """The (kernel, grid, args, constexprs, num_warps, num_stages) launch that sums ``sk`` fp32 partials
    ``ws[sk, M, n]`` into ``y`` times the global scale ``g`` (+ bias)."""
    b = bias if bias is not None else g
    return (splitk_reduce_kernel, (-(-(M * n) // 1024), 1, 1), (ws, g, b, y, M * n, n),
            dict(HAS_BIAS=bias is not None, SPLIT_K=sk, BLOCK=1024), 4, 3)


# ----------------------------------------------------------------------------------------------------------
# NVRTC-compiled CUDA kernels (sm_90): compiled once per configuration; a failure is kept with its reason
# ----------------------------------------------------------------------------------------------------------
def compiled(cache: dict, reasons: list, key: tuple, make, what: str):
    """cache[key], made by make(*key) the first time; a failure (no NVRTC, old driver, compile error) is kept as None
    with its reason, logged once, and the caller keeps its other path."""
    if key not in cache:
        try:
            cache[key] = make(*key)
        except Exception as e:  # noqa: BLE001
            cache[key] = None
            reasons.append(f"{key}: {type(e).__name__}: {str(e)[:400]}")
            log.warning("NVFP4 %s %s unavailable (%s)", what, key, e)
    return cache[key]
