"""Small timing helpers: CUDA events around the work, median of several repetitions."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


L2_FLUSH_BYTES = 256 << 20
GEMM_INNER = 4   # GEMM timings: calls per sample, as a model runs them (bench_nvfp4.py uses --inner 8)


def cuda_ms(fn: Callable[[], object], reps: int = 5, warmup: int = 1, stream=None, inner: int = 1,
            flush_l2: bool = False) -> float:
    """Median GPU time of ``fn()`` in ms, measured with events on ``stream`` (default: the current one).

    ``inner`` calls per sample (the result divided by it): back-to-back calls as in a model's forward, so the host
    launch latency of one call hides behind the previous call's GPU work, as it does in ``bench_nvfp4.py``.
    ``flush_l2``: overwrite 256 MiB before each sample (untimed) so no sample starts with its operands in L2, as
    ``triton.testing.do_bench`` (which the benchmarks use) does."""
    stream = stream or torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times = []
    flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda") if flush_l2 else None
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            if flush is not None:
                flush.zero_()
            start.record()
            for _ in range(inner):
                fn()
            end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def sustained_ms(fn: Callable[[], object], inner: int = 1, warmup_ms: float = 25.0, rep_ms: float = 100.0) -> float:
    """Median ms of ``fn()`` timed as ``triton.testing.do_bench`` (what ``scripts/bench_*.py`` use) times it: the
    number of warm-up calls and samples follows from a first estimate so that ~``warmup_ms`` of warm-up and
    ~``rep_ms`` of samples run back to back (the GPU reaches the clocks it holds under sustained load, as in the
    benchmarks), L2 flushed before each sample, ``inner`` calls per sample."""
    est = cuda_ms(fn, reps=3, warmup=1, inner=inner, flush_l2=True) * inner
    n_warm = max(1, int(warmup_ms / max(est, 1e-3)))
    reps = max(5, min(1000, int(rep_ms / max(est, 1e-3))))
    return cuda_ms(fn, reps=reps, warmup=n_warm * inner, inner=inner, flush_l2=True)


def rotating(fn: Callable[[torch.Tensor], object], inputs) -> Callable[[], object]:
    """``fn`` applied to ``inputs`` in turn, one per call: like a model's layers, each call reads an activation
    that is not the previous call's (with one input repeated, a 25 MB activation stays in the H100's 50 MB L2 and
    the GEMM looks ~11 % faster than bench_nvfp4.py, which rotates its inputs the same way)."""
    state = [0]

    def call():
        state[0] = (state[0] + 1) % len(inputs)
        return fn(inputs[state[0]])
    return call


def wall_ms(fn: Callable[[], object], reps: int = 5, warmup: int = 1, sync: bool = True) -> float:
    """Median host wall time of ``fn()`` (with a device synchronize after it when ``sync``) in ms."""
    for _ in range(warmup):
        fn()
        if sync and torch.cuda.is_available():
            torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if sync and torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9 if ms > 0 else float("nan")


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12 if ms > 0 else float("nan")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    denom = want.norm().item()
    return (got - want).norm().item() / denom if denom > 0 else float((got - want).norm().item())
