"""torch.ops.seedvr2bw.lora_linear (training/lora_linear_op.py): value and gradients equal the plain formula
y = x @ W.T + bias + scale * (x @ down) @ up, with and without bias, and no gradient for the frozen base."""
import importlib

import pytest
import torch

from pack_import import import_pack
from seedvr2bw.training.lora_linear_op import lora_linear


@pytest.mark.parametrize("bias,scale,x_grad", [(True, 0.5, True), (False, 2.0, True), (True, 1.0, False)])
def test_value_and_grads_match_plain_formula(bias, scale, x_grad):
    g = torch.Generator().manual_seed(0)
    m, k, n, r = 7, 24, 10, 3
    x = torch.randn(m, k, generator=g, dtype=torch.float64, requires_grad=x_grad)
    w = torch.randn(n, k, generator=g, dtype=torch.float64)
    b = torch.randn(n, generator=g, dtype=torch.float64) if bias else None
    d = torch.randn(k, r, generator=g, dtype=torch.float64, requires_grad=True)
    u = torch.randn(r, n, generator=g, dtype=torch.float64, requires_grad=True)
    gy = torch.randn(m, n, generator=g, dtype=torch.float64)
    y, h = lora_linear(x, w, b, d, u, scale)
    ref = x @ w.t() + scale * (x @ d) @ u + (b if bias else 0)
    assert torch.allclose(y, ref, rtol=1e-12, atol=1e-12) and torch.allclose(h, x @ d)
    ins = [t for t in (x, d, u) if t.requires_grad]
    got = torch.autograd.grad(y, ins, gy)
    want = torch.autograd.grad(ref, ins, gy)
    for a, e in zip(got, want):
        assert torch.allclose(a, e, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda d_, u_: lora_linear(x.detach(), w, b, d_, u_, scale)[0], (d, u))


def test_second_import_reuses_the_operator():
    """ComfyUI imports the pack by its folder name, the tests as ``seedvr2bw``: a second import of the file must
    not define the operator again (that leaves the first import's op calling a freed C++ handle: std::bad_alloc)."""
    from seedvr2bw.training.lora_linear_op import fp8_lora_linear
    import_pack("seedvr2bw_second_copy")   # what ComfyUI's import of the custom_nodes folder amounts to
    second = importlib.import_module("seedvr2bw_second_copy.training.lora_linear_op")
    assert second.lora_linear is lora_linear and second.fp8_lora_linear is fp8_lora_linear
    x, w, d, u = torch.ones(2, 3), torch.ones(4, 3), torch.ones(3, 1), torch.ones(1, 4)
    assert torch.equal(lora_linear(x, w, None, d, u, 1.0)[0], torch.full((2, 4), 6.0))


def test_weight_grads_reach_the_lora_weights_contiguous():
    """down_t/up_t are transposed views of the LoRA weights: their gradients must arrive contiguous (fused AdamW
    refuses a gradient whose layout differs from its parameter's)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 20, generator=g)
    w = torch.randn(9, 20, generator=g)
    down = torch.randn(4, 20, generator=g, requires_grad=True)   # nn.Linear(20, 4).weight
    up = torch.randn(9, 4, generator=g, requires_grad=True)      # nn.Linear(4, 9).weight
    y, _ = lora_linear(x, w, None, down.t(), up.t(), 0.5)
    gd, gu = torch.autograd.grad(y.square().sum(), (down, up))
    assert gd.is_contiguous() and gu.is_contiguous()
    ref = x @ w.t() + 0.5 * (x @ down.t()) @ up.t()
    rd, ru = torch.autograd.grad(ref.square().sum(), (down, up))
    assert torch.allclose(gd, rd, rtol=1e-5, atol=1e-5) and torch.allclose(gu, ru, rtol=1e-5, atol=1e-5)


def test_fp8_operator_matches_base_then_lora():
    """torch.ops.seedvr2bw.fp8_lora_linear equals the fp8 base (training.quant.FP8LinearFn, FP8 GEMM) followed by
    the LoRA, in value (bf16 rounding) and gradients; LoRA weight gradients arrive contiguous."""
    from seedvr2bw.optimization.nvfp4.format import quantize_fp8_per_tensor
    from seedvr2bw.training.lora_linear_op import fp8_lora_linear
    from seedvr2bw.training.fp8_ops import fp8_scale_rows
    from seedvr2bw.training.quant import FP8LinearFn
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, generator=g)
    q, s = quantize_fp8_per_tensor(w)
    s = s.reshape(())
    rows = fp8_scale_rows(q, s)
    x = torch.randn(32, 32, generator=g).bfloat16().requires_grad_(True)
    down = (torch.randn(4, 32, generator=g) * 0.1).bfloat16().requires_grad_(True)
    up = (torch.randn(48, 4, generator=g) * 0.1).bfloat16().requires_grad_(True)
    b = torch.randn(48, generator=g).bfloat16()
    try:
        y, _ = fp8_lora_linear(x, q, rows[0], rows[1], b, down.t(), up.t(), 0.5)
    except (RuntimeError, NotImplementedError) as exc:   # a torch build without CPU _scaled_mm
        pytest.skip(f"torch._scaled_mm unavailable on CPU here: {exc}")
    ref = FP8LinearFn.apply(x, q, s, b, True, rows) + 0.5 * (x @ down.t()) @ up.t()
    assert float((y.float() - ref.float()).norm() / ref.float().norm()) < 4e-3
    gy = torch.randn(y.shape, generator=g).bfloat16()
    got = torch.autograd.grad(y, (x, down, up), gy)
    want = torch.autograd.grad(ref, (x, down, up), gy)
    for a, e in zip(got, want):
        assert float((a.float() - e.float()).norm() / e.float().norm()) < 4e-3
    assert got[1].is_contiguous() and got[2].is_contiguous()
