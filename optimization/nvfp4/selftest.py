"""The on-device self-tests of the linear formats, registered with ``runtime.selftests`` for the hardware policy:
``nvfp4`` (one tiny GEMM on an NVFP4 path against its CPU emulation) and ``fp8`` (one e4m3 GEMM through
``torch._scaled_mm``). The package root imports this module, so the policy finds them whatever is imported first.
"""
from __future__ import annotations

import torch

from ..runtime import selftests
from . import format as fmt
from .dispatch import NVFP4_PATHS
from .emulation import expected_output
from .fp4_gemm import fp4_gemm_supported
from .linear import NVFP4Linear

TOLERANCE = {"reference": 5e-3, "fidelity": 1e-2, "fp8_speed": 2e-2, "fp4_tensorcore": 2e-2}


def run_gemm_selftest(path: str, device) -> tuple[bool, str]:
    """One tiny GEMM (M=64 or 96, K=128, N=64, bias) on ``path`` and ``device``, compared with the CPU emulation
    of that path (same quantizers, exact arithmetic). Returns (ok, reason); never raises."""
    try:
        if path not in NVFP4_PATHS:
            return False, f"unknown path {path!r}"
        device = torch.device(device)
        if path != "reference" and device.type != "cuda":
            return False, "not a CUDA device"
        if path == "fp4_tensorcore":
            ok, why = fp4_gemm_supported(device)
            if not ok:
                return False, why
        if path == "fp8_speed" and torch.cuda.get_device_capability(device) < (8, 9):
            return False, "FP8 tensor cores need sm_89+"
        gen = torch.Generator().manual_seed(1234)
        w = torch.randn(64, 128, generator=gen)
        layer = NVFP4Linear.from_nvfp4(fmt.quantize_nvfp4(w, return_tensor=True), bias=torch.randn(64, generator=gen),
                                       path=path, dtype=torch.bfloat16)
        errs = []
        for m in (64, 96):
            x = torch.randn(m, 128, generator=gen).to(torch.bfloat16)
            want = expected_output(layer, x, path)
            got = layer.to(device)(x.to(device)).double().cpu()
            if not torch.isfinite(got).all():
                return False, f"non-finite output on {path}"
            errs.append(((got - want).norm() / want.norm()).item())
        err = max(errs)
        if err > TOLERANCE[path]:
            return False, f"{path}: rel err {err:.2e} vs its CPU emulation (limit {TOLERANCE[path]:.0e})"
        return True, f"{path}: rel err {err:.1e} vs CPU emulation"
    except Exception as exc:  # noqa: BLE001
        return False, selftests.first_line(exc)


@selftests.guard
def fp8_gemm_selftest(_variant: str, device) -> tuple[bool, str]:
    """A 32x64 @ 64x32 e4m3 GEMM through torch._scaled_mm against the same product computed in fp32."""
    device = torch.device(device)
    if device.type != "cuda":
        return False, "not a CUDA device"
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(32, 64, generator=gen)
    b = torch.randn(32, 64, generator=gen)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    want = a8.float() @ b8.float().t()
    one = torch.ones((), device=device)
    got = torch._scaled_mm(a8.to(device), b8.to(device).t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    err = ((got.cpu() - want).norm() / want.norm()).item()
    if err > 1e-3:
        return False, f"result differs from the reference (rel err {err:.2e})"
    return True, f"rel err {err:.1e}"


selftests.register("nvfp4", lambda path, device: run_gemm_selftest(path, device))
selftests.register("fp8", fp8_gemm_selftest)
