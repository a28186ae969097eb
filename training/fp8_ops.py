"""FP8 (e4m3) helpers shared by the fp8 frozen base (``quant.py``) and the base+LoRA operator
(``lora_linear_op.py``): per-token activation quantization, the weight transpose of the input gradient, and
``torch._scaled_mm``'s row-wise scale layout.

The activation quantization is the pack's one, ``optimization.nvfp4.kernels.quantize_rows_fp8`` (the Triton kernel
where Triton runs, else the reference it reproduces bit for bit), so training quantizes exactly as inference does on
every device.
"""
from __future__ import annotations

import torch

from ..optimization.nvfp4 import kernels as nvfp4_kernels


def quantize_rows(x2: torch.Tensor):
    """x2 [M, K] -> (e4m3 [M, K], fp32 scale [M]) with one scale per row (amax_row / 448).

    Per row, because both GEMMs contract over the other axis: in ``x @ W.T`` and in ``g @ W`` a row scale of the
    left operand factors out of the sum (``torch._scaled_mm``'s row-wise scaling). A per-tensor amax needs a
    grid-wide reduction first, which profiled at 2-10 ms per call (compiled) on an H100.
    """
    return nvfp4_kernels.quantize_rows_fp8(x2)


def transposed(wq: torch.Tensor) -> torch.Tensor:
    """``wq.t().contiguous()``: by the pack's Triton tile kernel on CUDA (torch's strided copy of an fp8 weight
    is ~8x slower), else torch."""
    if nvfp4_kernels.triton_usable(wq) and wq.is_contiguous():
        return nvfp4_kernels.transpose_2d(wq)
    return wq.t().contiguous()


def pad16(t: torch.Tensor):
    """(t padded with zero rows to a multiple of 16, its row count before): ``torch._scaled_mm`` needs M % 16 == 0."""
    m = t.shape[0]
    if m % 16 == 0:
        return t, m
    return torch.nn.functional.pad(t, (0, 0, 0, 16 - m % 16)), m


def fp8_scale_rows(wq: torch.Tensor, wscale: torch.Tensor):
    """The per-tensor weight scale as the [1, N] and [1, K] fp32 rows ``torch._scaled_mm``'s row-wise mode takes
    (forward and input gradient); made once per Linear."""
    s = wscale.float().reshape(1, 1)
    return s.expand(1, wq.shape[0]).contiguous(), s.expand(1, wq.shape[1]).contiguous()
