"""On-device self-test of one NVFP4 GEMM path (called by ``optimization/selftest.py``)."""
from __future__ import annotations

import torch

from . import format as fmt
from .linear import NVFP4Linear, PATHS, expected_output, fp4_gemm_supported

TOLERANCE = {"reference": 5e-3, "fidelity": 1e-2, "fp8_speed": 2e-2, "fp4_tensorcore": 2e-2}


def run_gemm_selftest(path: str, device) -> tuple[bool, str]:
    """One tiny GEMM (M=64 or 96, K=128, N=64, bias) on ``path`` and ``device``, compared with the CPU emulation
    of that path (same quantizers, exact arithmetic). Returns (ok, reason); never raises."""
    try:
        if path not in PATHS:
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
        msg = str(exc).splitlines()[0] if str(exc) else ""
        return False, f"{type(exc).__name__}: {msg}"
