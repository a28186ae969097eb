"""NVFP4: the library imports, quantize/dequantize match an independent CPU reference on this device, and every
GEMM path this GPU supports is correct (against the exact reference product) and timed against bf16."""
from __future__ import annotations


import torch

from ..nvfp4 import format as fmt
from ..nvfp4.dispatch import NVFP4_PATHS
from ..nvfp4.fp4_gemm import fp4_gemm_supported
from ..nvfp4.selftest import run_gemm_selftest
from ..runtime import policy as hw_policy
from .nvfp4_reference import reference_roundtrip, sqnr_db
from .result import FAIL, PASS, SKIP, WARN, CheckResult
from .timing import rel_err, tflops

SECTION = "NVFP4"

GEMM_SHAPE = (4096, 3072, 12288)       # M, K, N: SeedVR2-7B MLP up-projection on a 720p window batch
CPU_GEMM_SHAPE = (64, 3072, 512)
# Relative error vs the exact product with the dequantized weight (the weight's own NVFP4 error is not counted):
# bf16 output rounding for the dequantizing paths, FP8 activations (+ NVFP4->FP8 weight re-quantization) for the
# FP8 speed path, NVFP4 activations for the FP4 tensor-core path (~9.5 % element error).
PATH_TOLERANCE = {"reference": 1e-2, "fidelity": 1e-2, "fp8_speed": 0.08, "fp4_tensorcore": 0.15}
CPU_REFERENCE_TOLERANCE = 1e-4   # fp32 on CPU: only summation order differs from the independent reference
PATH_LABEL = {"fp4_tensorcore": "FP4 tensor cores (W4A4)", "fp8_speed": "FP8 speed path (W8A8)",
              "fidelity": "fidelity path (W4A16)", "reference": "reference (dequantize + matmul)"}


def check_nvfp4_library(ctx) -> CheckResult:
    name = "NVFP4 library"
    parts, errors = [], []
    for mod in ("format", "linear", "selftest", "kernels"):
        try:
            m = __import__(f"{__package__.rsplit('.', 1)[0]}.nvfp4.{mod}", fromlist=["_"])
            parts.append(mod)
            if mod == "kernels":
                parts[-1] += f" (triton {'yes' if getattr(m, 'HAS_TRITON', False) else 'no'})"
        except Exception as exc:  # noqa: BLE001
            errors.append(f"optimization.nvfp4.{mod}: {type(exc).__name__}: {exc}")
    ctx.measured["nvfp4_import_errors"] = errors
    if errors:
        return CheckResult(name, FAIL, None, "", "import failed: " + "; ".join(errors)
                           + ". Fix: pip install -r requirements.txt, or reinstall the pack")
    return CheckResult(name, PASS, "imported", "", "modules: " + ", ".join(parts))


def _corrupt_packed(fmt, packed):
    return fmt.swap_nibbles(packed)


def check_nvfp4_quantize(ctx) -> CheckResult:
    name = "NVFP4 quantize/dequantize"
    dev = ctx.device
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(128 if ctx.quick else 256, 3072, generator=gen)
    w[3, :16] = 0.0                      # an all-zero block
    w[5, 16:32] *= 1e-3                  # a tiny block
    want = reference_roundtrip(w)
    packed, scales, g = fmt.quantize_nvfp4(w.to(dev))
    if ctx.fault("nvfp4_wrong"):
        packed = _corrupt_packed(fmt, packed)
    got = fmt.dequantize_nvfp4(packed, scales, g, dtype=torch.float32, shape=tuple(w.shape)).cpu()
    bad = ((got - want).abs() > 1e-6 * want.abs() + 1e-30).float().mean().item()
    snr_lib, snr_ref = sqnr_db(w, got), sqnr_db(w, want)
    data = {"mismatch_fraction": bad, "sqnr_db": snr_lib, "reference_sqnr_db": snr_ref, "device": str(dev)}
    extra = []
    if ctx.is_cuda:
        # the device must reproduce the CPU bytes exactly (plain-torch path and, when present, the Triton kernels)
        p_cpu, s_cpu, g_cpu = fmt.quantize_nvfp4(w)
        same = bool(torch.equal(packed.cpu(), p_cpu) and torch.equal(scales.cpu().view(torch.uint8),
                                                                     s_cpu.view(torch.uint8)))
        data["device_bytes_equal_cpu"] = same
        extra.append(f"device bytes {'==' if same else '!='} CPU bytes")
        try:
            from ..nvfp4 import kernels
            policy = ctx.measured.get("policy") or hw_policy.get_policy(dev)
            if ctx.quick and policy.nvfp4_gemm != "fp4_tensorcore":
                # the Triton NVFP4 quantizer feeds only the FP4 tensor-core path: --quick does not compile it here
                extra.append(f"Triton quantizer not compared in --quick (only the FP4 path uses it; this GPU runs "
                             f"{policy.nvfp4_gemm})")
            elif kernels.triton_usable(w.to(dev)):
                q_t, s_t = kernels.quantize_act_nvfp4(w.to(dev), g_cpu.to(dev))
                if ctx.fault("nvfp4_wrong"):
                    q_t = _corrupt_packed(fmt, q_t)
                tri_same = bool(torch.equal(q_t.cpu(), p_cpu) and torch.equal(
                    s_t.cpu().view(torch.uint8), s_cpu.view(torch.uint8)))
                if ctx.quick:  # the dequantize kernel autotunes once per shape and process (~1 s): full runs only
                    deq_same, deq_text = True, "dequantize not compared in --quick"
                else:
                    d_t = kernels.dequantize_nvfp4_triton(p_cpu.to(dev), s_cpu.to(dev), g_cpu, tuple(w.shape),
                                                          dtype=torch.float32).cpu()
                    deq_same = bool(torch.equal(d_t, fmt.dequantize_nvfp4(p_cpu, s_cpu, g_cpu, shape=tuple(w.shape))))
                    deq_text = f"dequantize {'==' if deq_same else '!='} CPU"
                    data["triton_dequantize_equal_cpu"] = deq_same
                data["triton_quantize_equal_cpu"] = tri_same
                extra.append(f"Triton quantize {'==' if tri_same else '!='} CPU, {deq_text}")
                same = same and tri_same and deq_same
        except Exception as exc:  # noqa: BLE001
            data["triton_error"] = f"{type(exc).__name__}: {exc}"
            extra.append(f"Triton kernels failed: {type(exc).__name__}: {exc}")
            same = False
        data["device_consistent"] = same
    else:
        same = True
    detail = (f"{w.shape[0]}x{w.shape[1]} Gaussian weight quantized on {dev}: {bad * 100:.3f}% of decoded values differ from the "
              f"independent CPU reference; round-trip SQNR {snr_lib:.2f} dB (reference {snr_ref:.2f} dB)")
    if extra:
        detail += "; " + ", ".join(extra)
    if bad > 1e-3 or not same or abs(snr_lib - snr_ref) > 0.5:
        return CheckResult(name, FAIL, round(bad * 100, 4), "% mismatch", detail + ". NVFP4 weights would decode "
                           "wrongly on this machine: set SEEDVR2BW_NVFP4_GEMM=reference and report the output", data=data)
    return CheckResult(name, PASS, round(bad * 100, 4), "% mismatch", detail, data=data)


def build_linear(w: torch.Tensor, bias, path: str, dtype=torch.bfloat16):
    """An NVFP4Linear holding ``w`` quantized (on w's device), pinned to ``path``; returns (module, fp32 weight as
    stored, i.e. dequantized)."""
    from ..nvfp4.linear import NVFP4Linear
    mod = NVFP4Linear.from_nvfp4(fmt.quantize_nvfp4(w, return_tensor=True), bias=bias, path=path, dtype=dtype)
    return mod, mod.dequantize_weight(torch.float32)


def _expected_paths(policy) -> set:
    """Paths this GPU's profile should support (the chain from the profile's starting path down)."""
    start = hw_policy.PROFILE_NVFP4_START.get(getattr(policy, "profile", ""), "reference")
    return set(NVFP4_PATHS[NVFP4_PATHS.index(start):])


def _quick_support(path: str, device) -> tuple[bool, str]:
    """--quick: the library's support gates without its tiny self-test GEMMs (which compile extra Triton kernels);
    the run on the SeedVR2 shape below still checks the values."""
    if path == "fp4_tensorcore":
        return fp4_gemm_supported(device)
    if path == "fp8_speed" and torch.cuda.get_device_capability(device) < (8, 9):
        return False, "FP8 tensor cores need sm_89+"
    return True, "quick run: self-test skipped"


def check_nvfp4_gemm(ctx) -> list[CheckResult]:
    policy = ctx.measured.get("policy") or hw_policy.get_policy(ctx.device)
    expected = _expected_paths(policy)
    paths = [p for p in NVFP4_PATHS if p != "reference"] if ctx.is_cuda else ["reference"]
    out = []
    if not ctx.is_cuda:
        out.append(CheckResult("NVFP4 GEMM paths", SKIP, None, "", "no CUDA device: the FP4 tensor-core, FP8 speed and "
                               "fidelity paths are skipped; only the reference path is checked on CPU"))
    m, k, n = GEMM_SHAPE if ctx.is_cuda else CPU_GEMM_SHAPE
    dev = ctx.device
    dtype = torch.bfloat16 if ctx.is_cuda else torch.float32
    from .checks_compute import bf16_linear_ms, gemm_ms, gemm_operands
    x, w_dev, bias = gemm_operands(ctx, (m, k, n), dtype)   # the bf16 baseline's operands (bench_nvfp4.py's recipe)
    w_dev = w_dev.float()
    bf16_ms = bf16_linear_ms(ctx, (m, k, n)) if ctx.is_cuda else None
    for path in paths:
        row = f"NVFP4 {PATH_LABEL[path]}"
        unit = "x bf16" if ctx.is_cuda else "rel err"
        try:
            ok, why = _quick_support(path, dev) if ctx.quick else run_gemm_selftest(path, dev)
        except Exception as exc:  # noqa: BLE001
            ok, why = False, f"self-test crashed: {type(exc).__name__}: {exc}"
        selftest_failed = None
        if not ok:
            if path not in expected:
                out.append(CheckResult(row, SKIP, None, unit, f"not supported here ({policy.profile}): {why}",
                                       data={"selftest": why}))
                continue
            # a path this profile should run failed its tiny self-test: FAIL, but still measure the SeedVR2 shape
            selftest_failed = (f"self-test failed on a GPU whose profile ({policy.profile}) should run it: {why} "
                               "(the policy then falls back to the next path)")
        # --quick runs only the path the policy picked: each other path compiles its own Triton kernels (1-3 s
        # each on a first run), which would break the 10-second budget
        if ctx.quick and ctx.is_cuda and path != policy.nvfp4_gemm:
            out.append(CheckResult(row, SKIP, None, unit, f"--quick checks only the path this GPU runs "
                                   f"({policy.nvfp4_gemm}); run without --quick to check and time this one",
                                   data={"selftest": why, "policy_path": policy.nvfp4_gemm}))
            continue
        xx = x
        try:
            mod, w_deq = build_linear(w_dev, bias, path, dtype)
            ran = mod.decision(xx.reshape(-1, xx.shape[-1])).path
            if ran != path:
                out.append(CheckResult(row, FAIL, None, unit, f"NVFP4Linear runs {ran!r} "
                                       f"instead of {path!r} on {m}x{k}x{n}", data={"effective_path": ran}))
                continue
            with torch.no_grad():
                y = mod(xx)
                if ctx.fault("nvfp4_wrong"):
                    y = y.roll(1, dims=-1)
                if ctx.is_cuda:
                    with hw_policy.scoped_flags(tf32=False):
                        want = torch.addmm(bias.float(), xx.float(), w_deq.to(dev).float().t())
                else:
                    want = torch.addmm(bias.float(), xx.float(), reference_roundtrip(w_dev).t())
        except Exception as exc:  # noqa: BLE001
            out.append(CheckResult(row, FAIL, None, unit, f"{selftest_failed or 'passed its self-test'}; on the SeedVR2 "
                                   f"shape {m}x{k}x{n}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"))
            continue
        err = rel_err(y, want)
        tol = PATH_TOLERANCE[path] if ctx.is_cuda else CPU_REFERENCE_TOLERANCE
        data = {"path": path, "rel_err": err, "tolerance": tol, "shape_mkn": [m, k, n], "selftest": why,
                "policy_path": policy.nvfp4_gemm}
        if err > tol or err != err:
            out.append(CheckResult(row, FAIL, round(err, 4), "rel err", f"wrong values: relative error {err:.3g} vs the "
                                   f"exact product (tolerance {tol}) on {m}x{k}x{n}"
                                   + (f"; {selftest_failed}" if selftest_failed else ""), data=data))
            continue
        if not ctx.is_cuda:
            out.append(CheckResult(row, PASS, err, "rel err", f"{m}x{k}x{n} on CPU: relative error {err:.2e} "
                                   f"vs the independent reference (tolerance {tol})", data=data))
            continue
        with torch.no_grad():
            ms = gemm_ms(ctx, mod, (m, k, n))
        speed = bf16_ms / ms
        data.update(ms=ms, bf16_ms=bf16_ms, speedup_vs_bf16=speed, tflops=tflops(2 * m * k * n, ms))
        detail = (f"{m}x{k}x{n}: {ms:.3f} ms vs bf16 {bf16_ms:.3f} ms = {speed:.2f}x bf16 "
                  f"({tflops(2 * m * k * n, ms):.0f} TFLOP/s); relative error {err:.2e} (tolerance {tol})"
                  + ("; the policy's choice" if path == policy.nvfp4_gemm else ""))
        status = PASS
        if selftest_failed:
            status = FAIL
            detail = f"{selftest_failed}. On the SeedVR2 shape it works: {detail}"
        elif path in ("fp4_tensorcore", "fp8_speed") and speed < 1.0:
            status = WARN
            detail += "; slower than bf16 although it is meant as the speed path"
        out.append(CheckResult(row, status, round(speed, 3), "x bf16", detail, data=data))
    return out


CHECKS = (check_nvfp4_library, check_nvfp4_quantize, check_nvfp4_gemm)
