"""Host<->device transfers: pinned vs pageable bandwidth, D2H, and copy/compute overlap on a side stream.

The overlap test is the one BlockSwap needs: one H2D copy on a copy stream while a GEMM runs on the compute stream
(never two copies in the same direction, which share the link and cannot overlap).
"""
from __future__ import annotations

import statistics

import torch

from .result import FAIL, PASS, SKIP, WARN, CheckResult
from .timing import cuda_ms, gbps, wall_ms

SECTION = "Transfers"
MiB = 2**20


def cuda_ready(ctx) -> bool:
    return ctx.is_cuda


def pin_host_buffer(nbytes: int, ctx=None) -> torch.Tensor:
    """Page-locked host buffer. Tests monkeypatch this; ``SEEDVR2BW_DIAG_FAULT=pin_fail`` makes it fail."""
    if ctx is not None and ctx.fault("pin_fail"):
        raise RuntimeError("CUDA error: out of memory (forced by SEEDVR2BW_DIAG_FAULT=pin_fail)")
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _pin_failed(name: str, exc: Exception) -> CheckResult:
    return CheckResult(name, FAIL, None, "GB/s", f"pinning host memory failed ({type(exc).__name__}: {exc}). BlockSwap "
                       "then falls back to pageable copies, which block the host and cannot overlap compute. Causes: "
                       "WSL2/Docker pin limits (~1 GB), Windows' page-lockable pool (~half of RAM), RAM exhausted. "
                       "Fix: free RAM, or lower the pinned pool (SEEDVR2BW_PINNED_POOL_BYTES=4G)")


def _size(ctx) -> int:
    return (64 if ctx.quick else 256) * MiB


def _reps(ctx) -> int:
    return 3 if ctx.quick else 7


def _get_pinned(ctx, name: str):
    """(buffer, None) or (None, FAIL result). The buffer is cached in ctx so later checks reuse it."""
    key = ("pinned", _size(ctx))
    if key in ctx.measured:
        return ctx.measured[key], None
    try:
        buf = pin_host_buffer(_size(ctx), ctx)
    except Exception as exc:  # noqa: BLE001
        ctx.measured["pin_error"] = f"{type(exc).__name__}: {exc}"
        return None, _pin_failed(name, exc)
    buf.fill_(1)
    ctx.measured[key] = buf
    return buf, None


def check_h2d(ctx) -> CheckResult:
    name = "H2D pinned vs pageable"
    if not cuda_ready(ctx):
        return CheckResult(name, SKIP, None, "GB/s", "no CUDA device")
    pinned, failed = _get_pinned(ctx, name)
    if failed:
        return failed
    n = pinned.numel()
    pageable = torch.ones(n, dtype=torch.uint8)  # touched, so no page faults are timed
    dst = torch.empty(n, dtype=torch.uint8, device=ctx.device)
    reps = _reps(ctx)
    t_pin = cuda_ms(lambda: dst.copy_(pinned, non_blocking=True), reps=reps)
    t_page = wall_ms(lambda: dst.copy_(pageable, non_blocking=True), reps=max(3, reps - 2))
    bw_pin, bw_page = gbps(n, t_pin), gbps(n, t_page)
    ratio = bw_pin / bw_page if bw_page > 0 else float("nan")
    ctx.measured["h2d_pinned_gbps"] = bw_pin
    ctx.measured["h2d_pageable_gbps"] = bw_page
    data = {"bytes": n, "pinned_gbps": bw_pin, "pageable_gbps": bw_page, "ratio": ratio,
            "pinned_ms": t_pin, "pageable_ms": t_page}
    detail = (f"{n // MiB} MiB: pinned {bw_pin:.1f} GB/s, pageable {bw_page:.1f} GB/s, ratio {ratio:.1f}x "
              "(PCIe 4.0 x16 gives ~25 GB/s pinned, 5.0 x16 ~55 GB/s)")
    status = PASS
    if bw_pin < 10:
        status = WARN
        detail += "; low pinned bandwidth: is the GPU in an x8/x4 slot or a PCIe 3.0 link? BlockSwap will be slow"
    elif ratio < 1.2:
        status = WARN
        detail += "; pinned memory is not faster than pageable here (unified-memory system?)"
    return CheckResult(name, status, round(bw_pin, 2), "GB/s", detail, data=data)


def check_d2h(ctx) -> CheckResult:
    name = "D2H pinned vs pageable"
    if not cuda_ready(ctx):
        return CheckResult(name, SKIP, None, "GB/s", "no CUDA device")
    pinned, failed = _get_pinned(ctx, name)
    if failed:
        return failed
    n = pinned.numel()
    src = torch.ones(n, dtype=torch.uint8, device=ctx.device)
    pageable = torch.ones(n, dtype=torch.uint8)
    reps = _reps(ctx)
    t_pin = cuda_ms(lambda: pinned.copy_(src, non_blocking=True), reps=reps)
    t_page = wall_ms(lambda: pageable.copy_(src), reps=max(3, reps // 2))
    del pageable
    # into freshly allocated pageable memory (what `.cpu()` / `.to("cpu")` does): page faults on every copy
    t_fresh = wall_ms(lambda: torch.empty(n, dtype=torch.uint8).copy_(src), reps=3)
    bw_pin, bw_page, bw_fresh = gbps(n, t_pin), gbps(n, t_page), gbps(n, t_fresh)
    ctx.measured["d2h_pinned_gbps"] = bw_pin
    data = {"bytes": n, "pinned_gbps": bw_pin, "pageable_gbps": bw_page, "fresh_pageable_gbps": bw_fresh,
            "pinned_ms": t_pin, "pageable_ms": t_page, "fresh_pageable_ms": t_fresh}
    detail = (f"{n // MiB} MiB: pinned {bw_pin:.1f} GB/s, pageable {bw_page:.1f} GB/s into a reused buffer, "
              f"{bw_fresh:.1f} GB/s into fresh memory (as .cpu() does). The pack never copies weights back "
              "(offloaders that do pay the last figure per block)")
    status = PASS if bw_pin >= 5 else WARN
    return CheckResult(name, status, round(bw_pin, 2), "GB/s", detail, data=data)


def overlap_trials(copy_ms, gemm_ms, both_ms, trials: int):
    """Median over trials of (copy, GEMM, both) times, and the median of the per-trial hidden fraction
    (t_copy + t_gemm - t_both) / min(t_copy, t_gemm)."""
    rows = []
    for _ in range(trials):
        tc, tg, tb = copy_ms(), gemm_ms(), both_ms()
        rows.append((tc, tg, tb, (tc + tg - tb) / min(tc, tg)))
    med = [statistics.median(r[i] for r in rows) for i in range(4)]
    return med[0], med[1], med[2], med[3]


def check_overlap(ctx) -> CheckResult:
    name = "copy/compute overlap"
    if not cuda_ready(ctx):
        return CheckResult(name, SKIP, None, "%", "no CUDA device")
    pinned, failed = _get_pinned(ctx, name)
    if failed:
        failed.unit = "%"
        return failed
    dev = ctx.device
    n = pinned.numel()
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    c = torch.empty(4096, 4096, device=dev, dtype=torch.bfloat16)
    compute = torch.cuda.current_stream(dev)
    copy_stream = torch.cuda.Stream(dev)
    reps = _reps(ctx)

    def copy():
        dst.copy_(pinned, non_blocking=True)

    cuda_ms(copy, reps=1, warmup=1, stream=copy_stream)
    t_one = cuda_ms(lambda: torch.mm(a, b, out=c), reps=reps, warmup=10)
    t_copy0 = cuda_ms(copy, reps=3, warmup=0, stream=copy_stream)
    iters = max(1, round(1.2 * t_copy0 / max(t_one, 1e-3)))  # GEMM slightly longer than the copy

    def gemm():
        for _ in range(iters):
            torch.mm(a, b, out=c)

    def both():
        start = torch.cuda.Event()
        start.record(compute)
        copy_stream.wait_event(start)
        with torch.cuda.stream(copy_stream):
            copy()
        gemm()
        done = torch.cuda.Event()
        done.record(copy_stream)
        compute.wait_event(done)

    # copy alone, GEMM alone and both together, back to back in every trial (clock drift hits all three alike)
    t_copy, t_gemm, t_both, hidden = overlap_trials(
        lambda: cuda_ms(copy, reps=1, warmup=0, stream=copy_stream),
        lambda: cuda_ms(gemm, reps=1, warmup=0, stream=compute),
        lambda: cuda_ms(both, reps=1, warmup=0, stream=compute), trials=max(5, reps))
    ctx.measured["overlap_hidden"] = hidden
    data = {"copy_ms": t_copy, "gemm_ms": t_gemm, "both_ms": t_both, "hidden_fraction": hidden, "gemm_iters": iters,
            "copy_bytes": n, "method": "median over interleaved trials"}
    detail = (f"{n // MiB} MiB pinned H2D on a copy stream alone {t_copy:.2f} ms, {iters}x bf16 4096^3 GEMM alone "
              f"{t_gemm:.2f} ms, both at once {t_both:.2f} ms: {hidden * 100:.0f}% of the copy hidden")
    if hidden >= 0.8:
        status = PASS
    elif hidden >= 0.3:
        status = WARN
        detail += "; partial overlap: BlockSwap copies will partly add to the run time"
    else:
        status = FAIL
        detail += ("; copies do not overlap compute: every swapped block adds its full copy time. Causes: Windows "
                   "WDDM without hardware-accelerated GPU scheduling, a virtualised GPU, or a driver problem")
    return CheckResult(name, status, round(hidden * 100, 1), "%", detail, data=data)


CHECKS = (check_h2d, check_d2h, check_overlap)
