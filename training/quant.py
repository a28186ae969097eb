"""Low-precision frozen base for LoRA training: fp8 (e4m3) and NVFP4 storage.

The frozen block Linears of the FLUX model get a quantized copy of their weight, and their ``forward`` is
replaced (per instance, undone by ``restore``) by an autograd function that never computes a weight gradient:

* ``fp8``: weight e4m3 with a per-tensor scale. On CUDA sm_89+ the forward (x quantized per tensor to e4m3)
  and the input gradient (grad quantized per tensor to e5m2) run on FP8 tensor cores through
  ``torch._scaled_mm``; elsewhere the weight is dequantized to the compute dtype.
* ``nvfp4``: weight as FP4 e2m1 values with e4m3 scales per 16 inputs and one fp32 global scale; the
  weight is dequantized per call (forward and input gradient) and the GEMM runs in the compute dtype.

The high-precision weight is moved to the CPU while training (so the GPU holds the quantized copy only)
and put back by ``restore``. If ``optimization.nvfp4.linear`` (FP8Linear/NVFP4Linear) is present it is not
needed here: this module is self-contained so training does not depend on its state.
"""
from __future__ import annotations

import types

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = 448.0
E5M2_MAX = 57344.0
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def fp8_tensorcores(device) -> bool:
    if not (isinstance(device, torch.device) and device.type == "cuda") or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


# ---------------- fp8 ----------------
def quantize_fp8(w: torch.Tensor):
    amax = w.detach().abs().amax().float().clamp(min=1e-12)
    scale = (amax / FP8_MAX).reshape(())
    q = (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(E4M3) if w.numel() < (1 << 26) else \
        (w / scale.to(w.dtype)).clamp(-FP8_MAX, FP8_MAX).to(E4M3)
    return q, scale


def _quant_act_eager(x2, fp8_dtype: torch.dtype, maxval: float):
    amax = torch.linalg.vector_norm(x2, ord=float("inf"), dtype=torch.float32).clamp(min=1e-12)
    s = amax / maxval
    return (x2.float() * (1.0 / s)).clamp(-maxval, maxval).to(fp8_dtype), s


_quant_fast = None


def _quant_act(x2, fp8_dtype, maxval):
    """Per-tensor dynamic quantization; on CUDA compiled (fuses the scale/clamp/cast passes)."""
    global _quant_fast
    if x2.device.type != "cuda":
        return _quant_act_eager(x2, fp8_dtype, maxval)
    if _quant_fast is None:
        try:
            _quant_fast = torch.compile(_quant_act_eager, dynamic=None)
        except Exception:  # noqa: BLE001
            _quant_fast = _quant_act_eager
    return _quant_fast(x2, fp8_dtype, maxval)


def _pad16(t):
    m = t.shape[0]
    if m % 16 == 0:
        return t, m
    return torch.nn.functional.pad(t, (0, 0, 0, 16 - m % 16)), m


class _FP8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, wq, wscale, bias, tensorcores):
        ctx.save_for_backward(wq, wscale)
        ctx.tensorcores = tensorcores
        ctx.x_dtype = x.dtype
        K = x.shape[-1]
        x2 = x.reshape(-1, K)
        M = x2.shape[0]
        if tensorcores and (M % 16 == 0 or M < 256):
            xp, M0 = _pad16(x2)
            xq, xs = _quant_act(xp, E4M3, FP8_MAX)
            y = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=wscale,
                                 bias=None if bias is None else bias.to(x.dtype), out_dtype=x.dtype)[:M0]
        else:
            w = wq.to(x.dtype) * wscale.to(x.dtype)
            y = torch.nn.functional.linear(x2, w, None if bias is None else bias.to(x.dtype))
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, g):
        wq, wscale = ctx.saved_tensors
        N = g.shape[-1]
        g2 = g.reshape(-1, N)
        M = g2.shape[0]
        if ctx.tensorcores and (M % 16 == 0 or M < 256):
            gp, M0 = _pad16(g2)
            gq, gs = _quant_act(gp, E5M2, E5M2_MAX)
            wt = wq.t().contiguous()  # [K, N] row-major -> .t() is column-major [N, K] as _scaled_mm wants
            dx = torch._scaled_mm(gq, wt.t(), scale_a=gs, scale_b=wscale, out_dtype=g.dtype)[:M0]
        else:
            w = wq.to(g.dtype) * wscale.to(g.dtype)
            dx = g2 @ w
        return dx.reshape(*g.shape[:-1], dx.shape[-1]).to(ctx.x_dtype), None, None, None, None


def _fp8_forward(self, x):
    return _FP8LinearFn.apply(x, self._q_weight, self._q_scale, self.bias, self._q_tensorcores)


# ---------------- NVFP4 ----------------
def quantize_nvfp4(w: torch.Tensor):
    N, K = w.shape
    if K % 16:
        raise ValueError("NVFP4 needs in_features divisible by 16")
    wf = w.float()
    gscale = (wf.abs().amax().clamp(min=1e-12) / (6.0 * FP8_MAX)).reshape(())
    blocks = wf.view(N, K // 16, 16)
    bs = (blocks.abs().amax(-1) / 6.0 / gscale).clamp(max=FP8_MAX).to(E4M3)
    denom = (bs.float() * gscale).clamp(min=1e-30).unsqueeze(-1)
    scaled = (blocks / denom).clamp(-6, 6)
    vals = torch.tensor(FP4_VALUES, device=w.device)
    mids = (vals[1:] + vals[:-1]) / 2
    idx = torch.bucketize(scaled.abs(), mids).to(torch.uint8)
    codes = idx | ((scaled < 0).to(torch.uint8) << 3)
    codes = codes.view(N, K)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    return packed, bs, gscale


def dequantize_nvfp4(packed, bs, gscale, dtype):
    N = packed.shape[0]
    lut = torch.tensor(FP4_VALUES + tuple(-v for v in FP4_VALUES), device=packed.device, dtype=torch.float32)
    lo = (packed & 0x0F).long()
    hi = (packed >> 4).long()
    codes = torch.stack((lo, hi), dim=-1).view(N, -1)
    v = lut[codes].view(N, -1, 16) * (bs.float() * gscale).unsqueeze(-1)
    return v.view(N, -1).to(dtype)


class _NVFP4LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, packed, bs, gscale, bias):
        ctx.save_for_backward(packed, bs, gscale)
        w = dequantize_nvfp4(packed, bs, gscale, x.dtype)
        return torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx, g):
        packed, bs, gscale = ctx.saved_tensors
        w = dequantize_nvfp4(packed, bs, gscale, g.dtype)
        return g @ w, None, None, None, None


def _nvfp4_forward(self, x):
    return _NVFP4LinearFn.apply(x, self._q_packed, self._q_bs, self._q_gscale, self.bias)


# ---------------- apply / restore ----------------
def block_linears(dm):
    for kind in ("double_blocks", "single_blocks"):
        for i, blk in enumerate(getattr(dm, kind)):
            for name, mod in blk.named_modules():
                if isinstance(mod, torch.nn.Linear):
                    yield f"{kind}.{i}.{name}", mod


class QuantizedBase:
    """Quantizes the frozen block Linears of ``dm`` in place; ``restore()`` undoes it exactly."""

    def __init__(self, dm, mode: str, offload_device="cpu"):
        if mode not in ("fp8", "nvfp4"):
            raise ValueError(f"unknown base precision {mode!r}")
        self.mode = mode
        self.saved = []
        for name, lin in block_linears(dm):
            w = lin.weight
            dev = w.device
            if mode == "nvfp4" and w.shape[1] % 16:
                continue
            with torch.no_grad():
                if mode == "fp8":
                    if w.dtype == E4M3:  # ComfyUI loaded it in fp8 already: use it as stored
                        sw = getattr(lin, "scale_weight", None)
                        q, s = w.data, (sw.float().reshape(()) if sw is not None else torch.ones((), device=dev))
                        moved = None
                    else:
                        q, s = quantize_fp8(w.data)
                        moved = w.data.to(offload_device)
                    lin._q_weight, lin._q_scale = q, s.to(dev)
                    lin._q_tensorcores = fp8_tensorcores(dev)
                    lin.forward = types.MethodType(_fp8_forward, lin)
                else:
                    src = w.data if w.dtype not in (E4M3, E5M2) else w.data.float() * (
                        getattr(lin, "scale_weight", torch.ones(())).float().to(dev))
                    lin._q_packed, lin._q_bs, lin._q_gscale = quantize_nvfp4(src)
                    moved = w.data.to(offload_device)
                    lin.forward = types.MethodType(_nvfp4_forward, lin)
                if moved is not None:
                    w.data = torch.empty(0, dtype=w.dtype, device=dev)
            self.saved.append((lin, moved, dev))

    def restore(self):
        for lin, moved, dev in self.saved:
            if moved is not None:
                lin.weight.data = moved.to(dev)
            for a in ("_q_weight", "_q_scale", "_q_tensorcores", "_q_packed", "_q_bs", "_q_gscale", "forward"):
                if a in lin.__dict__:
                    del lin.__dict__[a]
        self.saved = []
