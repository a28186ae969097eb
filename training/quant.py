"""Low-precision frozen base for LoRA training: fp8 (e4m3) and NVFP4 storage.

The frozen block Linears of the FLUX model get a quantized copy of their weight, and their ``forward`` is
replaced (per instance, undone by ``restore``) by an autograd function that computes the input gradient but
never a weight gradient. Only that is training-specific; the formats come from the pack:

* ``fp8``: weight e4m3 with one per-tensor scale, ``optimization.nvfp4.format.quantize_fp8_per_tensor``
  (per-tensor, not per-row, because the input gradient ``g @ W`` contracts over the rows of ``W``: a row scale
  would sit inside the sum, where ``torch._scaled_mm`` cannot apply it). Whether FP8 tensor cores are used is
  ``optimization.runtime.policy.get_policy(device).fp8_gemm`` (self-tested on the device, overridable with
  ``SEEDVR2BW_FP8_GEMM``). With it, the forward (x quantized to e4m3 per token) and the input gradient (grad
  quantized to e4m3 per token, both by ``fp8_ops.quantize_rows``, the pack's one per-token quantizer) run through
  ``torch._scaled_mm`` with row-wise scales; without it the weight is dequantized to the compute dtype.
* ``nvfp4``: weight quantized by ``optimization.nvfp4.format.quantize_nvfp4`` (the pack's one NVFP4 quantizer,
  comfy-kitchen recipe, internal layout: hi_first nibbles, swizzled e4m3 block scales, fp32 global scale) and
  dequantized per call (forward and input gradient) by the Triton kernel ``kernels.dequantize_nvfp4_triton``
  where Triton runs, else by the exact ``format.dequantize_nvfp4`` (bit-identical results); the GEMM runs in
  the compute dtype.

The quantized tensors are non-persistent buffers of the Linear (so BlockSwap arenas and the trainer's staging move
them with their block, in their stored formats); the high-precision weight waits in host RAM while training (moved
there from the GPU, or left where it is when the model is on the host: no copy) and is put back by ``restore``.
"""
from __future__ import annotations

import logging

import torch

from ..optimization.runtime.policy import get_policy
from ..optimization.nvfp4 import format as fmt
from ..optimization.nvfp4 import kernels as nvfp4_kernels
from ..optimization.nvfp4.format import NVFP4Tensor
from .fp8_ops import fp8_scale_rows, pad16, quantize_rows, transposed
from .linear_patch import attach_base, detach_base
from .lora_linear_op import fp8_lora_linear
from .recompute import recompute

log = logging.getLogger(__name__)
E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


# ---------------- fp8 ----------------
class FP8LinearFn(torch.autograd.Function):
    """y = x @ (wq * wscale).T + bias with e4m3 operands on FP8 tensor cores (``tensorcores``), else the weight
    dequantized to x's dtype. The input gradient ``g @ W`` likewise; no weight gradient (frozen base)."""

    @staticmethod
    def forward(ctx, x, wq, wscale, bias, tensorcores, scale_rows=None):
        if tensorcores and scale_rows is None:
            scale_rows = fp8_scale_rows(wq, wscale)
        ctx.scale_rows = scale_rows
        ctx.save_for_backward(wq, wscale)
        ctx.kept = None
        ctx.tensorcores = tensorcores
        ctx.x_dtype = x.dtype
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        M = x2.shape[0]
        if tensorcores and (M % 16 == 0 or M < 256):
            xp, M0 = pad16(x2)
            xq, xs = quantize_rows(xp)
            if bias is not None and bias.dtype != x.dtype:
                bias = bias.to(x.dtype)
            y = torch._scaled_mm(xq, wq.t(), scale_a=xs.reshape(-1, 1), scale_b=scale_rows[0], bias=bias,
                                 out_dtype=x.dtype)
            if y.shape[0] != M0:
                y = y[:M0]
        else:
            w = wq.to(x.dtype) * wscale.to(x.dtype)
            if recompute.depth and ctx.needs_input_grad[0]:
                ctx.kept = w  # checkpoint recompute: the backward right after reuses it (recompute.py)
            y = torch.nn.functional.linear(x2, w, None if bias is None else bias.to(x.dtype))
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, g):
        wq, wscale = ctx.saved_tensors
        N = g.shape[-1]
        g2 = g if g.dim() == 2 else g.reshape(-1, N)
        M = g2.shape[0]
        if ctx.tensorcores and (M % 16 == 0 or M < 256):
            gp, M0 = pad16(g2)
            gq, gs = quantize_rows(gp)
            wt = transposed(wq)  # [K, N] row-major -> .t() is column-major [N, K] as _scaled_mm wants
            dx = torch._scaled_mm(gq, wt.t(), scale_a=gs.reshape(-1, 1), scale_b=ctx.scale_rows[1], out_dtype=g.dtype)
            if dx.shape[0] != M0:
                dx = dx[:M0]
        else:
            w = ctx.kept
            if w is None or w.dtype != g.dtype:
                w = wq.to(g.dtype) * wscale.to(g.dtype)
            ctx.kept = None
            dx = g2 @ w
        if g.dim() != 2:
            dx = dx.reshape(*g.shape[:-1], dx.shape[-1])
        return (dx if dx.dtype == ctx.x_dtype else dx.to(ctx.x_dtype)), None, None, None, None, None


# Compiled block forwards (flux_forward.compile_block_forwards) call these opaquely: Inductor cannot lower the
# row-wise _scaled_mm inside the autograd function, nor the pack's raw Triton launches; the graph breaks here.
def _fp8_operands(lin):
    """(e4m3 weight, scale): the quantized buffers, or the weight itself where ComfyUI stored it in fp8."""
    b = lin._buffers
    q = b.get("_q_weight")
    return (lin._parameters["weight"] if q is None else q), b["_q_scale"]


@torch.compiler.disable
def _fp8_forward(self, x):
    q, s = _fp8_operands(self)
    d = self.__dict__
    return FP8LinearFn.apply(x, q, s, self.bias, d["_q_tensorcores"], d["_q_scale_rows"])


@torch.compiler.disable
def _fp8_with_lora(self, x2, lora):
    """The fp8 base and its LoRA as one operator (``lora_linear_op.fp8_lora_linear``) on FP8 tensor cores with
    M % 16 == 0; None otherwise (then the base and the LoRA run one after the other)."""
    if not self._q_tensorcores or x2.shape[0] % 16 or x2.dtype not in (torch.bfloat16, torch.float16):
        return None
    down_t, up_t = lora.compute_weights(x2.dtype)
    bias = self.bias
    if bias is not None and bias.dtype != x2.dtype:
        bias = bias.to(x2.dtype)
    scale_n, scale_k = self._q_scale_rows
    return fp8_lora_linear(x2, _fp8_operands(self)[0], scale_n, scale_k, bias, down_t, up_t, lora.scale)[0]


# ---------------- NVFP4 ----------------
# why the Triton dequant failed in this process (empty while it works; once not, the torch reference is used)
triton_broken: list = []


def dequantize_weight(t: NVFP4Tensor, dtype) -> torch.Tensor:
    """The pack's NVFP4 dequantization: Triton kernel where Triton runs (CUDA), else the exact torch reference;
    both give the same bits."""
    if not triton_broken and nvfp4_kernels.triton_usable(t.packed):
        try:
            return nvfp4_kernels.dequantize_nvfp4_triton(t.packed, t.block_scale, t.global_scale, t.shape,
                                                         dtype=dtype)
        except Exception as exc:  # noqa: BLE001 - e.g. a Triton build failure on this GPU / version
            triton_broken.append(f"{type(exc).__name__}: {exc}")
            log.warning("[FluxLoraTrain] NVFP4 Triton dequant unavailable (%s); using the torch reference",
                        triton_broken[0].splitlines()[0])
    return t.dequantize(dtype)


class _NVFP4LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, packed, block_scale, global_scale, shape, bias):
        ctx.shape = shape
        w = dequantize_weight(NVFP4Tensor(packed, block_scale, global_scale, shape), x.dtype)
        ctx.save_for_backward(packed, block_scale, global_scale)
        # checkpoint recompute: the backward follows right away, keep this weight for it (recompute.py)
        ctx.kept = w if recompute.depth and ctx.needs_input_grad[0] else None
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        return torch.nn.functional.linear(x, w, bias)

    @staticmethod
    def backward(ctx, g):
        w, ctx.kept = ctx.kept, None
        if w is None or w.dtype != g.dtype:
            packed, block_scale, global_scale = ctx.saved_tensors
            w = dequantize_weight(NVFP4Tensor(packed, block_scale, global_scale, ctx.shape), g.dtype)
        return g @ w, None, None, None, None, None


@torch.compiler.disable
def _nvfp4_forward(self, x):
    b = self._buffers
    return _NVFP4LinearFn.apply(x, b["_q_packed"], b["_q_block_scale"], b["_q_global_scale"],
                                self.__dict__["_q_shape"], self.bias)


# ---------------- apply / restore ----------------
def block_linears(dm):
    for kind in ("double_blocks", "single_blocks"):
        for i, blk in enumerate(getattr(dm, kind)):
            for name, mod in blk.named_modules():
                if isinstance(mod, torch.nn.Linear):
                    yield f"{kind}.{i}.{name}", mod


# instance attributes (derived from the scale, on the compute device) and buffers (what BlockSwap and staging move
# with the block, in the stored formats) of a quantized Linear
_Q_ATTRS = ("_q_scale_rows", "_q_tensorcores", "_q_shape")
_Q_BUFFERS = ("_q_weight", "_q_scale", "_q_packed", "_q_block_scale", "_q_global_scale")


def quantized_weight(lin):
    """What the frozen base computes ``lin`` with: the ``NVFP4Tensor`` (nvfp4), ``(e4m3 weight, scale)`` (fp8), or
    None where ``lin`` is not quantized (kept in high precision, or restored)."""
    b = lin._buffers
    if "_q_packed" in b:
        return NVFP4Tensor(b["_q_packed"], b["_q_block_scale"], b["_q_global_scale"], lin.__dict__["_q_shape"])
    if "_q_scale" in b:
        return _fp8_operands(lin)
    return None


def uses_fp8_tensorcores(lin) -> bool:
    """Whether ``lin``'s fp8 base runs on FP8 tensor cores (else its weight is dequantized per call)."""
    return bool(lin.__dict__.get("_q_tensorcores", False))


def _put(lin, name, t):
    # non-persistent: the model's state dict stays as loaded while training
    lin.register_buffer(name, t, persistent=False)


class QuantizedBase:
    """Quantizes the frozen block Linears of ``dm`` in place; ``restore()`` undoes it exactly.

    The quantized tensors are non-persistent buffers of each Linear, made where its weight lives: on the host for a
    model ComfyUI keeps in RAM (then staging / BlockSwap move them, in their stored formats, with their block), on
    the GPU for a model already there. ``device``: the compute device (FP8 tensor-core decision, scale rows);
    ``work_device``: where each Linear is quantized, one at a time (the GPU: a host model is quantized without
    ever holding more than one of its bf16 weights there). The high-precision weight goes to ``offload_device``
    (no copy when it is already there) until ``restore``."""

    def __init__(self, dm, mode: str, offload_device="cpu", device=None, work_device=None):
        if mode not in ("fp8", "nvfp4"):
            raise ValueError(f"unknown base precision {mode!r}")
        self.mode = mode
        self.saved = []
        fp8_gemm = {}  # device -> get_policy(device).fp8_gemm, asked once per device
        for name, lin in block_linears(dm):
            w = lin.weight
            home = w.device
            dev = torch.device(device) if device is not None else home
            work = torch.device(work_device) if work_device is not None else home
            if mode == "nvfp4" and w.shape[1] % 16:
                continue  # kept in high precision, like the pack's keep rule for K % 16 != 0
            with torch.no_grad():
                if mode == "fp8":
                    if w.dtype == E4M3:  # ComfyUI loaded it in fp8 already: use it as stored
                        sw = getattr(lin, "scale_weight", None)
                        s = sw.float().reshape(()).to(home) if sw is not None else torch.ones((), device=home)
                        moved = None
                    else:
                        q, s = fmt.quantize_fp8_per_tensor(w.data.to(work))
                        _put(lin, "_q_weight", q.to(home))
                        moved = w.data.to(offload_device)
                    _put(lin, "_q_scale", s.reshape(()).to(home))
                    if dev not in fp8_gemm:
                        fp8_gemm[dev] = dev.type == "cuda" and get_policy(dev).fp8_gemm
                    lin._q_tensorcores = fp8_gemm[dev] and w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0
                    lin._q_scale_rows = fp8_scale_rows(w, s.to(dev)) if lin._q_tensorcores else None
                    attach_base(lin, _fp8_forward, _fp8_with_lora)
                else:
                    src = w.data.to(work)
                    if w.dtype in (E4M3, E5M2):
                        src = src.float() * getattr(lin, "scale_weight", torch.ones(())).float().to(work)
                    t = fmt.quantize_nvfp4(src, return_tensor=True)
                    for key, v in (("_q_packed", t.packed), ("_q_block_scale", t.block_scale),
                                   ("_q_global_scale", t.global_scale)):
                        _put(lin, key, v.to(home))
                    lin._q_shape = t.shape
                    moved = w.data.to(offload_device)
                    attach_base(lin, _nvfp4_forward)
                if moved is not None:
                    w.data = torch.empty(0, dtype=w.dtype, device=home)
            self.saved.append((lin, moved, home))

    def restore(self):
        """The high-precision weights back (the same tensors where they were offloaded to their own device: no
        copy), the quantized buffers and attributes removed."""
        for lin, moved, dev in self.saved:
            if moved is not None:
                lin.weight.data = moved.to(dev)
            for a in _Q_ATTRS:
                lin.__dict__.pop(a, None)
            for b in _Q_BUFFERS:
                if b in lin._buffers:
                    delattr(lin, b)
            detach_base(lin)  # the class forward comes back unless a LoRA still uses the instance forward
        self.saved = []
