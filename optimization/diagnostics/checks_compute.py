"""GPU compute: the bf16 GEMM rate on a SeedVR2 shape, the FP8 GEMM (torch._scaled_mm), attention backends."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..attention import (BACKENDS, available_backends, backend_unavailable_reason, make_varlen_plan,
                         varlen_attention)
from .result import FAIL, PASS, SKIP, WARN, CheckResult
from .timing import GEMM_INNER, cuda_ms, rel_err, rotating, sustained_ms, tflops

SECTION = "Compute"

# A SeedVR2-7B MLP up-projection on a 720p-ish window batch: x [M, K] @ w[N, K]^T.
GEMM_SHAPE = (4096, 3072, 12288)


def gemm_operands(ctx, shape=GEMM_SHAPE, dtype=torch.bfloat16):
    """x [M, K], w [N, K], bias [N] made as ``scripts/bench_nvfp4.py`` makes them (x ~ N(0,1), w ~ 0.02 N(0,1),
    bias ~ 0.01 N(0,1); SeedVR2's Linears carry a bias), so the diagnostic's GEMM times are the benchmark's."""
    key = ("gemm_operands", shape, dtype)
    if key not in ctx.measured:
        m, k, n = shape
        gen = torch.Generator(device=ctx.device).manual_seed(0)
        x = torch.randn(m, k, device=ctx.device, generator=gen).to(dtype)
        w = (torch.randn(n, k, device=ctx.device, generator=gen) * 0.02).to(dtype)
        bias = (torch.randn(n, device=ctx.device, generator=gen) * 0.01).to(dtype)
        ctx.measured[key] = (x, w, bias)
    return ctx.measured[key]


def timing_inputs(ctx, shape=GEMM_SHAPE, dtype=torch.bfloat16) -> list:
    """GEMM_INNER activations for timing (the operands' x and shifted copies of it), used in turn."""
    key = ("timing_inputs", shape, dtype)
    if key not in ctx.measured:
        x = gemm_operands(ctx, shape, dtype)[0]
        ctx.measured[key] = [x] + [x.roll(i, dims=0) for i in range(1, GEMM_INNER)]
    return ctx.measured[key]


def gemm_ms(ctx, fn, shape=GEMM_SHAPE) -> float:
    """Median ms of ``fn(x)`` as bench_nvfp4.py times it: ~25 ms of warm-up and ~100 ms of samples
    (do_bench's durations), GEMM_INNER calls per sample on rotating inputs, L2 flushed before each sample."""
    return sustained_ms(rotating(fn, timing_inputs(ctx, shape)), inner=GEMM_INNER)


def bf16_linear_ms(ctx, shape=GEMM_SHAPE) -> float:
    key = ("bf16_ms", shape)
    if key not in ctx.measured:
        _, w, bias = gemm_operands(ctx, shape)
        ctx.measured[key] = gemm_ms(ctx, lambda x: F.linear(x, w, bias), shape)
    return ctx.measured[key]


def check_bf16_gemm(ctx) -> CheckResult:
    name = "bf16 GEMM"
    if not ctx.is_cuda:
        return CheckResult(name, SKIP, None, "TFLOP/s", "no CUDA device")
    m, k, n = GEMM_SHAPE
    ms = bf16_linear_ms(ctx)
    rate = tflops(2 * m * k * n, ms)
    ctx.measured["bf16_tflops"] = rate
    detail = f"x[{m},{k}] @ w[{n},{k}]^T + bias (SeedVR2-7B MLP): {ms:.3f} ms = {rate:.0f} TFLOP/s"
    status = PASS
    if rate < 20:
        status = WARN
        detail += "; a slow GPU for SeedVR2: expect minutes per clip, prefer the 3B model"
    return CheckResult(name, status, round(rate, 1), "TFLOP/s", detail, data={"shape_mkn": list(GEMM_SHAPE), "ms": ms})


def check_fp8_gemm(ctx) -> CheckResult:
    name = "FP8 GEMM (torch._scaled_mm)"
    if not ctx.is_cuda:
        return CheckResult(name, SKIP, None, "TFLOP/s", "no CUDA device")
    cap = torch.cuda.get_device_capability(ctx.device)
    if cap < (8, 9):
        return CheckResult(name, SKIP, None, "TFLOP/s", f"no FP8 tensor cores on sm_{cap[0]}{cap[1]} (needs sm_89+); "
                           "FP8 weights are upcast to bf16 instead")
    if not hasattr(torch, "_scaled_mm"):
        return CheckResult(name, FAIL, None, "TFLOP/s", f"torch {torch.__version__} has no torch._scaled_mm: upgrade torch")
    m, k, n = GEMM_SHAPE
    x, w, _ = gemm_operands(ctx)
    e4m3 = torch.float8_e4m3fn
    sx = (x.abs().amax().float() / 448).clamp(min=1e-12)
    sw = (w.abs().amax().float() / 448).clamp(min=1e-12)
    x8 = (x.float() / sx).to(e4m3)
    w8 = (w.float() / sw).to(e4m3)
    try:
        out = torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)
    except Exception as exc:  # noqa: BLE001
        return CheckResult(name, FAIL, None, "TFLOP/s", f"torch._scaled_mm failed on sm_{cap[0]}{cap[1]}: "
                           f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    err = rel_err(out, F.linear(x, w))
    ms = sustained_ms(lambda: torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16),
                      inner=GEMM_INNER)
    ms_fast = sustained_ms(lambda: torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16,
                                                    use_fast_accum=True), inner=GEMM_INNER)
    rate, rate_fast = tflops(2 * m * k * n, ms), tflops(2 * m * k * n, ms_fast)
    bf16 = bf16_linear_ms(ctx)
    speedup = bf16 / ms
    ctx.measured["fp8_tflops"] = rate
    data = {"ms": ms, "ms_fast_accum": ms_fast, "tflops_fast_accum": rate_fast, "speedup_vs_bf16": speedup,
            "speedup_fast_accum_vs_bf16": bf16 / ms_fast, "rel_err_vs_bf16": err, "shape_mkn": list(GEMM_SHAPE)}
    detail = (f"e4m3 x e4m3 -> bf16, per-tensor scales, same shape: {rate:.0f} TFLOP/s ({speedup:.2f}x bf16), "
              f"fast accumulation {rate_fast:.0f} TFLOP/s ({bf16 / ms_fast:.2f}x); rel. error vs bf16 {err:.3f}")
    if err > 0.1:
        return CheckResult(name, FAIL, round(rate, 1), "TFLOP/s", detail + "; the FP8 result is wrong (error > 0.1)",
                           data=data)
    status = PASS if speedup >= 1.2 else WARN
    if status == WARN:
        detail += "; FP8 is not faster than bf16 here: the FP8 speed path gains nothing"
    return CheckResult(name, status, round(rate, 1), "TFLOP/s", detail, data=data)


TEXT_TOKENS = 58


def axis_windows(n: int, k: int, shifted: bool) -> list:
    """Window lengths along one axis of n tokens with window size k (SeedVR2's 720pwin / 720pswin layouts)."""
    if k >= n:
        return [n]
    if not shifted:
        return [min(k, n - i) for i in range(0, n, k)]
    out = []
    for i in range(math.ceil((n - 0.5) / k) + 1):
        lo, hi = max(int((i - 0.5) * k), 0), min(int((i + 0.5) * k), n)
        if hi > lo:
            out.append(hi - lo)
    return out


def seedvr2_window_lengths(t: int, h: int, w: int, shifted: bool) -> list:
    """Joint-attention sequence lengths (video tokens of a window + all text tokens) of one DiT block."""
    scale = math.sqrt(45 * 80 / (h * w))  # window sizes follow the 720p reference grid (adaptive windows)
    wt, wh, ww = math.ceil(min(t, 30) / 4), math.ceil(round(h * scale) / 3), math.ceil(round(w * scale) / 3)
    return [a * b * c + TEXT_TOKENS for a in axis_windows(t, wt, shifted) for b in axis_windows(h, wh, shifted)
            for c in axis_windows(w, ww, shifted)]


def _layouts(ctx):
    """SeedVR2-7B at 720p x 21 frames (6x45x80 latent tokens): an unshifted and a shifted block, 24 heads x 128.
    On CPU a tiny problem (correctness only)."""
    if ctx.is_cuda:
        return ([seedvr2_window_lengths(6, 45, 80, False), seedvr2_window_lengths(6, 45, 80, True)],
                24, 128, torch.bfloat16)
    return [[64, 64, 48], [30, 70]], 4, 64, torch.float32


def check_attention(ctx) -> list[CheckResult]:
    dev = ctx.device
    backends = available_backends(dev)
    policy = ctx.measured.get("policy")
    chosen = getattr(policy, "attention", None)
    layouts, heads, hd, dtype = _layouts(ctx)
    gen = torch.Generator(device=dev).manual_seed(1)
    problems = []
    for lens in layouts:
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
        total, maxlen = sum(lens), max(lens)
        q, k, v = (torch.randn(total, heads, hd, device=dev, dtype=dtype, generator=gen) for _ in range(3))
        plan = make_varlen_plan(cu, cu, device=dev)
        want = varlen_attention(q.clone(), k.clone(), v.clone(), cu, cu, maxlen, maxlen, backend="reference",
                                plan=plan)
        problems.append((lens, cu, maxlen, q, k, v, plan, want))
    flops = sum(4 * sum(L * L for L in lens) * heads * hd for lens in layouts)
    unavailable = []
    for nm in BACKENDS:
        why = backend_unavailable_reason(nm, dev)
        if why:
            unavailable.append(f"{nm}: {why}")
    out = [CheckResult("attention backends", PASS if backends else FAIL, ", ".join(backends), "",
                       f"available on {dev}: {', '.join(backends) or 'none'}; policy picks {chosen}"
                       + (f"; unavailable: {'; '.join(unavailable)}" if unavailable else ""),
                       data={"available": backends, "policy": chosen, "unavailable": unavailable})]
    shape = (f"a SeedVR2-7B 720p x 21-frame block pair ({len(layouts[0])} unshifted + {len(layouts[1])} shifted "
             f"windows, {heads}x{hd} heads, bf16)") if ctx.is_cuda else "small windows"
    # --quick: only the backend the policy runs (the others are listed above and timed in the full run)
    timed = [chosen] if ctx.quick and chosen in backends else backends
    for nm in timed:
        if nm == "reference":
            continue
        row = f"attention {nm}"
        tol = 0.08 if nm == "sage" else 0.02
        try:
            # sage mutates k in place in some versions: fresh copies for the correctness run
            err = max(rel_err(varlen_attention(q.clone(), k.clone(), v.clone(), cu, cu, mx, mx, backend=nm, plan=pl),
                              want) for _, cu, mx, q, k, v, pl, want in problems)
        except Exception as exc:  # noqa: BLE001
            out.append(CheckResult(row, FAIL, None, "TFLOP/s", f"{type(exc).__name__}: {exc}"))
            continue
        data = {"rel_err_vs_reference": err, "windows": [len(x) for x in layouts], "heads": heads, "head_dim": hd}
        if err > tol:
            out.append(CheckResult(row, FAIL, None, "TFLOP/s", f"wrong result: relative error {err:.3g} vs the "
                                   f"per-window SDPA reference (tolerance {tol})", data=data))
            continue
        if not ctx.is_cuda:
            out.append(CheckResult(row, PASS, None, "TFLOP/s", f"matches the reference (rel. error {err:.1e}); "
                                   "speed not measured on CPU", data=data))
            continue

        def pair(nm=nm):
            for _, cu, mx, q, k, v, pl, _w in problems:
                varlen_attention(q, k, v, cu, cu, mx, mx, backend=nm, plan=pl)

        ms = cuda_ms(pair, reps=3 if ctx.quick else 10, warmup=2)
        rate = tflops(flops, ms)
        data.update(ms=ms, tflops=rate)
        ctx.measured.setdefault("attention_tflops", {})[nm] = rate
        out.append(CheckResult(row, PASS, round(rate, 1), "TFLOP/s",
                               f"{shape}: {ms:.3f} ms ({rate:.0f} TFLOP/s), rel. error {err:.1e}", data=data))
    rates = ctx.measured.get("attention_tflops", {})
    if chosen in rates and len(rates) > 1:
        best = max(rates, key=rates.get)
        if rates[chosen] < 0.8 * rates[best]:
            for r in out:
                if r.name == f"attention {chosen}":
                    r.status = WARN
                    r.detail += (f"; the policy's choice is {rates[best] / rates[chosen]:.2f}x slower than {best} here: "
                                 f"try SEEDVR2BW_ATTENTION={best}")
    return out


CHECKS = (check_bf16_gemm, check_fp8_gemm, check_attention)
