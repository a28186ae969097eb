"""Small on-device self-test ops, one per feature that needs special hardware.

Each returns ``(ok, reason)``. They run once per device when the hardware policy is computed, in well under a
second, and never raise: a self-test that crashes is a failed self-test, and its exception is the reason.
"""
from __future__ import annotations

import torch


def _guard(fn):
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any failure means "feature off", with this reason
            return False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    wrapped.__name__ = fn.__name__
    wrapped.__doc__ = fn.__doc__
    return wrapped


@_guard
def nvfp4_gemm_selftest(path: str, info) -> tuple[bool, str]:
    """One tiny GEMM on ``path`` compared with the exact CPU reference (the NVFP4 package owns the op)."""
    from .nvfp4.selftest import run_gemm_selftest
    return run_gemm_selftest(path, info.torch_device)


@_guard
def fp8_gemm_selftest(_feature: str, info) -> tuple[bool, str]:
    """A 32x64 @ 64x32 e4m3 GEMM through torch._scaled_mm against the same product computed in fp32."""
    device = info.torch_device
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
