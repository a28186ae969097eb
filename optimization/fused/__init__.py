"""Fused elementwise kernels (Triton) for the SeedVR2 DiT hot path, with dispatch.

The model calls the wrappers in ``models/seedvr2/dit`` (``norm_modulate_in`` ...); they ask
:func:`enabled` whether the fused path may run for their tensors and otherwise keep their exact torch
code. ``enabled`` is true only for CUDA tensors in bf16/fp16 when Triton imports, ``SEEDVR2BW_FUSED`` is
not ``0`` and a one-time self-test on that device (each kernel against :mod:`.reference` on small
random inputs) passed. CPU and fp32 never take the fused path.

Byte counts per call (N tokens x D features, bf16 = 2 bytes; 7B 720p x 21 frames: N = 21600, D = 3072,
one N x D pass = 133 MB = 44 us at 3 TB/s):

* ``norm_modulate``: read x, write y: 2 passes (torch path: ~5) -> ~90 us.
* ``residual_norm_modulate``: read res, o; write x, y: 4 passes (torch: gated add 3 + norm/mod 5).
* ``gated_residual``: read res, x; write out: 3 passes (torch addcmul is already one pass).
* ``qkv_norm_rope_pack``: read qkv (3 passes), write q, k, v packed (3 passes) = 6 passes ~270 us (v1, one
  program per token with stride-2 pair loads/stores, measured 3.9 ms on H100; v2, contiguous head rows +
  partner re-read, not yet timed on a GPU: the self-test times both once per device and keeps the faster); the torch
  path runs the q/k norms (~4 passes each), RoPE in fp32 complex (~4 each), the packing scatter (6)
  and the attention backend's ``.contiguous()`` copies of the strided q/k/v.
* ``silu_mul`` (3B SwiGLU): read a, b; write out (torch: 5 passes of the hidden size).
* ``linear_gelu`` (7B MLP): cuBLASLt GELU(tanh)+bias epilogue, saves the 2 passes over N x 4D of F.gelu.
* ``group_norm_frames`` (VAE): per-frame GroupNorm + SiLU: read x twice, write y once, with one program per
  (channel plane, 4096 values) instead of torch's one per (frame, group), which left the H100 mostly idle at
  720p (58 % of a decode's GPU time; docs/PERFORMANCE.md §8). On channels-last 3-D activations three kernels:
  moments (read x), the group statistics (a few floats), apply (read x, write y); a producing conv's bias may be
  added as x is read (``in_bias``).
* ``residual_bias`` (VAE ResNet): h + bias + x (+ x's own bias) in one pass: read h, x; write h (torch: 2-3 adds);
  the same pass takes the sum's GroupNorm moments for the norm that reads it next (which then reads it once).
* ``bias_add_`` (VAE convs whose bias cannot fold): read y, write y, at the copy rate (torch's broadcast add on
  NDHWC: about 1.3 TB/s).
* ``softmax_split`` (VAE mid-block attention, one head of 512: ``optimization/attention/wide_head.py``): read the
  fp32 scores twice, write the softmax numerator as two 16-bit parts.
* ``depth_to_space`` (VAE upsampler): the rearrangement plus the 1 x 1 conv's bias: read y, write the conv's input
  (torch: a bias add and a strided 8-D copy at about 1 TB/s).
* ``conv1x1_depth_to_space``, ``shortcut_residual`` (VAE 1 x 1 convs, ``gemm_kernels``, ``gemm_epilogues``): one
  Triton GEMM whose epilogue writes the depth-to-space into the next conv's input, or adds the residual and takes
  the sum's moments: the conv's output is neither written nor read back (cuBLAS then a pass: 2 passes more).
"""
from __future__ import annotations

import logging
import math
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..runtime import device_cache, knobs, selftests
from . import reference

log = logging.getLogger(__name__)

_HALF = (torch.bfloat16, torch.float16)
_sid_cache: Dict[tuple, torch.Tensor] = device_cache.cache()
_kernels = None
_vae_kernels = None
_stream_kernels = None
_gemm_kernels = None
_import_error: Optional[str] = None


def _load():
    """The DiT's kernel module (``kernels``), None without Triton; ``_vae()`` is the VAE's, ``_streamed()`` its
    streamed conv's and ``_gemm()`` its 1 x 1 convs', loaded with it."""
    global _kernels, _vae_kernels, _stream_kernels, _gemm_kernels, _import_error
    if _kernels is None and _import_error is None:
        try:
            from . import gemm_kernels as gk, kernels as k, stream_kernels as sk, vae_kernels as vk
            _kernels, _vae_kernels, _stream_kernels, _gemm_kernels = k, vk, sk, gk
        except Exception as exc:  # noqa: BLE001 - no Triton: torch path
            _import_error = f"{type(exc).__name__}: {exc}"
    return _kernels


def _vae():
    _load()
    return _vae_kernels


def _streamed():
    _load()
    return _stream_kernels


def _gemm():
    _load()
    return _gemm_kernels


def triton_available() -> bool:
    return _load() is not None


def enabled(*tensors: torch.Tensor) -> bool:
    """True when the fused kernels may run on these tensors (see module doc)."""
    x = tensors[0]
    if not x.is_cuda or x.dtype not in _HALF or not knobs.get("FUSED"):
        return False
    if any(t.device != x.device for t in tensors[1:]):
        return False
    if _load() is None:
        return False
    return selftest(x.device)[0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def selftest(device, tol: float = 1e-2) -> Tuple[bool, str]:
    """Run each kernel once on small random inputs against the torch reference (once per device)."""
    return selftests.run("fused", device, check=lambda _variant, dev: _check(dev, tol))


def _check(device, tol) -> Tuple[bool, str]:
    k = _load()
    if k is None:
        res = (False, f"triton unavailable: {_import_error}")
    else:
        res = selftests.guard(check_kernels)(k, _vae(), device, tol)
    if not res[0]:
        log.warning("seedvr2 fused kernels disabled on %s: %s", device, res[1])
    return res


def check_kernels(k, vk, device, tol) -> Tuple[bool, str]:
    """Each kernel of the modules ``k`` (the DiT's) and ``vk`` (the VAE's) on small random inputs against the torch
    reference (the self-test)."""
    g = torch.Generator(device="cpu").manual_seed(1234)
    dt = torch.bfloat16

    def rnd(*shape, dtype=dt, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    errs = {}
    n, d, nb = 37, 320, 2
    x, o = rnd(n, d), rnd(n, d)
    sc, sh, gt = rnd(nb, d, dtype=torch.float32), rnd(nb, d, dtype=torch.float32), rnd(nb, d, dtype=torch.float32)
    sid = torch.randint(0, nb, (n,), generator=g).to(device=device, dtype=torch.int32)
    errs["norm_modulate"] = _rel(k.norm_modulate(x, sc, sh, 1e-5, sid)[1], reference.norm_modulate(x, sc, sh, 1e-5, sid))
    xr, y = k.norm_modulate(x, sc, sh, 1e-5, sid, res_o=o, res_g=gt)
    xr_ref, y_ref = reference.residual_norm_modulate(x, o, gt, sc, sh, 1e-5, sid)
    errs["residual"] = _rel(xr, xr_ref)
    errs["residual_norm_modulate"] = _rel(y, y_ref)
    errs["gated_residual"] = _rel(k.gated_residual(x, o, gt[:1]), reference.gated_residual(x, o, gt[:1]))
    errs["silu_mul"] = _rel(k.silu_mul(x, o), reference.silu_mul(x, o))
    # qkv: 5 heads of 128, 30 rotated pairs, a permuted destination
    h, hd, r2, m = 5, 128, 30, 29
    qkv = rnd(m, 3 * h * hd)
    wq, wk = rnd(hd, scale=0.2) + 1, rnd(hd, scale=0.2) + 1
    ang = torch.rand(m, r2, generator=g) * 6
    cos, sin = ang.cos().to(device), ang.sin().to(device)
    dst = torch.randperm(m + 4, generator=g)[:m].to(device)
    want = torch.full((3, m + 4, h, hd), float("nan"), device=device, dtype=dt)
    reference.qkv_norm_rope_pack(qkv, h, hd, wq, wk, 1e-5, cos, sin, dst, *want)
    passing, notes = [], []
    for variant in QKV_VARIANTS:
        got = torch.full((3, m + 4, h, hd), float("nan"), device=device, dtype=dt)
        try:
            _qkv_call(k, variant, qkv, h, hd, wq, wk, 1e-5, cos, sin, dst, got, None)
            e = max(_rel(got[j][dst], want[j][dst]) for j in range(3))
        except Exception as exc:  # noqa: BLE001 - a variant that does not compile here is left out
            e, notes = float("nan"), notes + [f"qkv {variant}: {type(exc).__name__}"]
        if e <= tol:
            passing.append(variant)
        else:
            notes.append(f"qkv {variant} rel err {e:.2e}")
    if not passing:
        errs["qkv_norm_rope_pack"] = float("nan")
    else:
        errs["qkv_norm_rope_pack"] = 0.0
        _qkv_variant[str(device)] = _pick_qkv_variant(k, passing, device)
        notes.append(f"qkv kernel {_qkv_variant[str(device)]} (passing {passing})")
    # group norm: 2 frames, 4 groups of 2 channels, 70 x 70 = 4900 values per plane (two blocks to combine)
    xg = rnd(1, 8, 2, 70, 70, scale=3.0) + 1.5
    gw, gb = rnd(8, scale=0.3) + 1, rnd(8, scale=0.3)
    errs["group_norm_frames"] = _rel(vk.group_norm_frames(xg, 4, gw, gb, 1e-6, silu=True),
                                     reference.group_norm_frames(xg, 4, gw, gb, 1e-6, silu=True))
    xcl, ib = xg.contiguous(memory_format=torch.channels_last_3d), rnd(8, scale=0.5)
    errs["group_norm_frames_cl"] = _rel(vk.group_norm_frames_cl(xcl, 4, gw, gb, 1e-6, silu=True),
                                        reference.group_norm_frames(xg, 4, gw, gb, 1e-6, silu=True))
    errs["group_norm_frames_cl_in_bias"] = _rel(
        vk.group_norm_frames_cl(xcl, 4, gw, gb, 1e-6, silu=True, in_bias=ib),
        reference.group_norm_frames(xg + ib.view(1, -1, 1, 1, 1), 4, gw, gb, 1e-6, silu=True))
    hr = rnd(1, 8, 2, 70, 70).contiguous(memory_format=torch.channels_last_3d)
    want_r = (hr + ib.view(1, -1, 1, 1, 1)) + xcl
    errs["residual_bias_cl"] = _rel(vk.residual_bias_cl(hr.clone(), xcl, ib), want_r)
    errs["residual_bias_cl_x_bias"] = _rel(vk.residual_bias_cl(hr.clone(), xcl, ib, ib.flip(0)),
                                           want_r + ib.flip(0).view(1, -1, 1, 1, 1))
    yr, mr = vk.residual_bias_cl(hr.clone(), xcl, ib, moments=True)       # the next norm's moments from its pass
    errs["residual_bias_cl_moments"] = max(_rel(yr, want_r), _rel(
        vk.group_norm_frames_cl(yr, 4, gw, gb, 1e-6, silu=True, moments=mr),
        vk.group_norm_frames_cl(yr, 4, gw, gb, 1e-6, silu=True)))
    # into the body of a larger buffer (a conv's input with room for its prefix frame and padding)
    ob = torch.zeros(1, 8, 3, 71, 72, device=device, dtype=dt).contiguous(memory_format=torch.channels_last_3d)
    vk.residual_bias_cl(hr.clone(), xcl, ib, out=ob[:, :, 1:, :70, 1:71])
    errs["residual_bias_cl_out"] = _rel(ob[:, :, 1:, :70, 1:71], want_r) + float(ob[:, :, 0].abs().sum() +
                                                                                ob[:, :, :, 70].abs().sum())
    # depth-to-space with its conv's bias: 2 x 2 spatial, 2 temporal, the first chunk's duplicate frame dropped
    yd, bd = rnd(1, 32, 2, 5, 6).contiguous(memory_format=torch.channels_last_3d), rnd(32)
    want_d = (yd + bd.view(1, -1, 1, 1, 1)).view(1, 2, 2, 2, 4, 2, 5, 6).permute(0, 4, 5, 3, 6, 1, 7, 2)
    want_d = want_d.reshape(1, 4, 4, 10, 12)[:, :, [0, 2, 3]]
    od = torch.empty(1, 4, 3, 10, 12, device=device, dtype=torch.bfloat16).contiguous(
        memory_format=torch.channels_last_3d)
    sc = rnd(5, 300, dtype=torch.float32, scale=4.0)
    hl, l = vk.softmax_split(sc, 0.5, dt)
    e = torch.exp((sc - sc.amax(1, keepdim=True)) * 0.5)
    errs["softmax_split"] = _rel(hl[:, :300].float() + hl[:, 300:].float(), e) + _rel(l, e.sum(1))
    errs["bias_add_cl"] = _rel(vk.bias_add_cl(hr.clone(), ib), hr + ib.view(1, -1, 1, 1, 1))
    errs["depth_to_space_cl"] = _rel(vk.depth_to_space_cl(yd, bd, od, 2, 2, True), want_d)
    # the streamed 3-output conv in two temporal chunks against the causal conv of the whole clip (float32)
    xs, ws, bs = rnd(1, 8, 3, 6, 5).contiguous(memory_format=torch.channels_last_3d), rnd(3, 8, 3, 3, 3), rnd(3)
    y1, st = stream_conv3d(xs[:, :, :2], ws, bs)
    y2, _ = stream_conv3d(xs[:, :, 2:], ws, bs, st, keep=False)
    xe = torch.cat([xs[:, :, :1], xs[:, :, :1], xs], 2).float()
    errs["stream_conv3d"] = _rel(torch.cat([y1, y2], 2),
                                 torch.nn.functional.conv3d(xe, ws.float(), bs.float(), padding=(0, 1, 1)))
    w, bias = rnd(96, d, scale=d ** -0.5), rnd(96, scale=0.1)
    xl = x[:, :d]
    ref = torch.nn.functional.gelu(torch.nn.functional.linear(xl.float(), w.float(), bias.float()), approximate="tanh")
    errs["linear_gelu"] = _rel(linear_gelu(xl, w, bias), ref)
    bad = {n: e for n, e in errs.items() if not (e <= tol)}  # NaN fails too
    if bad:
        return False, "mismatch vs torch reference: " + ", ".join(f"{n} {e:.2e}" for n, e in bad.items() ) + "; " + "; ".join(notes)
    return True, "max rel err {:.1e}; {}".format(max(errs.values()), "; ".join(notes))


QKV_VARIANTS = ("v3", "v2", "v1")  # preference order when they cannot be timed (not CUDA)
_qkv_variant: Dict[str, str] = {}


def _qkv_call(k, variant, qkv, heads, head_dim, wq, wk, eps, cos, sin, dst, out, src):
    if variant == "v1":  # one program per token, stride-2 pair loads/stores
        k.qkv_norm_rope_pack(qkv, heads, head_dim, wq, wk, eps, cos, sin, dst, out[0], out[1], out[2], src)
    else:  # programs (token, q|k|v), contiguous head rows; v2: pair partner re-read through the cache,
        # v3: pairs split / joined in registers
        k.qkv_norm_rope_pack_v2(qkv, heads, head_dim, wq, wk, eps, cos, sin, dst, out, src, split=variant == "v3")


def _pick_qkv_variant(k, passing: List[str], device) -> str:
    """The faster of the passing qkv kernels, timed once on this device at a 7B-like shape (4096 tokens,
    24 heads x 128, 30 rotated pairs; a few ms in all). ``SEEDVR2BW_QKV_KERNEL`` forces one."""
    forced = knobs.get("QKV_KERNEL")
    if forced in passing:
        return forced
    if len(passing) == 1 or device.type != "cuda":
        return passing[0]
    n, h, hd = 4096, 24, 128
    qkv = torch.randn(n, 3 * h * hd, device=device, dtype=torch.bfloat16)
    w = torch.ones(hd, device=device, dtype=torch.bfloat16)
    ang = torch.rand(n, 30, device=device)
    cos, sin = ang.cos(), ang.sin()
    dst = torch.randperm(n, device=device)
    out = torch.empty(3, n, h, hd, device=device, dtype=torch.bfloat16)
    best, best_t = passing[0], float("inf")
    for variant in passing:
        run = lambda: _qkv_call(k, variant, qkv, h, hd, w, w, 1e-5, cos, sin, dst, out, None)  # noqa: E731
        run()
        torch.cuda.synchronize(device)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(5):
            run()
        b.record()
        torch.cuda.synchronize(device)
        t = a.elapsed_time(b)
        if t < best_t:
            best, best_t = variant, t
    return best


# --------------------------------------------------------------------------------------------------
# ops (callers check ``enabled`` first; ``scale``/``shift``/``gate`` are (B, D) fp32 per sample)
# --------------------------------------------------------------------------------------------------
def sample_ids(lens: Sequence[int], device) -> Optional[torch.Tensor]:
    """(sum lens,) int32 sample index of each packed token; None for one sample (cached)."""
    if len(lens) <= 1:
        return None
    key = (tuple(lens), str(device))
    sid = _sid_cache.get(key)
    if sid is None:
        sid = torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32), torch.tensor(list(lens)))
        sid = sid.to(device)
        if len(_sid_cache) > 16:
            _sid_cache.clear()
        _sid_cache[key] = sid
    return sid


def norm_modulate(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float,
                  lens: Sequence[int]) -> torch.Tensor:
    """RMSNorm(x) (fp32 statistics, no weight) * scale + shift, one pass, result in x's dtype."""
    return _load().norm_modulate(x.contiguous(), scale.float().contiguous(), shift.float().contiguous(), eps,
                                 sample_ids(lens, x.device))[1]


def residual_norm_modulate(res: torch.Tensor, o: torch.Tensor, gate: torch.Tensor, scale: torch.Tensor,
                           shift: torch.Tensor, eps: float, lens: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """x = res + o * gate (stored in res's dtype); returns (x, RMSNorm(x) * scale + shift)."""
    return _load().norm_modulate(res.contiguous(), scale.float().contiguous(), shift.float().contiguous(), eps,
                                 sample_ids(lens, res.device), res_o=o.contiguous(), res_g=gate.float().contiguous())


def gated_residual(res: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, lens: Sequence[int]) -> torch.Tensor:
    return _load().gated_residual(res.contiguous(), x.contiguous(), gate.float().contiguous(), sample_ids(lens, res.device))


def qkv_norm_rope_pack(qkv: torch.Tensor, heads: int, head_dim: int, wq: torch.Tensor, wk: torch.Tensor, eps: float,
                       cos: Optional[torch.Tensor], sin: Optional[torch.Tensor], dst: torch.Tensor,
                       out: torch.Tensor, src: Optional[torch.Tensor] = None) -> None:
    """Rows of qkv (N, 3*H*D) -> rows ``dst`` of out (3, N_all, H, D) (q, k, v), q/k RMS-normalised per
    head (weights wq/wk) and rotated by cos/sin[src] ((N, R/2) fp32 per pair; None: no RoPE); v copied.
    ``src`` (default: row i) picks the input row of output row i (the text copies)."""
    dev = str(out.device)
    variant = knobs.get("QKV_KERNEL") or _qkv_variant.get(dev, QKV_VARIANTS[0])
    _qkv_call(_load(), variant, qkv.contiguous(), heads, head_dim, wq.contiguous(), wk.contiguous(), eps,
              cos, sin, dst, out, src)


def silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _load().silu_mul(a.contiguous(), b.contiguous())


def group_norm_frames(x: torch.Tensor, norm: torch.nn.GroupNorm, silu: bool,
                      out: Optional[torch.Tensor] = None, combine=None,
                      in_bias: Optional[torch.Tensor] = None, head: int = 0,
                      keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """GroupNorm ``norm`` of every frame of x (B, C, T, H, W) on its own, then SiLU if ``silu``; the output keeps
    x's layout when that is channels-last 3-D (the VAE's NDHWC path), else it is contiguous. ``out`` (x's shape):
    written and returned; the channels-last kernel writes an ``out`` whose channels and row pixels are dense
    directly (frames and rows of a larger buffer), other cases copy into it. ``combine``: x is a band of each
    frame's rows, and ``combine`` merges the bands' statistics (``vae_kernels.group_norm_frames_cl``; channels-last
    only, see ``channels_last``). ``in_bias`` (C,): the norm of x + in_bias (the producing conv's bias, which the
    channels-last kernels add as they read; elsewhere it is added first). ``head``, ``keep``: the output's other
    copies in a causal conv's input (``fill_edges``), written as the output is where the kernels can."""
    vk = _vae()
    if channels_last(x):
        moments = _known_moments(x) if in_bias is None else None
        direct = out is not None and out.dtype == x.dtype and _dense_rows(out)
        if direct and (keep is None or _dense_rows(keep)):
            return vk.group_norm_frames_cl(x, norm.num_groups, norm.weight, norm.bias, norm.eps, silu, out=out,
                                          combine=combine, in_bias=in_bias, head=head, keep=keep, moments=moments)
        y = vk.group_norm_frames_cl(x, norm.num_groups, norm.weight, norm.bias, norm.eps, silu,
                                   out=out if direct else None, combine=combine, in_bias=in_bias, moments=moments)
    elif combine is not None:
        raise ValueError("group_norm_frames: band statistics (combine) need a channels-last 3-D x")
    else:
        if in_bias is not None:
            x = x + per_channel(in_bias, x.ndim)
        y = vk.group_norm_frames(x.contiguous(), norm.num_groups, norm.weight, norm.bias, norm.eps, silu)
    if out is not None:
        if y is not out:
            out.copy_(y)
        return fill_edges(out, head, keep)
    return y


# GroupNorm moments a kernel took of a tensor it wrote (``residual_bias``), for the norm that reads that tensor next:
# id -> (weak reference, the tensor's version counter then, moments). A tensor written in place since, or another
# tensor at the same id, does not match.
_moments: Dict[int, tuple] = {}


def _remember_moments(y: torch.Tensor, moments) -> None:
    key = id(y)
    _moments[key] = (weakref.ref(y, lambda _ref: _moments.pop(key, None)), y._version, moments)


def _known_moments(x: torch.Tensor):
    hit = _moments.get(id(x))
    if hit is None or hit[0]() is not x or hit[1] != x._version:
        return None
    return hit[2]


def fill_edges(out: torch.Tensor, head: int = 0, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The other copies of ``out`` (B, C, T, H, W), the body of a causal conv's input (``CausalConv3d.edges``):
    its first frame into the ``head`` frames in front of it in its storage (at its frame stride: the first chunk's
    replicated frames) and its last keep.shape[2] frames into ``keep`` (what the next chunk prepends). The kernels
    write them as they write ``out``; this is the same for the other paths, after ``out`` is written."""
    if head:
        full = out.as_strided((out.shape[0], out.shape[1], out.shape[2] + head, *out.shape[3:]), out.stride(),
                              out.storage_offset() - head * out.stride(2))
        full[:, :, :head].copy_(out[:, :, :1].expand(-1, -1, head, -1, -1))
    if keep is not None:
        keep.copy_(out[:, :, out.shape[2] - keep.shape[2]:])
    return out


def per_channel(bias: torch.Tensor, ndim: int) -> torch.Tensor:
    """A (C,) bias viewed to broadcast over dim 1 of an ``ndim``-dimensional activation."""
    return bias.view(1, -1, *([1] * (ndim - 2)))


def residual_bias(h: torch.Tensor, x: torch.Tensor, bias: torch.Tensor,
                  x_bias: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """h + bias + x (per channel of dim 1), written into h, or into ``out`` (h's shape, any layout: e.g. the body of
    the next conv's padded input, ``CausalConv3d.input_buffer``), and returned; ``x_bias``: x lacks its conv's bias,
    added to x first. One pass (``vae_kernels.residual_bias_cl``) where both are dense channels-last 3-D of one shape,
    ``out`` has dense rows and the kernels are enabled, else torch adds (rounded at the same places)."""
    dense_out = out is None or (out.dtype == h.dtype and _dense_rows(out))
    if enabled(h, x, bias) and h.shape == x.shape and channels_last(h) and channels_last(x) and dense_out:
        if out is not None:
            return _vae().residual_bias_cl(h, x, bias, x_bias, out)
        # the same pass takes the sum's GroupNorm moments: the norm that reads it next skips its own pass
        y, moments = _vae().residual_bias_cl(h, x, bias, x_bias, moments=True)
        _remember_moments(y, moments)
        return y
    if x_bias is not None:      # (a float32 x_bias: the sum rounded to x's dtype, as the kernel rounds it)
        x = (x + per_channel(x_bias, x.ndim)).to(x.dtype)
    h = h.add_(per_channel(bias, h.ndim)).add_(x)
    return h if out is None else out.copy_(h)


def bias_add_(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """y + bias (per channel of dim 1), written into y and returned: one pass (``vae_kernels.bias_add_cl``) where y is
    dense channels-last 3-D and the kernels are enabled (a convolution's bias there: cuDNN on NDHWC leaves it to
    torch's broadcast add, which is slow on that layout), else torch's add."""
    if enabled(y, bias) and channels_last(y):
        return _vae().bias_add_cl(y, bias)
    return y.add_(per_channel(bias, y.ndim))


def gemm_epilogues(x: torch.Tensor) -> bool:
    """Whether the VAE's 1 x 1 convs on x run as Triton GEMMs with what reads their outputs as the epilogue
    (``gemm_kernels``: the upsamplers' depth-to-space, the ResNet shortcut's residual add): the fused kernels
    enabled, ``SEEDVR2BW_VAE_GEMM_EPILOGUE`` on, and these kernels' own self-test passed on x's device (one that does
    not compile there turns off only them)."""
    if not (knobs.get("VAE_GEMM_EPILOGUE") and enabled(x)):
        return False
    return selftests.run("fused_gemm", x.device, check=lambda _variant, dev: _check_gemm(dev))[0]


def _gemm_errors(device, tol) -> Tuple[bool, str]:
    errs = _gemm().selftest_errors(device, _gemm().tile_for(device))
    bad = {n: e for n, e in errs.items() if not (e <= tol)}      # NaN fails too
    if bad:
        return False, "mismatch vs torch: " + ", ".join(f"{n} {e:.2e}" for n, e in bad.items())
    return True, "max rel err {:.1e}".format(max(errs.values()))


def _check_gemm(device, tol: float = 1e-2) -> Tuple[bool, str]:
    res = selftests.guard(_gemm_errors)(device, tol)
    if not res[0]:
        log.warning("seedvr2 VAE 1x1 conv GEMM kernels disabled on %s: %s", device, res[1])
    return res


def depth_to_space(y: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor, s: int, rt: int,
                   drop: bool, head: int = 0, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The upsampler's depth-to-space of y (B, s*s*rt*C, T, H, W) (+ ``bias`` per channel of y, which lacks its
    conv's bias) into ``out`` (B, C, T*rt - drop, H*s, W*s), channels-last 3-D both: channel ((sx*s + sy)*rt +
    st)*C + c of pixel (t, h, w) goes to frame t*rt + st, pixel (h*s + sx, w*s + sy); ``drop``: the first chunk's
    duplicate frame 1 is not written. ``head``, ``keep``: ``fill_edges``. One pass where the kernels are enabled
    (``vae_kernels.depth_to_space_cl``), else torch's add and a strided copy."""
    if enabled(y, out) and channels_last(y) and _dense_rows(out) and (keep is None or _dense_rows(keep)):
        return _vae().depth_to_space_cl(y, bias, out, s, rt, drop, head, keep)
    if bias is not None:
        y = y + per_channel(bias, y.ndim)
    b, cr, t, h, w = y.shape
    c = cr // (s * s * rt)
    src = y.view(b, s, s, rt, c, t, h, w).permute(0, 5, 3, 6, 1, 7, 2, 4)   # b, t, st, h, sx, w, sy, c
    dst = out.permute(0, 2, 3, 4, 1)                                          # b, T, H, W, c
    if drop:
        dst[:, :1].copy_(src[:, 0, 0].reshape(b, 1, h * s, w * s, c))
        dst[:, 1:].view(b, t - 1, rt, h, s, w, s, c).copy_(src[:, 1:])
    else:
        dst.view(b, t, rt, h, s, w, s, c).copy_(src)
    return fill_edges(out, head, keep)


def conv1x1_depth_to_space(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor,
                           s: int, rt: int, drop: bool, head: int = 0, keep: Optional[torch.Tensor] = None,
                           late_bias: bool = True) -> torch.Tensor:
    """The upsampler's 1 x 1 conv of x (B, CIN, T, H, W) (``weight`` (s*s*rt*C, CIN, 1, 1, 1), ``bias``) and its
    ``depth_to_space`` into ``out`` (which adds the bias when ``late_bias``: cuDNN on NDHWC adds it in a pass of its
    own). The conv's output lives only here: it is freed before the conv that reads ``out`` runs (1.8 GiB off a 720p
    decode's peak)."""
    n, cin = weight.shape[:2]
    if (gemm_epilogues(x) and x.is_contiguous(memory_format=torch.channels_last_3d) and _dense_rows(out)
            and (keep is None or _dense_rows(keep)) and weight.is_contiguous()):
        gk = _gemm()
        tile = gk.tile_for(x.device)
        if gk.fits(cin, n // (s * s * rt), tile):      # one kernel, the bias added to the float32 accumulator
            return gk.conv1x1_d2s(x, weight.view(n, cin), bias, out, s, rt, drop, head, keep, tile)
    y = torch.nn.functional.conv3d(x, weight, None if late_bias else bias)
    y = y.contiguous(memory_format=torch.channels_last_3d)
    return depth_to_space(y, bias if late_bias else None, out, s, rt, drop, head, keep)


def shortcut_residual(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, x_bias: torch.Tensor,
                      bias: torch.Tensor) -> Optional[torch.Tensor]:
    """h + ``bias`` + (the 1 x 1 conv ``weight`` of x + ``x_bias``), written into h with the sum's GroupNorm moments
    remembered (``residual_bias``), as one GEMM whose epilogue adds (``gemm_kernels.shortcut_residual``): the ResNet
    block's output where the width changes, without the shortcut's output in memory. None where that kernel does
    not run (the caller takes the conv and ``residual_bias``)."""
    cl = torch.channels_last_3d
    c, cin = weight.shape[:2]
    if not (gemm_epilogues(x) and x.is_contiguous(memory_format=cl) and h.is_contiguous(memory_format=cl)
            and h.dtype == x.dtype and weight.is_contiguous() and h.shape[2:] == x.shape[2:]):
        return None
    gk = _gemm()
    tile = gk.tile_for(x.device)
    if not gk.fits(cin, c, tile):
        return None
    y, moments = gk.shortcut_residual(h, x, weight.view(c, cin), x_bias, bias, tile)
    _remember_moments(y, moments)
    return y


def mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in float32 from 16-bit inputs (cuBLAS writes its float32 accumulator; elsewhere the exact products of
    the 16-bit values are summed in float32 too)."""
    if a.is_cuda:
        return torch.bmm(a[None], b[None], out_dtype=torch.float32)[0]
    return a.float() @ b.float()


def stream_conv3d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  state: Optional[Tuple[torch.Tensor, ...]] = None, keep: bool = True, max_bytes: float = math.inf,
                  norm: Optional[torch.nn.GroupNorm] = None
                  ) -> Tuple[torch.Tensor, Optional[Tuple[torch.Tensor, ...]]]:
    """A causal conv (``weight`` (O, C, 3, 3, 3), a few outputs O; stride 1, zero padding 1 in H and W) of x (B, C, T,
    H, W), dense channels-last 3-D, one input frame at a time: a GEMM gives the frame's per-tap products in float32
    (27*O planes) and ``stream_kernels.stream_taps`` sums them into the output (+ ``bias``, rounded once) and a float32
    state of 2*O planes, which carries the taps the next frames need: ``state`` is the previous temporal chunk's (one
    per sample), None at the clip's first frame (replicated in front as the causal conv does). The planes of a frame
    are made in bands of rows of at most ``max_bytes`` (each with the row above and below it). Returns (y in x's
    layout, the state for the next chunk, or None when not ``keep``). cuDNN's conv to 3 channels runs 4x longer than
    reading its input (``stream_kernels``). ``norm`` (affine): the conv reads SiLU(norm(x)), applied as the GEMM
    loads x (``stream_kernels.norm_planes``; the moments a kernel took of x as it wrote it are used): no normalised
    copy."""
    vk, sk = _vae(), _streamed()
    b, c, t, h, w = x.shape
    o = weight.shape[0]
    taps = weight.permute(2, 3, 4, 0, 1).reshape(27 * o, c)           # rows (a, i, j, o)
    if norm is not None:
        mean, rstd = vk.group_norm_stats_cl(x, norm.num_groups, norm.eps, moments=_known_moments(x))
        taps_t = sk.padded_taps(taps)
    y = torch.empty((b, o, t, h, w), device=x.device, dtype=x.dtype, memory_format=torch.channels_last_3d)
    frames, out = x.permute(0, 2, 3, 4, 1), y.permute(0, 2, 3, 4, 1)  # (B, T, H, W, C): a frame is (H*W, C)
    per_row = 27 * o * 4 * w                                          # planes of one input row
    band = h if max_bytes >= (h + 2) * per_row else max(1, int(max_bytes // per_row) - 2)   # output rows a band
    states = []
    for i in range(b):
        s = None if state is None else state[i]
        for f in range(t):
            new = torch.empty((2, o, h * w), device=x.device, dtype=torch.float32) if keep or f + 1 < t else None
            for r0 in range(0, h, band):
                r1 = min(h, r0 + band)
                q0, q1 = max(r0 - 1, 0), min(r1 + 1, h)
                rows = frames[i, f, q0:q1].reshape((q1 - q0) * w, c)
                if norm is not None:
                    planes = sk.norm_planes(rows, mean, rstd, norm.weight, norm.bias, taps_t, 27 * o, i * t + f, t,
                                            norm.num_groups, silu=True)
                else:
                    planes = mm32(taps, rows.t())
                sk.stream_taps(planes, s, new, bias, out[i, f], h, w, q0, (r0, r1))
                del planes
            s = new
        states.append(s)
    return y, (tuple(states) if keep else None)


def softmax_split(s: torch.Tensor, scale: float, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """The softmax numerator of the scores s (rows, N) float32 as two ``dtype`` parts and its row sums
    (``vae_kernels.softmax_split``); the caller checks ``enabled``."""
    return _vae().softmax_split(s.contiguous(), scale, dtype)


def _dense_rows(t: torch.Tensor) -> bool:
    """Channels and a row's pixels dense (B, C, T, H, W): what the channels-last kernels' strided outputs take."""
    return t.stride(1) == 1 and t.stride(4) == t.shape[1]


def channels_last(x: torch.Tensor) -> bool:
    """x is stored channels-last 3-D (and not also plain contiguous, as a one-channel or one-pixel tensor is)."""
    return not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last_3d)


def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x @ W^T + b) with the GELU in the cuBLASLt epilogue on CUDA (cuBLASLt's GELU is the tanh
    form; should torch take its non-Lt path it applies GELU after the GEMM; either is within bf16 rounding
    of gelu_tanh, the self-test checks it). Elsewhere, or with SEEDVR2BW_FUSED_GELU=off: linear + gelu_tanh."""
    if not x.is_cuda or not knobs.get("FUSED_GELU"):
        return torch.nn.functional.gelu(torch.nn.functional.linear(x, weight, bias), approximate="tanh")
    shp = x.shape
    out = torch._addmm_activation(bias, x.reshape(-1, shp[-1]), weight.t(), use_gelu=True)
    return out.view(*shp[:-1], weight.shape[0])
