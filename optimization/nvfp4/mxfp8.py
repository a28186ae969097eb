"""MXFP8: ComfyUI's ``TensorCoreMXFP8Layout`` (comfy-kitchen), exact on CPU, and ``MXFP8Linear``.

Layout of one quantized linear ``L`` in a ComfyUI file (``L.comfy_quant`` = ``{"format": "mxfp8"}``):

* ``L.weight``        float8_e4m3fn ``[roundup(N,32), roundup(K,32)]`` (zero padded)
* ``L.weight_scale``  uint8 E8M0 exponents (``2^(e-127)``; 0 stands for a zero block), one per 32 elements along
  K, in the 128x4 swizzled layout of ``format.swizzle_block_scales``: ``[roundup(Np,128), roundup(Kp/32,4)]``.
  ComfyUI 0.19.3 reads it as uint8 (its safetensors reader has no F8_E8M0); a file holding F8_E8M0 loads too.
* ``L.bias``          optional, high precision; ``L.input_scale`` is ignored (MXFP8 quantizes activations per block).

Quantization (bit-exact with comfy-kitchen's eager ``quantize_mxfp8``): per block ``e = ceil(log2(amax/448)) + 127``
clamped to [0, 254]; elements ``x / 2^(e-127)`` clamped to +-448 and rounded to E4M3; an all-zero block has e = 0.
Dequantization ``q * 2^(e-127)`` is exact in float32 and bf16 (an E4M3 value times a power of two).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from ..runtime import policy
from . import dispatch, kernels
from .checkpoint import MXFP8_FORMAT, comfy_quant_tensor
from .format import F8_E4M3_MAX, roundup, swizzle_block_scales, swizzled_scale_shape, unswizzle_block_scales

log = logging.getLogger(__name__)

MX_BLOCK = 32
E8M0_BIAS = 127
_ANNOUNCED: set = set()


def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 exponents -> float32 ``2^(e-127)``; e = 0 gives 0 (comfy-kitchen's zero block)."""
    bits = e.to(torch.int32) << 23
    return torch.where(e == 0, torch.zeros_like(bits), bits).view(torch.float32)


def quantize_mxfp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D ``w`` -> (e4m3 ``[roundup(R,32), roundup(K,32)]``, uint8 E8M0 scales swizzled). See the module docstring."""
    if w.dim() != 2:
        raise ValueError(f"MXFP8 quantizes 2-D tensors, got shape {tuple(w.shape)}")
    rows, cols = w.shape
    pr, pc = roundup(rows, MX_BLOCK), roundup(cols, MX_BLOCK)
    if (pr, pc) != (rows, cols):
        w = F.pad(w, (0, pc - cols, 0, pr - rows))
    xb = w.reshape(pr, pc // MX_BLOCK, MX_BLOCK)
    amax = xb.abs().amax(dim=-1)
    need = torch.clamp(amax.float() / F8_E4M3_MAX, min=2.0 ** -127)
    # log2 then ceil as comfy-kitchen does: an exact power of two keeps its exponent, so amax = 448 * 2^k fits
    e = torch.clamp(torch.ceil(torch.log2(need)).to(torch.int32) + E8M0_BIAS, 0, 254).to(torch.uint8)
    zero = amax == 0
    s = torch.where(zero, torch.ones_like(need), e8m0_to_float(e))
    d = xb.float() / s.unsqueeze(-1)
    d = torch.where(zero.unsqueeze(-1), torch.zeros_like(d), d)
    q = torch.clamp(d, -F8_E4M3_MAX, F8_E4M3_MAX).reshape(pr, pc).to(torch.float8_e4m3fn)
    e = torch.where(zero, torch.zeros_like(e), e)
    return q, swizzle_block_scales(e)


def block_exponents(scales: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Swizzled E8M0 scales (uint8 or float8_e8m0fnu) of a padded ``[rows, cols]`` weight -> uint8 ``[rows, cols/32]``."""
    return unswizzle_block_scales(scales.view(torch.uint8), rows, cols // MX_BLOCK)


def dequantize_mxfp8(q: torch.Tensor, scales: torch.Tensor, dtype=torch.float32,
                     shape: tuple[int, int] | None = None) -> torch.Tensor:
    """``q * 2^(e-127)`` per block (exact in float32), cast once to ``dtype``, cropped to ``shape``."""
    rows, cols = q.shape
    s = e8m0_to_float(block_exponents(scales, rows, cols))
    out = (q.float().reshape(rows, cols // MX_BLOCK, MX_BLOCK) * s.unsqueeze(-1)).reshape(rows, cols)
    if shape is not None:
        out = out[: shape[0], : shape[1]]
    return out.to(dtype)


def mxfp8_to_fp8_rowwise(q: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int]):
    """The weight as FP8 E4M3 with one power-of-two scale per row (the row's largest block scale), for the FP8
    GEMM of sm_89 / sm_90: a block with a smaller scale is shifted down by the difference, exact unless its values
    fall below E4M3's subnormals (tests/test_comfy_layouts.py measures how often)."""
    rows, cols = q.shape
    e = block_exponents(scales, rows, cols).to(torch.int32)[: shape[0]]
    top = e.amax(dim=1, keepdim=True)
    shift = torch.exp2((e - top).float()).repeat_interleave(MX_BLOCK, dim=1)
    w8 = (q[: shape[0]].float() * shift)[:, : shape[1]].to(torch.float8_e4m3fn)
    return w8, e8m0_to_float(top.to(torch.uint8)).reshape(-1)


class MXFP8Linear(torch.nn.Module):
    """nn.Linear replacement holding an MXFP8 weight under ComfyUI's keys (``weight``, ``weight_scale``,
    ``comfy_quant``). ``path``: ``auto`` (the hardware policy: its speed paths run the FP8 GEMM, fidelity the exact
    dequantized weight), or one of ``dispatch.MXFP8_REQUESTS``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=torch.bfloat16,
                 path: str = "auto"):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        pr, pc = roundup(out_features, MX_BLOCK), roundup(in_features, MX_BLOCK)
        self.register_buffer("weight", torch.zeros((pr, pc), dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("weight_scale", torch.zeros(swizzled_scale_shape(pr, pc // MX_BLOCK), dtype=torch.uint8,
                                                         device=device))
        self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device),
                                       requires_grad=False) if bias else None
        self.path = path
        self.derived_tensors: dict = {}

    @classmethod
    def from_mxfp8(cls, q: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int], bias=None,
                   dtype=torch.bfloat16, path: str = "auto") -> "MXFP8Linear":
        n, k = shape
        want = (roundup(n, MX_BLOCK), roundup(k, MX_BLOCK))
        if tuple(q.shape) != want or q.dtype != torch.float8_e4m3fn:
            raise ValueError(f"MXFP8 weight must be float8_e4m3fn {want} for a {n}x{k} linear, got {q.dtype} "
                             f"{tuple(q.shape)}")
        sshape = swizzled_scale_shape(want[0], want[1] // MX_BLOCK)
        if scales.numel() != sshape[0] * sshape[1]:
            raise ValueError(f"MXFP8 weight_scale must hold {sshape} swizzled E8M0 scales, got {tuple(scales.shape)}")
        m = cls(k, n, bias=bias is not None, device="meta", dtype=dtype, path=path)
        m.weight = q
        m.weight_scale = scales.view(torch.uint8).reshape(sshape)
        if bias is not None:
            m.bias = torch.nn.Parameter(bias.detach().to(dtype).to(q.device), requires_grad=False)
        return m

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, path: str = "auto", dtype=None) -> "MXFP8Linear":
        q, s = quantize_mxfp8(linear.weight.detach())
        return cls.from_mxfp8(q, s, (linear.out_features, linear.in_features), linear.bias, path=path,
                              dtype=dtype or linear.weight.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    def weight_nbytes(self) -> int:
        return self.weight.numel() + self.weight_scale.numel()

    def drop_derived(self) -> None:
        self.derived_tensors.clear()

    def _apply(self, fn, recurse=True):
        self.derived_tensors.clear()
        return super()._apply(fn, recurse)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "comfy_quant"] = comfy_quant_tensor({"format": MXFP8_FORMAT})

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        state_dict.pop(prefix + "comfy_quant", None)
        state_dict.pop(prefix + "input_scale", None)
        self.derived_tensors.clear()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def dequantize_weight(self, dtype=torch.float32) -> torch.Tensor:
        return dequantize_mxfp8(self.weight, self.weight_scale, dtype, (self.out_features, self.in_features))

    def _site(self, device: torch.device) -> dispatch.Site:
        return dispatch.Site(cuda=device.type == "cuda", dims16=not (self.in_features % 16 or self.out_features % 16),
                             policy_path=lambda: policy.get_policy(device).nvfp4_gemm,
                             fp8=lambda: policy.get_policy(device).fp8_gemm)

    def derived_bytes(self, device) -> int:
        """GPU bytes this layer derives from its weight on ``device`` (the FP8 copy where the FP8 GEMM runs), for
        the memory plan."""
        d = dispatch.decide(MXFP8_FORMAT, self.path, 1, self._site(torch.device(device)))
        return self.out_features * (self.in_features + 4) if d.kernel == "mxfp8_fp8_rowwise" else 0

    def decision(self, x2: torch.Tensor) -> dispatch.Decision:
        d = dispatch.decide(MXFP8_FORMAT, self.path, x2.shape[0], self._site(x2.device))
        key = (d.path, d.kernel)
        if key not in _ANNOUNCED:
            _ANNOUNCED.add(key)
            log.info("%s", d.line("MXFP8", x2.shape[0]))
        return d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        kernel = self.decision(x2).kernel
        if kernel == "mxfp8_fp8_rowwise":
            y = self._fp8_rowwise(x2)
        else:
            dtype = torch.float32 if kernel == "reference" or x2.dtype not in (torch.bfloat16, torch.float16) \
                else x2.dtype
            b = self.bias.to(dtype) if self.bias is not None else None
            y = F.linear(x2.to(dtype), self.dequantize_weight(dtype), b)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def _fp8_rowwise(self, x2: torch.Tensor) -> torch.Tensor:
        key = ("fp8", str(x2.device))
        if key not in self.derived_tensors:
            self.derived_tensors[key] = mxfp8_to_fp8_rowwise(self.weight, self.weight_scale,
                                                             (self.out_features, self.in_features))
        w8, sw = self.derived_tensors[key]
        xq, sx = kernels.quantize_rows_fp8(x2)
        b = self.bias.to(torch.bfloat16) if self.bias is not None else None
        return torch._scaled_mm(xq, w8.t(), scale_a=sx.reshape(-1, 1), scale_b=sw.reshape(1, -1),
                                out_dtype=torch.bfloat16, bias=b)
