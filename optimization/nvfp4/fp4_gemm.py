"""The FP4 tensor-core GEMM (sm_100 / sm_120) of the ``fp4_tensorcore`` path, as free functions: the operands
(activations quantized to NVFP4, checked bit-exactly on the CPU) and the call through
``torch.nn.functional.scaled_mm`` (two-level NVFP4 recipe, global scales as cuBLASLt alpha) or, on torch
without it, ``torch._scaled_mm`` with single-level scales and the global scales applied after."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import format as fmt
from . import kernels, launch
from .format import NVFP4Tensor


def fp4_gemm_supported(device) -> tuple[bool, str]:
    device = torch.device(device)
    if device.type != "cuda":
        return False, "not a CUDA device"
    cap = torch.cuda.get_device_capability(device)
    if cap[0] not in (10, 12):
        return False, f"sm_{cap[0]}{cap[1]} has no FP4 tensor cores (needs sm_100/sm_120)"
    if not hasattr(torch, "float4_e2m1fn_x2"):
        return False, "this torch has no float4_e2m1fn_x2"
    return True, "ok"


def activation_global_scale(x: torch.Tensor, input_scale: torch.Tensor | None) -> torch.Tensor:
    if input_scale is not None:
        return input_scale.to(device=x.device, dtype=torch.float32).reshape(())
    return fmt.global_scale_for(x)


def quantize_activation_nvfp4(x2: torch.Tensor, g: torch.Tensor):
    """[M, Kp] -> (packed uint8 [M, Kp/2] hi_first, swizzled e4m3 [roundup(M,128), roundup(Kp/16,4)])."""
    if launch.triton_usable(x2):
        return kernels.quantize_act_nvfp4(x2, g)
    packed, scales, _ = fmt.quantize_nvfp4(x2, g, pad_rows=1)
    return packed, scales


def fp4_gemm_operands(x2: torch.Tensor, weight: NVFP4Tensor, input_scale: torch.Tensor | None = None) -> dict:
    """Every tensor the FP4 GEMM receives. ``x2`` must be [M, Kp] (padded like the weight)."""
    g_a = activation_global_scale(x2, input_scale)
    a, sa = quantize_activation_nvfp4(x2, g_a)
    return {"a": a, "scale_a": sa, "global_a": g_a, "b": weight.packed, "scale_b": weight.block_scale,
            "global_b": weight.global_scale.to(x2.device)}


def fp4_gemm(ops: dict, out_dtype=torch.bfloat16, bias: torch.Tensor | None = None) -> torch.Tensor:
    """out[M, Np] = dequant(a) @ dequant(b)^T on FP4 tensor cores (sm_100 / sm_120 only)."""
    fp4 = torch.float4_e2m1fn_x2
    a = ops["a"].view(fp4)
    b = ops["b"].view(fp4).t()
    if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
        ST, SW = F.ScalingType, F.SwizzleType
        out = F.scaled_mm(a, b,
                          scale_a=[ops["scale_a"].reshape(-1), ops["global_a"].reshape(())],
                          scale_recipe_a=[ST.BlockWise1x16, ST.TensorWise],
                          scale_b=[ops["scale_b"].reshape(-1), ops["global_b"].reshape(())],
                          scale_recipe_b=[ST.BlockWise1x16, ST.TensorWise],
                          swizzle_a=[SW.SWIZZLE_32_4_4, SW.NO_SWIZZLE],
                          swizzle_b=[SW.SWIZZLE_32_4_4, SW.NO_SWIZZLE],
                          output_dtype=out_dtype)
    else:
        out = torch._scaled_mm(a, b, scale_a=ops["scale_a"].reshape(-1), scale_b=ops["scale_b"].reshape(-1),
                               out_dtype=out_dtype)
        out = out * (ops["global_a"] * ops["global_b"]).to(out_dtype)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out
