"""INT8 with ConvRot: ComfyUI's ``int8_tensorwise`` format (comfy-kitchen ``TensorWiseINT8Layout``), exact on CPU, and
``Int8Linear``.

One quantized linear ``L`` in a ComfyUI file: ``L.comfy_quant`` = ``{"format": "int8_tensorwise", "convrot": true,
"convrot_groupsize": 256}`` (the two ConvRot keys may sit under ``"params"``; ``"int8"`` is accepted as the format
name too), ``L.weight`` int8 ``[N, K]`` (no padding), ``L.weight_scale`` float32 ``[N, 1]`` per output channel (or a
scalar without ConvRot), ``L.bias`` optional.

ConvRot: ``H`` is the regular Hadamard matrix of size g (a power of 4: Kronecker powers of the symmetric 4x4 block
with one -1 per row, scaled by 1/sqrt(g), so ``H @ H = I``). The file holds ``W H`` (per group of g input features)
quantized per row: ``scale = amax/127``, ``q = round(x / scale)``. A call rotates the activations the same way
(``x H``), quantizes them per token, multiplies in integers and rescales: ``y = (q_x q_w^T) * s_x * s_w^T + b``,
which approximates ``x W^T + b`` since ``x H (W H)^T = x W^T``. Every step follows comfy-kitchen's eager
``int8_linear`` (the scale rounded to the activations' dtype before the division, round half to even, the int32 sum
converted to float32), so the result is bit-identical to it on CPU.

On CUDA ``Int8Linear`` runs ``int8_linear_fused``: the rotation and quantization in one Triton kernel, the rescale and
bias in another (``int8_kernels``), ``torch._int_mm`` between them; its codes may differ from the reference's by one
where the rotation's float32 sum, taken in another order, rounds to a neighbouring bf16 / fp16 value.
"""
from __future__ import annotations

import logging

import torch

from ..runtime import device_cache, selftests
from . import dispatch, int8_kernels, launch
from .checkpoint import INT8_FORMATS, comfy_quant_tensor

log = logging.getLogger(__name__)

INT8_FORMAT = INT8_FORMATS[0]
_H4 = ((1, 1, 1, -1), (1, 1, -1, 1), (1, -1, 1, 1), (-1, 1, 1, 1))
_HADAMARD: dict = device_cache.cache()
_ANNOUNCED: set = set()


def hadamard(size: int, device="cpu", dtype=torch.float32) -> torch.Tensor:
    """The normalized regular Hadamard matrix of ``size`` (a power of 4), symmetric and its own inverse."""
    key = (size, str(device), dtype)
    h = _HADAMARD.get(key)
    if h is None:
        n = 4
        while n < size:
            n *= 4
        if size < 4 or n != size:
            raise ValueError(f"ConvRot group size must be a power of 4 (4, 16, 64, 256, ...), got {size}")
        base = torch.tensor(_H4, dtype=torch.float32)
        h = base
        while h.shape[0] < size:
            h = torch.kron(h, base)
        h = _HADAMARD[key] = (h / size ** 0.5).to(device=device, dtype=dtype)   # 1/sqrt(4^k) is a power of two
    return h


def rotate(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x H`` on each group of ``group`` features of the last dimension, in x's dtype (``W H`` for a weight too:
    ``H`` is symmetric)."""
    k = x.shape[-1]
    if k % group:
        raise ValueError(f"ConvRot group size {group} does not divide the {k} input features")
    h = hadamard(group, x.device, x.dtype)
    return torch.matmul(x.reshape(-1, k // group, group), h).reshape(x.shape)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row int8: (int8 like x, float32 scales ``[..., 1]`` = amax/127, at least 1e-30)."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / 127.0).clamp(min=1e-30)
    s = scale.to(x.dtype)
    s = torch.where(s == 0, torch.full_like(s, torch.finfo(x.dtype).tiny), s)   # 1e-30 underflows in fp16
    return (x / s).round().clamp(-128, 127).to(torch.int8), scale


def quantize_int8_convrot(w: torch.Tensor, group: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``[N, K]`` weight -> (int8 ``W H`` ``[N, K]``, float32 scales ``[N, 1]``), comfy-kitchen's ConvRot weight."""
    if w.dim() != 2:
        raise ValueError(f"INT8 quantizes 2-D weights, got shape {tuple(w.shape)}")
    return quantize_rows(rotate(w, group))


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, group: int | None, dtype=torch.float32) -> torch.Tensor:
    """``(q * scale) H`` in float32 (undoing the rotation; no rotation when ``group`` is None), cast to ``dtype``."""
    s = scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float().reshape(())
    w = q.float() * s
    return (rotate(w, group) if group else w).to(dtype)


def int_matmul(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """``a @ b_t.T`` of int8 matrices as int32, exact: products summed in float64 are integers below 2^53."""
    return torch.matmul(a.double(), b_t.double().t()).to(torch.int32)


INT_MM_MIN_ROWS = 17     # torch._int_mm on CUDA takes more than 16 rows; fewer are padded with zero rows


def int_mm(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """``a @ b_t.T`` of int8 matrices as int32 through ``torch._int_mm`` (int8 tensor cores on a GPU; int32 sums,
    exact for K < 2^17); K and N multiples of 8."""
    m = a.shape[0]
    if m < INT_MM_MIN_ROWS:
        a = torch.cat([a, a.new_zeros(INT_MM_MIN_ROWS + 15 - m, a.shape[1])])   # 32 rows
    return torch._int_mm(a.contiguous(), b_t.t())[:m]


@selftests.guard
def int_mm_selftest(device) -> tuple[bool, str]:
    """Whether ``int_mm`` runs on ``device`` and equals the exact product (few and many rows); (ok, why not)."""
    g = torch.Generator().manual_seed(0)
    for m in (5, 40):
        a = torch.randint(-128, 128, (m, 64), generator=g, dtype=torch.int8)
        b = torch.randint(-128, 128, (48, 64), generator=g, dtype=torch.int8)
        if not torch.equal(int_mm(a.to(device), b.to(device)).cpu(), int_matmul(a, b)):
            return False, f"its product for {m} rows differs from the exact one"
    return True, ""


def int_mm_usable(device) -> bool:
    """``int_mm_selftest`` once per device (the self-test memo); a failure is logged once with its reason."""
    first = selftests.status("int8_int_mm", device) is None
    ok, why = selftests.run("int8_int_mm", device, check=lambda _variant, dev: int_mm_selftest(dev))
    if first and not ok:
        log.warning("[SeedVR2-BW] INT8 on %s: torch._int_mm not used (%s); the float64 integer product runs instead "
                    "(same results, slower)", torch.device(device), why)
    return ok


def int8_linear_fused(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                      group: int) -> torch.Tensor:
    """``int8_linear`` for bf16 / fp16 ``x`` through the Triton kernels and ``int_mm``, output in x's dtype: equal
    to it wherever the kernel's codes equal ``quantize_rows(rotate(x))`` (see the module docstring)."""
    xq, sx = int8_kernels.rotate_quantize(x, hadamard(group, x.device, x.dtype))
    return int8_kernels.rescale(int_mm(xq, q.to(x.device)), sx, scale, bias, x.dtype)


@selftests.guard
def fused_selftest(device, dtype=torch.bfloat16, group: int = 256) -> tuple[bool, str]:
    """Whether ``int8_linear_fused`` runs on ``device`` and agrees with the CPU reference (few and many rows, bias,
    each tile configuration): codes within one of ``quantize_rows(rotate(x))`` (at most 1 % of them off), scales
    within a bf16 step, and the output equal bit for bit to ``dequantize_product`` of the kernel's own codes."""
    g = torch.Generator().manual_seed(0)
    q, s = quantize_int8_convrot(torch.randn(48, 2 * group, generator=g), group)
    bias = torch.randn(48, generator=g).to(dtype)
    h = hadamard(group, device, dtype)
    for m in (5, 40):
        x = torch.randn(m, 2 * group, generator=g).to(dtype)
        rq, rs = quantize_rows(rotate(x, group))
        for config in int8_kernels.ROTATE_QUANT_CONFIGS + (None,):      # None: the one int8_linear_fused takes
            xq, sx = (t.cpu() for t in int8_kernels.rotate_quantize(x.to(device), h, config))
            off = (xq.int() - rq.int()).abs()
            if off.max() > 1 or (off > 0).float().mean() > 0.01:
                return False, f"its int8 codes for {m} rows differ from the reference's (by up to {off.max().item()})"
            if not torch.allclose(sx, rs, rtol=2 ** -7, atol=0):
                return False, f"its scales for {m} rows differ from the reference's"
        want = dequantize_product(int_matmul(xq, q), sx, s, bias, dtype)
        got = int8_linear_fused(x.to(device), q.to(device), s.to(device), bias.to(device), group).cpu()
        if not torch.equal(got, want):
            return False, f"its output for {m} rows differs from the rescaled product of its own codes"
    return True, ""


def fused_usable(device, dtype, group) -> tuple[bool, str]:
    """Whether the fused kernels take this layer's activations on ``device``: (ok, why not). The self-test runs
    once per device, dtype and group; a failure is logged once with its reason."""
    why = int8_kernels.fusable(dtype, group)
    if why:
        return False, why
    variant = f"{dtype}/{group}"
    first = selftests.status("int8_fused", device, variant) is None
    ok, why = selftests.run("int8_fused", device, variant,
                            check=lambda _variant, dev: fused_selftest(dev, dtype, group))
    if first and not ok:
        log.warning("[SeedVR2-BW] INT8 on %s: fused Triton kernels not used for %s (%s); the rotation, quantization "
                    "and rescale run as torch ops instead", torch.device(device), variant, why)
    return ok, "" if ok else f"failed their self-test: {why}"


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                group: int | None, out_dtype=None, matmul=int_matmul) -> torch.Tensor:
    """The ConvRot int8 linear of the module docstring for a 2-D ``x``; output in ``out_dtype`` (x's by default).
    ``matmul``: ``int_matmul`` (the reference) or ``int_mm``; both give the same int32 sums, so the same output."""
    out_dtype = out_dtype or x.dtype
    if group:
        x = rotate(x, group)
    xq, sx = quantize_rows(x)
    return dequantize_product(matmul(xq, q.to(x.device)), sx, scale, bias, out_dtype)


def dequantize_product(acc: torch.Tensor, sx: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                       out_dtype) -> torch.Tensor:
    """The int32 product ``acc`` [M, N] -> ``(acc * (s_x * s_w)).to(out_dtype) + bias``, each step as
    comfy-kitchen's ``int8_linear`` takes it (float32 scales, the bias added in the output dtype)."""
    sw = scale.to(device=acc.device, dtype=torch.float32).reshape(1, -1)
    y = (acc.float() * (sx * sw)).to(out_dtype)
    return y if bias is None else y + bias.to(device=y.device, dtype=y.dtype).reshape(1, -1)


class Int8Linear(torch.nn.Module):
    """nn.Linear replacement holding an int8 weight under ComfyUI's keys (``weight``, ``weight_scale``,
    ``comfy_quant``); ``convrot_group`` is the ConvRot group size (None: plain per-tensor / per-channel int8)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=torch.bfloat16,
                 convrot_group: int | None = 256, path: str = "auto"):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros((out_features, in_features), dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.ones((out_features, 1), dtype=torch.float32, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device),
                                       requires_grad=False) if bias else None
        self.convrot_group = convrot_group
        self.path = path

    @classmethod
    def from_int8(cls, q: torch.Tensor, scale: torch.Tensor, bias=None, convrot_group: int | None = 256,
                  dtype=torch.bfloat16, path: str = "auto") -> "Int8Linear":
        n, k = q.shape
        if q.dtype != torch.int8:
            raise ValueError(f"INT8 weight must be int8, got {q.dtype}")
        if scale.numel() not in (1, n):
            raise ValueError(f"INT8 weight_scale must be a scalar or one per output channel ({n}), "
                             f"got shape {tuple(scale.shape)}")
        if convrot_group and (k % convrot_group or scale.numel() != n):
            raise ValueError(f"ConvRot needs per-channel scales and K ({k}) divisible by its group ({convrot_group})")
        if convrot_group:
            hadamard(convrot_group)       # a group size that is no power of 4 fails here, at load
        m = cls(k, n, bias=bias is not None, device="meta", dtype=dtype, convrot_group=convrot_group, path=path)
        m.weight = q
        m.weight_scale = scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float().reshape(())
        if bias is not None:
            m.bias = torch.nn.Parameter(bias.detach().to(dtype).to(q.device), requires_grad=False)
        return m

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, convrot_group: int = 256, dtype=None) -> "Int8Linear":
        q, s = quantize_int8_convrot(linear.weight.detach(), convrot_group)
        return cls.from_int8(q, s, linear.bias, convrot_group, dtype=dtype or linear.weight.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"convrot_group={self.convrot_group}")

    def weight_nbytes(self) -> int:
        return self.weight.numel() + self.weight_scale.numel() * 4

    def conf(self) -> dict:
        c = {"format": INT8_FORMAT}
        if self.convrot_group:
            c.update(convrot=True, convrot_groupsize=self.convrot_group)
        return c

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "comfy_quant"] = comfy_quant_tensor(self.conf())

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        state_dict.pop(prefix + "comfy_quant", None)
        ws = state_dict.get(prefix + "weight_scale")
        if ws is not None and ws.shape != self.weight_scale.shape:
            self.weight_scale = torch.empty_like(ws, dtype=torch.float32, device=self.weight_scale.device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def dequantize_weight(self, dtype=torch.float32) -> torch.Tensor:
        return dequantize_int8(self.weight, self.weight_scale, self.convrot_group, dtype)

    def decision(self, x2: torch.Tensor) -> dispatch.Decision:
        site = dispatch.Site(cuda=x2.is_cuda, triton=launch.triton_usable(x2),
                             dims8=self.in_features % 8 == 0 and self.out_features % 8 == 0,
                             int_mm=lambda: int_mm_usable(x2.device),
                             int8_fused=lambda: fused_usable(x2.device, x2.dtype, self.convrot_group))
        d = dispatch.decide("int8", self.path, x2.shape[0], site)
        if (d.kernel, x2.device.type) not in _ANNOUNCED:
            _ANNOUNCED.add((d.kernel, x2.device.type))
            log.info("%s", d.line("INT8", x2.shape[0]))
        return d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        d = self.decision(x2)
        if d.kernel == "int8_int_mm":
            y = int8_linear_fused(x2, self.weight, self.weight_scale, self.bias, self.convrot_group)
        else:
            y = int8_linear(x2, self.weight, self.weight_scale, self.bias, self.convrot_group,
                            matmul=int_mm if d.kernel == "int8_int_mm_eager" else int_matmul)
        return y.reshape(*shape[:-1], self.out_features)
