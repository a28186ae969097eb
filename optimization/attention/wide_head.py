"""One attention head wider than the flash kernels take: the SeedVR2 VAE's mid block (one head of 512 channels).

torch's SDPA runs such a head on its memory-efficient kernel, at about 115 TFLOP/s on an H100 (cuDNN's SDPA has no
kernel for it: 3.7 ms a 720p latent frame). ``gemm_attention`` takes three steps per block of queries: the scores
in float32 from cuBLAS (16-bit inputs, float32 output), one Triton pass per row giving the softmax numerator as two
16-bit parts and its sum (``fused.softmax_split``), then one GEMM of both parts against the values, divided by the
sum. Splitting the numerator makes the result the exact one rounded to 16 bits, where a flash kernel rounds the
probabilities once (emulated on a CPU at 3072 x 512, bf16: 1.66e-3 relative L2 against float64, the bf16 floor,
against 1.78e-3). ``attention`` picks it where a once-per-device self-test finds it faster than SDPA and no further
from the float64 result; the choice is logged once.
"""
from __future__ import annotations

import logging
import statistics
from typing import Tuple

import torch
import torch.nn.functional as F

from .. import fused
from ..runtime import selftests

log = logging.getLogger(__name__)

FLASH_MAX_HEAD = 256          # the widest head torch's flash and cuDNN attention kernels take
CHUNK_BYTES = 2 ** 30         # the scores and their split numerator of one block of queries (256 MiB: 14 % slower)


def gemm_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_bytes: int = CHUNK_BYTES
                   ) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v of one head: q (B, M, d), k and v (B, N, d), 16-bit; queries in blocks whose
    scores and split numerator take at most ``chunk_bytes``. Needs the fused kernels (``fused.enabled``)."""
    b, m, d = q.shape
    n = k.shape[1]
    rows = max(1, min(m, chunk_bytes // (8 * n)))
    out = torch.empty_like(q)
    for i in range(b):
        kt = k[i].t()
        vv = torch.cat([v[i], v[i]])          # both parts of the numerator against the same values: one GEMM
        for r0 in range(0, m, rows):
            s = fused.mm32(q[i, r0:r0 + rows], kt)
            hl, l = fused.softmax_split(s, d ** -0.5, q.dtype)
            del s
            torch.div(fused.mm32(hl, vv), l[:, None], out=out[i, r0:r0 + rows])      # rounded to q's dtype once
    return out


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None])[:, 0]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v of one head, q (B, M, d), k and v (B, N, d): ``gemm_attention`` for a 16-bit head
    wider than FLASH_MAX_HEAD on a GPU where its self-test passed (``gemm_attention_selftest``), else SDPA."""
    if q.shape[-1] > FLASH_MAX_HEAD and q.is_cuda and fused.enabled(q, k, v) and \
            gemm_attention_selftest(q.device)[0]:
        return gemm_attention(q, k, v)
    return sdpa(q, k, v)


def gemm_attention_selftest(device) -> Tuple[bool, str]:
    """Once per device: ``gemm_attention`` against SDPA at a VAE-like head (512 channels, bf16): no further from the
    float64 result (4096 queries and keys) and faster (8192). Logged once."""
    return selftests.run("gemm_attention", device, check=_check)


def _check(_variant, dev) -> Tuple[bool, str]:
    ok, why = selftests.guard(_measure)(dev)
    log.info("[SeedVR2-BW] VAE attention, heads over %d channels on %s: %s (%s)", FLASH_MAX_HEAD, dev,
             "two GEMMs with a split softmax" if ok else "SDPA", why)
    return ok, why


def _measure(dev) -> Tuple[bool, str]:
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(1, 4096, 512, device=dev, generator=gen) for _ in range(3))
    q = q * 3                                  # peaked probabilities, as the VAE's are
    want = torch.softmax((q.double() @ k.double().transpose(1, 2)) / 512 ** 0.5, -1) @ v.double()
    q, k, v = (t.bfloat16() for t in (q, k, v))
    fns = {"gemm": gemm_attention, "sdpa": sdpa}
    errs = {name: ((fn(q, k, v).double() - want).norm() / want.norm()).item() for name, fn in fns.items()}
    # timed at 8192 positions (a 720p latent frame has 14400): at 4096 both take a third of a millisecond, where a
    # busy process's allocator or launch queue decides; CUDA events, medians of alternating rounds
    q, k, v = (torch.randn(1, 8192, 512, device=dev, generator=gen, dtype=torch.bfloat16) for _ in range(3))
    times = {name: [] for name in fns}
    for r in range(7):
        for name, fn in fns.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn(q, k, v)
            b.record()
            b.synchronize()
            if r >= 2:                         # the first rounds warm up kernels and the allocator
                times[name].append(a.elapsed_time(b))
    ratio = statistics.median(times["gemm"]) / statistics.median(times["sdpa"])
    why = f"{ratio:.2f}x SDPA's time, rel err {errs['gemm']:.2e} against SDPA's {errs['sdpa']:.2e}"
    return errs["gemm"] <= 1.01 * errs["sdpa"] and ratio < 1.0, why
