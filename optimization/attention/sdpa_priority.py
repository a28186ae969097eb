"""Which ``F.scaled_dot_product_attention`` kernel runs first, for code that calls SDPA directly (ComfyUI's
``attention_pytorch``, which FLUX training goes through).

Why: torch tries FlashAttention-2 before cuDNN. On an H100 cuDNN's fused attention is 1.9x faster forward+backward
on FLUX's joint attention (24 heads x 128, 4352 tokens: 1.61 vs 2.98 ms, ``bench_flux_lora.py --attention``).
cuDNN goes first when a tiny forward+backward self-test matches the math kernel on this device; otherwise
torch's own order stays. ``SEEDVR2BW_SDPA`` = ``auto`` (default) | ``cudnn`` | ``flash`` | ``default``
(torch's order) overrides it.
"""
from __future__ import annotations

import contextlib
import logging

import torch

from ..runtime import knobs, selftests

log = logging.getLogger(__name__)
ENV = knobs.KNOB["SDPA"].var


def cudnn_selftest(device_index: int) -> tuple[bool, str]:
    """cuDNN SDPA forward + input gradients on a small causal-free case against the math kernel in fp32 (once per
    device)."""
    return selftests.run("cudnn_sdpa", torch.device("cuda", device_index), check=_check_cudnn)


def _check_cudnn(_variant, dev) -> tuple[bool, str]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if torch.cuda.get_device_capability(dev) < (8, 0):
        return False, "cuDNN fused attention needs sm_80+"
    try:
        gen = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (torch.randn(1, 4, 320, 128, device=dev, generator=gen) for _ in range(3))
        g = torch.randn(1, 4, 320, 128, device=dev, generator=gen)

        def run(dtype, backend):
            ins = [t.to(dtype).requires_grad_(True) for t in (q, k, v)]
            with sdpa_kernel([backend]):
                o = torch.nn.functional.scaled_dot_product_attention(*ins)
                grads = torch.autograd.grad(o, ins, g.to(dtype))
            return [o.float(), *(t.float() for t in grads)]

        got, want = run(torch.bfloat16, SDPBackend.CUDNN_ATTENTION), run(torch.float32, SDPBackend.MATH)
        errs = [((a - b).norm() / b.norm()).item() for a, b in zip(got, want)]
        if not all(e < 2e-2 for e in errs):   # bf16 inputs: ~4e-3
            return False, f"cuDNN attention differs from the math kernel (rel err out/dq/dk/dv {errs})"
        return True, f"rel err vs math {max(errs):.1e}"
    except Exception as exc:  # noqa: BLE001 - no cuDNN attention in this build / for this GPU
        return False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def preferred_backends(device) -> tuple[list | None, str]:
    """(SDPA backends in priority order, or None for torch's own order; the reason, for the log line)."""
    from torch.nn.attention import SDPBackend
    device = torch.device(device)
    choice = knobs.get("SDPA")
    if device.type != "cuda" or choice == "default":
        return None, f"torch's order ({'CPU' if device.type != 'cuda' else ENV + '=default'})"
    rest = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    if choice == "flash":
        return None, f"torch's order, FlashAttention first ({ENV}=flash)"
    ok, why = cudnn_selftest(device.index if device.index is not None else torch.cuda.current_device())
    if not ok:
        return None, f"torch's order: cuDNN attention off ({why})"
    return [SDPBackend.CUDNN_ATTENTION] + rest, f"cuDNN first ({ENV}={choice}; self-test {why})"


def sdpa_priority(backends):
    """Context in which SDPA tries ``backends`` in this order (no-op for None)."""
    if backends is None:
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel
    return sdpa_kernel(backends, set_priority=True)
