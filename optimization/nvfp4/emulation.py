"""What each NVFP4 path should return, computed on the CPU in float64 with the pack's own quantizers: the oracle
of the self-tests (``selftest.py``) and of the tests, path by path (same quantizers, exact arithmetic)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import format as fmt
from .format import NVFP4Tensor
from .fp4_gemm import activation_global_scale


def expected_output(layer, x: torch.Tensor, path: str) -> torch.Tensor:
    """What ``path`` should compute for ``x`` through ``layer`` (an ``NVFP4Linear``)."""
    layer_cpu_w = NVFP4Tensor(layer.weight.cpu(), layer.weight_scale.cpu(), layer.weight_scale_2.cpu(),
                              (layer.out_features, layer.in_features))
    x2 = x.reshape(-1, x.shape[-1]).detach().cpu()
    if layer.pre_quant_scale is not None:
        x2 = x2 * layer.pre_quant_scale.cpu().to(x2.dtype)
    w = layer_cpu_w.dequantize(torch.float32).double()
    b = layer.bias.detach().cpu().double() if layer.bias is not None else None
    if path in ("reference", "fidelity"):
        y = x2.double() @ w.t()
    elif path == "fp8_speed":
        w8, sw = fmt.nvfp4_to_fp8_rowwise(layer_cpu_w)
        xq, sx = fmt.quantize_act_fp8_rowwise_reference(x2)
        y = (xq.double() * sx.double()[:, None]) @ (w8.double() * sw.double()[:, None]).t()
    elif path == "fp4_tensorcore":
        kp = layer.weight.shape[1] * 2
        xp = F.pad(x2, (0, kp - x2.shape[1])) if x2.shape[1] != kp else x2
        g = activation_global_scale(xp, layer.input_scale.cpu() if layer.input_scale is not None else None)
        pa, sa, _ = fmt.quantize_nvfp4(xp, g, pad_rows=1)
        xa = fmt.dequantize_nvfp4(pa, sa, g, torch.float32).double()[:, : layer.in_features]
        y = xa @ w.t()
    else:
        raise ValueError(path)
    if b is not None:
        y = y + b
    return y.reshape(*x.shape[:-1], layer.out_features)
