"""A frozen bf16/fp32 Linear with its LoRA as one operator: ``y = bias + scale·(x @ down) @ up + x @ W.T``.

Why one operator (``torch.ops.seedvr2bw.lora_linear``) and this order:
* The LoRA part is computed first (its rank-r GEMM writes y, with the bias), then the base GEMM accumulates into
  y (cuBLAS beta = 1). Adding the LoRA after the base product instead needs a copy of the base output
  (``torch.addmm`` with a full-size input copies it first) and one more read and write of y: at 1024² that is
  ~13 GB of traffic per forward of FLUX.1 (profiled as 18 ms of device-to-device copies per step on an H100).
* The input gradient accumulates likewise: ``dx = dh @ down.T`` then ``dx += g @ W``, instead of autograd adding
  two full-size gradients.
* Selective checkpointing (``selective_checkpoint.py``) keeps the operator's outputs as a whole, so a block's
  recompute runs none of its GEMMs (an in-place GEMM cannot be kept by itself: its cached output would be
  the mutated tensor).
No weight gradient for W or the bias (frozen base).
"""
from typing import Optional

import torch
import torch._library.custom_ops

from .fp8_ops import quantize_rows, transposed


def _custom_op(qualname: str):
    """``torch.library.custom_op(qualname, mutates_args=())``, but defined once per process.

    This file can be imported twice in one process under two package names: ComfyUI imports the pack by its
    folder name, tests and scripts as ``seedvr2bw`` (pack_import.py), and the test suite does both. Defining the
    op again makes torch destroy the first definition while the first import's op object keeps its C++ operator
    handle: its calls then read freed memory (``MemoryError: std::bad_alloc`` on every call, a wrong operator or
    a crash, depending on what reused that memory). So a second import reuses the live definition (torch's own
    registry of them, weak: once no import holds it, defining again is safe); its register_fake/register_autograd
    below then re-register the same functions on it."""
    existing = getattr(torch._library.custom_ops, "OPDEFS", {}).get(qualname)
    if existing is not None:
        return lambda fn: existing
    return torch.library.custom_op(qualname, mutates_args=())


@_custom_op("seedvr2bw::lora_linear")
def lora_linear(x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], down_t: torch.Tensor,
                up_t: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 [M, K], weight [N, K], bias [N] or None, down_t [K, r], up_t [r, N] -> (y [M, N], h = x2 @ down_t)."""
    h = torch.mm(x2, down_t)
    if bias is not None:
        y = torch.addmm(bias.to(x2.dtype), h, up_t, alpha=scale)
    else:
        y = torch.mm(h, up_t)
        if scale != 1.0:
            y.mul_(scale)
    y.addmm_(x2, weight.t())
    return y, h


@lora_linear.register_fake
def _(x2, weight, bias, down_t, up_t, scale):
    return x2.new_empty(x2.shape[0], weight.shape[0]), x2.new_empty(x2.shape[0], down_t.shape[1])


def _setup_context(ctx, inputs, output):
    x2, weight, _bias, down_t, up_t, scale = inputs
    ctx.save_for_backward(x2, weight, down_t, up_t, output[1])
    ctx.scale = scale


def _mm_like(a, b, like):
    """``a @ b`` laid out as ``like``: column-major when ``like`` is (``down_t``/``up_t`` are transposed views of
    the LoRA weights, so their gradients then reach the weights contiguous, as fused optimizers require)."""
    if like.dim() == 2 and like.stride(0) == 1 and like.shape[1] > 1:
        return torch.mm(b.t(), a.t()).t()
    return torch.mm(a, b)


def _lora_grads(x2, down_t, up_t, h, s, gy, gh, need_down, need_up):
    """Gradients of ``y = ... + s·h @ up`` with ``h = x2 @ down``: (d down_t, d up_t, dh), dh for the input
    gradient ``dh @ down_t.T``."""
    g_up = _mm_like(h.t(), gy, up_t).mul_(s) if need_up else None
    dh = torch.mm(gy, up_t.t())
    if s != 1.0:
        dh.mul_(s)
    if gh is not None:
        dh.add_(gh)
    g_down = _mm_like(x2.t(), dh, down_t) if need_down else None
    return g_down, g_up, dh


def _backward(ctx, gy, gh):
    x2, weight, down_t, up_t, h = ctx.saved_tensors
    need_x, _, _, need_down, need_up, _ = ctx.needs_input_grad
    g_down, g_up, dh = _lora_grads(x2, down_t, up_t, h, ctx.scale, gy, gh, need_down, need_up)
    dx = None
    if need_x:
        dx = torch.mm(dh, down_t.t())
        dx.addmm_(gy, weight)
    return dx, None, None, g_down, g_up, None


lora_linear.register_autograd(_backward, setup_context=_setup_context)


# ---------------- fp8 base (FP8 tensor cores) ----------------
@_custom_op("seedvr2bw::fp8_lora_linear")
def fp8_lora_linear(x2: torch.Tensor, wq: torch.Tensor, scale_n: torch.Tensor, scale_k: torch.Tensor,
                    bias: Optional[torch.Tensor], down_t: torch.Tensor, up_t: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``lora_linear`` with an e4m3 base weight ``wq`` [N, K] (per-tensor scale as the rows ``scale_n`` [1, N] /
    ``scale_k`` [1, K], ``fp8_ops.fp8_scale_rows``): x quantized per token, ``torch._scaled_mm``, then the
    LoRA accumulates into its output (``addmm_``, no copy). M must be a multiple of 16."""
    xq, xs = quantize_rows(x2)
    y = torch._scaled_mm(xq, wq.t(), scale_a=xs.reshape(-1, 1), scale_b=scale_n, bias=bias, out_dtype=x2.dtype)
    h = torch.mm(x2, down_t)
    y.addmm_(h, up_t, alpha=scale)
    return y, h


@fp8_lora_linear.register_fake
def _(x2, wq, scale_n, scale_k, bias, down_t, up_t, scale):
    return x2.new_empty(x2.shape[0], wq.shape[0]), x2.new_empty(x2.shape[0], down_t.shape[1])


def _fp8_setup_context(ctx, inputs, output):
    x2, wq, _scale_n, scale_k, _bias, down_t, up_t, scale = inputs
    ctx.save_for_backward(x2, wq, scale_k, down_t, up_t, output[1])
    ctx.scale = scale


def _fp8_backward(ctx, gy, gh):
    x2, wq, scale_k, down_t, up_t, h = ctx.saved_tensors
    need_x, _, _, _, _, need_down, need_up, _ = ctx.needs_input_grad
    g_down, g_up, dh = _lora_grads(x2, down_t, up_t, h, ctx.scale, gy, gh, need_down, need_up)
    dx = None
    if need_x:
        gq, gs = quantize_rows(gy.contiguous())
        dx = torch._scaled_mm(gq, transposed(wq).t(), scale_a=gs.reshape(-1, 1), scale_b=scale_k,
                              out_dtype=gy.dtype)
        dx.addmm_(dh, down_t.t())
    return dx, None, None, None, None, g_down, g_up, None


fp8_lora_linear.register_autograd(_fp8_backward, setup_context=_fp8_setup_context)
