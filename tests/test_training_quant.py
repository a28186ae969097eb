"""training/quant.py on the pack's formats: the frozen-base weights are exactly what ``optimization.nvfp4.format``
produces, forward / input gradient use the pack's dequantization (the Triton kernel through the interpreter,
bit-identical to the torch reference), no weight gradient, and ``restore`` gives the Linears back untouched."""
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from seedvr2bw.optimization.nvfp4 import format as fmt
from seedvr2bw.training import quant as Q

ROOT = Path(__file__).resolve().parents[1]
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _dm(dtype=torch.float32, seed=0):
    """Minimal stand-in for FLUX's block lists: Linears with K % 16 == 0, odd N, and one K % 16 != 0."""
    g = torch.Generator().manual_seed(seed)
    dm = torch.nn.Module()
    dm.double_blocks = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.GELU(),
                                                                torch.nn.Linear(48, 32))])
    dm.single_blocks = torch.nn.ModuleList([torch.nn.Linear(32, 40), torch.nn.Linear(20, 16, bias=False)])
    with torch.no_grad():
        for p in dm.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    dm.requires_grad_(False)
    return dm.to(dtype)


def _snapshot(dm):
    return {n: (lin.weight.detach().clone(), None if lin.bias is None else lin.bias.detach().clone(),
                set(lin.__dict__)) for n, lin in Q.block_linears(dm)}


def _check_restored(dm, before):
    for n, lin in Q.block_linears(dm):
        w, b, attrs = before[n]
        assert torch.equal(lin.weight, w) and lin.weight.dtype == w.dtype, n
        assert (b is None and lin.bias is None) or torch.equal(lin.bias, b), n
        assert set(lin.__dict__) == attrs and Q.quantized_weight(lin) is None, n   # no instance attribute left


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_base_uses_pack_format(dtype):
    dm = _dm(dtype)
    before = _snapshot(dm)
    qb = Q.QuantizedBase(dm, "nvfp4")
    names = [n for n, _ in Q.block_linears(dm)]
    assert len(qb.saved) == len(names) - 1       # the K=20 Linear stays in high precision
    g = torch.Generator().manual_seed(1)
    for n, lin in Q.block_linears(dm):
        w0, b0, _ = before[n]
        if w0.shape[1] % 16:
            assert Q.quantized_weight(lin) is None and torch.equal(lin.weight, w0)
            continue
        t, ref = Q.quantized_weight(lin), fmt.quantize_nvfp4(w0, return_tensor=True)
        assert t.shape == ref.shape == tuple(w0.shape)
        assert torch.equal(t.packed, ref.packed)
        assert torch.equal(t.block_scale.view(torch.uint8), ref.block_scale.view(torch.uint8))
        assert torch.equal(t.global_scale, ref.global_scale)
        assert lin.weight.numel() == 0           # high-precision copy offloaded
        w = fmt.dequantize_nvfp4(ref.packed, ref.block_scale, ref.global_scale, dtype, shape=ref.shape)
        x = torch.randn(2, 3, w0.shape[1], generator=g).to(dtype).requires_grad_(True)
        y = lin(x)
        assert torch.equal(y, F.linear(x.detach(), w, None if b0 is None else b0.to(dtype)))
        gy = torch.randn(y.shape, generator=g).to(dtype)
        y.backward(gy)
        assert torch.equal(x.grad, gy @ w)
        assert lin.weight.grad is None and (lin.bias is None or lin.bias.grad is None)
        assert float((w.float() - w0.float()).norm() / w0.float().norm()) < 0.15
    qb.restore()
    _check_restored(dm, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_base_uses_pack_quantizer(dtype):
    dm = _dm(dtype)
    before = _snapshot(dm)
    qb = Q.QuantizedBase(dm, "fp8")
    g = torch.Generator().manual_seed(2)
    assert len(qb.saved) == len(before)
    for n, lin in Q.block_linears(dm):
        w0, b0, _ = before[n]
        q, s = fmt.quantize_fp8_per_tensor(w0)
        lq, ls = Q.quantized_weight(lin)
        assert torch.equal(lq.view(torch.uint8), q.view(torch.uint8)) and torch.equal(ls, s)
        assert Q.uses_fp8_tensorcores(lin) is False           # CPU: the hardware policy has no FP8 GEMM here
        w = q.to(dtype) * s.to(dtype)
        x = torch.randn(5, w0.shape[1], generator=g).to(dtype).requires_grad_(True)
        y = lin(x)
        assert torch.equal(y, F.linear(x.detach(), w, None if b0 is None else b0.to(dtype)))
        gy = torch.randn(y.shape, generator=g).to(dtype)
        y.backward(gy)
        assert torch.equal(x.grad, gy @ w)
        assert lin.weight.grad is None
    qb.restore()
    _check_restored(dm, before)


def test_fp8_tensorcores_follow_hardware_policy(monkeypatch):
    """The FP8 GEMM decision is the policy's (asked once per device), not a capability check of our own."""
    asked = []

    class _P:
        fp8_gemm = True

    def fake_policy(dev):
        asked.append(dev)
        return _P()

    monkeypatch.setattr(Q, "get_policy", fake_policy)
    dm = _dm()
    qb = Q.QuantizedBase(dm, "fp8")
    assert asked == [] and not any(Q.uses_fp8_tensorcores(lin) for lin, _, _ in qb.saved)   # CPU: never asked
    qb.restore()
    assert "get_policy" in Q.__dict__ and not hasattr(Q, "fp8_tensorcores")


needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")


@needs_triton
def test_nvfp4_dequant_through_triton_kernel_interpreted():
    """With Triton usable, training dequantizes with the pack's Triton kernel (run here by the interpreter);
    forward and input gradient are bit-identical to the torch reference."""
    code = textwrap.dedent(f"""
        import os, sys
        os.environ["TRITON_INTERPRET"] = "1"
        sys.path.insert(0, {str(ROOT)!r})
        from pack_import import import_pack
        import_pack()
        import torch
        import torch.nn.functional as F
        from seedvr2bw.optimization.nvfp4 import format as fmt, kernels as K
        from seedvr2bw.training import quant as Q
        calls = []
        orig = K.dequantize_nvfp4_triton
        def spy(*a, **k):
            calls.append(1)
            return orig(*a, **k)
        K.dequantize_nvfp4_triton = spy
        g = torch.Generator().manual_seed(0)
        w0 = torch.randn(40, 64, generator=g) * 0.1
        lin = torch.nn.Linear(64, 40).requires_grad_(False)
        lin.weight.data.copy_(w0)
        dm = torch.nn.Module()
        dm.double_blocks = torch.nn.ModuleList([lin])
        dm.single_blocks = torch.nn.ModuleList([])
        for dtype in (torch.float32, torch.bfloat16):
            lin.to(dtype)
            qb = Q.QuantizedBase(dm, "nvfp4")
            t = Q.quantized_weight(lin)
            assert K.triton_usable(t.packed)
            ref = fmt.dequantize_nvfp4(t.packed, t.block_scale, t.global_scale, dtype, shape=t.shape)
            assert torch.equal(Q.dequantize_weight(t, dtype), ref)
            x = torch.randn(3, 64, generator=g).to(dtype).requires_grad_(True)
            y = lin(x)
            assert torch.equal(y, F.linear(x.detach(), ref, lin.bias.to(dtype)))
            gy = torch.randn(y.shape, generator=g).to(dtype)
            y.backward(gy)
            assert torch.equal(x.grad, gy @ ref)
            qb.restore()
        assert len(calls) == 6, calls
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


def test_nvfp4_dequant_falls_back_when_triton_fails(monkeypatch):
    """A Triton failure on the device (build error, unsupported GPU) degrades to the exact torch reference once,
    with a logged reason, instead of stopping the training run."""
    from seedvr2bw.optimization.nvfp4 import kernels as K

    def boom(*a, **k):
        raise RuntimeError("no kernel image")

    monkeypatch.setattr(Q, "triton_broken", [])
    monkeypatch.setattr(K, "triton_usable", lambda t: True)
    monkeypatch.setattr(K, "dequantize_nvfp4_triton", boom)
    t = fmt.quantize_nvfp4(torch.randn(24, 32), return_tensor=True)
    assert torch.equal(Q.dequantize_weight(t, torch.float32), t.dequantize(torch.float32))
    assert Q.triton_broken and "no kernel image" in Q.triton_broken[0]


@needs_triton
def test_fp8_weight_transpose_kernel_interpreted():
    """The Triton transpose used by the FP8 input gradient equals ``w.t().contiguous()`` bit for bit (ragged
    tile edges included) and refuses what it does not handle."""
    code = textwrap.dedent(f"""
        import os, sys
        os.environ["TRITON_INTERPRET"] = "1"
        sys.path.insert(0, {str(ROOT)!r})
        from pack_import import import_pack
        import_pack()
        import torch
        from seedvr2bw.optimization.nvfp4 import kernels as K
        g = torch.Generator().manual_seed(0)
        for shape in ((64, 64), (70, 130), (1, 5), (129, 63)):
            w = (torch.randn(shape, generator=g) * 50).to(torch.float8_e4m3fn)
            t = K.transpose_2d(w)
            assert t.dtype == w.dtype and t.shape == (shape[1], shape[0])
            assert torch.equal(t.view(torch.uint8), w.t().contiguous().view(torch.uint8)), shape
        try:
            K.transpose_2d(torch.randn(4, 4))
            raise SystemExit("fp32 accepted")
        except ValueError as e:
            assert "1-byte" in str(e)
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


def test_fp8_row_quantization_is_the_inference_one():
    """Training quantizes activations and gradients per token exactly as the NVFP4 FP8 speed path does (the pack's
    one quantizer, ``format.quantize_act_fp8_rowwise_reference`` on CPU, which the Triton kernel reproduces): same
    e4m3 bits and scales. The inputs include values where ``x / s`` and ``x * (1 / s)`` round differently."""
    from seedvr2bw.training import fp8_ops
    g = torch.Generator().manual_seed(0)
    amax = torch.rand(512, generator=g) * 100 + 1
    tie = 1.0625 * amax / fmt.F8_E4M3_MAX   # scaled, it lands on the e4m3 rounding tie between 1 and 1.125
    near = [torch.nextafter(tie, torch.full_like(tie, d)) for d in (0.0, 1e9)]
    x = torch.cat([torch.stack([amax, tie, *near], 1), torch.randn(64, 4, generator=g)])
    x[-1] = 0.0                                   # an all-zero row keeps scale 1
    s = amax / fmt.F8_E4M3_MAX
    divided = (x[:512] / s[:, None]).to(torch.float8_e4m3fn)
    multiplied = (x[:512] * (1.0 / s)[:, None]).to(torch.float8_e4m3fn)
    assert not torch.equal(divided.view(torch.uint8), multiplied.view(torch.uint8))   # the inputs tell them apart
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        q, sc = fp8_ops.quantize_rows(xd)
        rq, rs = fmt.quantize_act_fp8_rowwise_reference(xd)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(sc, rs), dtype
