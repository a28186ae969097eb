"""NVFP4 format code: exact on CPU, bit-exact with comfy-kitchen's and nvidia-modelopt's reference quantizers.

Optional packages (installed in the test env; tests skip with the reason when missing):
  comfy-kitchen (PyPI `comfy-kitchen`, eager backend runs on CPU), nvidia-modelopt (PyPI `nvidia-modelopt`,
  `NVFP4QTensor.quantize` is plain PyTorch and runs on CPU).
"""
import pytest
import torch

from seedvr2bw.optimization.nvfp4 import format as fmt

from nvfp4_refs import NVFP4QTensor, ck_fu, ck_q, needs_ck, needs_mo


def _u8(t):
    return t.view(torch.uint8)


def tensors():
    """Random and adversarial tensors: (name, tensor, explicit global scale or None)."""
    g = torch.Generator().manual_seed(42)
    out = []
    out.append(("gauss_bf16", (torch.randn(300, 200, generator=g) * 0.02).to(torch.bfloat16), None))
    out.append(("gauss_fp32", torch.randn(128, 256, generator=g), None))
    out.append(("gauss_fp16", torch.randn(17, 48, generator=g).to(torch.float16), None))
    out.append(("k_not_mult_64", torch.randn(40, 80, generator=g), None))          # K=80: 5 blocks
    out.append(("k_not_mult_16", torch.randn(33, 72, generator=g), None))          # padded to 80
    out.append(("zeros", torch.zeros(32, 64), torch.tensor(1.0)))                  # g given: ck's default is NaN
    ext = torch.randn(64, 64, generator=g).sign() * torch.finfo(torch.float32).max / 8
    out.append(("extreme_finite", ext, None))
    tiny = torch.randn(64, 64, generator=g) * 1e-30
    out.append(("subnormal_block_scales", tiny, torch.tensor(1e-3)))               # scales underflow E4M3
    sub = torch.randn(64, 64, generator=g)
    out.append(("small_scale_range", sub * torch.logspace(-6, 0, 64).reshape(64, 1), None))
    eq = torch.full((48, 32), 0.37)
    eq[1::2] = -2.5
    out.append(("all_equal_blocks", eq, None))
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5,
                         -5.0]).repeat(16, 4)
    out.append(("rounding_ties", ties, torch.tensor(1.0 / 448)))                   # block scale 1.0 exactly
    mixed = torch.randn(256, 3072, generator=g)
    mixed[:, ::97] *= 300
    out.append(("outliers_swizzle_multi_tile", mixed.to(torch.bfloat16), None))
    return out


CASES = tensors()


def test_e2m1_table_and_rne():
    vals = torch.tensor(fmt.E2M1_VALUES)
    codes = fmt.encode_e2m1(vals)
    assert codes.tolist() == list(range(16))
    # ties go to the even code
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert fmt.decode_e2m1(fmt.encode_e2m1(ties)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    # saturation, no inf/nan codes
    assert fmt.decode_e2m1(fmt.encode_e2m1(torch.tensor([100.0, -7.0]))).tolist() == [6.0, -6.0]


def test_nibble_order_hand_built_byte():
    codes = fmt.encode_e2m1(torch.tensor([[6.0, 0.5]]))     # codes 7 and 1
    assert fmt.pack_fp4(codes, "hi_first").item() == 0x71
    assert fmt.pack_fp4(codes, "lo_first").item() == 0x17
    assert fmt.NIBBLE_ORDER == "hi_first"
    for order, byte in (("hi_first", 0x71), ("lo_first", 0x17)):
        back = fmt.decode_e2m1(fmt.unpack_fp4(torch.tensor([[byte]], dtype=torch.uint8), order))
        assert back.tolist() == [[6.0, 0.5]]
    assert fmt.swap_nibbles(torch.tensor([0x71], dtype=torch.uint8)).item() == 0x17


@pytest.mark.parametrize("rows,cols", [(1, 1), (5, 3), (128, 4), (129, 5), (300, 13), (256, 192)])
def test_swizzle_roundtrip_ragged(rows, cols):
    s = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) + 1
    z = fmt.swizzle_block_scales(s)
    assert z.shape == fmt.swizzled_scale_shape(rows, cols)
    assert torch.equal(fmt.unswizzle_block_scales(z, rows, cols), s)
    # padding is zero, and every element lands at the documented byte offset
    assert z.sum() == s.sum()
    r = torch.arange(rows).repeat_interleave(cols)
    c = torch.arange(cols).repeat(rows)
    idx = fmt.swizzled_scale_index(r, c, z.shape[1] // 4)
    assert torch.equal(z.reshape(-1)[idx], s.reshape(-1))


@needs_ck
@pytest.mark.parametrize("rows,cols", [(5, 3), (129, 5), (300, 13), (256, 192)])
def test_swizzle_matches_comfy_kitchen(rows, cols):
    s = torch.randn(rows, cols)
    assert torch.equal(fmt.swizzle_block_scales(s), ck_fu.to_blocked(s, flatten=False))
    z = fmt.swizzle_block_scales(s)
    assert torch.equal(fmt.unswizzle_block_scales(z, rows, cols), ck_fu.from_blocked(z, rows, cols))


@needs_ck
@pytest.mark.parametrize("name,x,g", CASES, ids=[c[0] for c in CASES])
def test_quantize_bit_exact_with_comfy_kitchen(name, x, g):
    gs = fmt.global_scale_for(x) if g is None else g
    p, s, g2 = fmt.quantize_nvfp4(x, gs)
    need_pad = (fmt.roundup(x.shape[0], 16), fmt.roundup(x.shape[1], 16)) != tuple(x.shape)
    p_ck, s_ck = ck_q.quantize_nvfp4(x, gs, pad_16x=need_pad)                   # hi_first (comfy default)
    assert torch.equal(p, p_ck), name
    assert torch.equal(_u8(s), _u8(s_ck)), name
    # the other nibble order is the same bytes with nibbles swapped
    p_lo, s_lo = ck_q.quantize_nvfp4(x, gs, pad_16x=need_pad, hi_first=False)
    assert torch.equal(fmt.swap_nibbles(p), p_lo)
    # dequantize: bit-exact in float32
    d = fmt.dequantize_nvfp4(p, s, gs, torch.float32)
    d_ck = ck_q.dequantize_nvfp4(p_ck, gs, s_ck, output_type=torch.float32)
    assert torch.equal(d, d_ck), name
    # and exactly q * s_b * g
    codes = fmt.unpack_fp4(p)
    sb = fmt.unswizzle_block_scales(s, p.shape[0], p.shape[1] * 2 // 16).float()
    want = fmt.decode_e2m1(codes).reshape(p.shape[0], -1, 16) * (gs * sb).unsqueeze(-1)
    assert torch.equal(d, want.reshape(d.shape))


@needs_ck
def test_dequantize_bf16_close_to_comfy_kitchen():
    # comfy-kitchen's eager dequant rounds g and g*s to bf16 before multiplying; ours multiplies in fp32 and
    # rounds once, so the two differ by at most one bf16 rounding of the scale product.
    x = torch.randn(256, 512)
    p, s, g = fmt.quantize_nvfp4(x)
    ours = fmt.dequantize_nvfp4(p, s, g, torch.bfloat16).float()
    theirs = ck_q.dequantize_nvfp4(p, g, s, output_type=torch.bfloat16).float()
    exact = fmt.dequantize_nvfp4(p, s, g, torch.float32)
    assert ((ours - exact).abs() <= (theirs - exact).abs() + 1e-12).float().mean() > 0.99
    assert torch.allclose(ours, theirs, rtol=2 ** -6, atol=0)


@pytest.mark.parametrize("pad_rows", [1, 16, 128])
@pytest.mark.parametrize("name,x,g", CASES, ids=[c[0] for c in CASES])
def test_slab_by_slab_quantization_equals_one_slab(monkeypatch, name, x, g, pad_rows):
    """quantize_nvfp4 works through bounded slabs of rows; slab edges (and all-padding slabs) change no bit."""
    monkeypatch.setattr(fmt, "QUANT_SLAB_ELEMENTS", 1 << 30)
    whole = fmt.quantize_nvfp4(x, g, pad_rows=pad_rows)
    monkeypatch.setattr(fmt, "QUANT_SLAB_ELEMENTS", 3 * x.shape[1])     # 3 rows per slab: ragged last slab
    slabs = fmt.quantize_nvfp4(x, g, pad_rows=pad_rows)
    assert torch.equal(whole[0], slabs[0]) and torch.equal(_u8(whole[1]), _u8(slabs[1])), name
    assert torch.equal(whole[2], slabs[2])


def test_default_global_scale_and_zero_tensor():
    x = torch.randn(16, 32)
    assert torch.equal(fmt.global_scale_for(x), x.abs().amax() / (6 * 448))
    p, s, g = fmt.quantize_nvfp4(torch.zeros(16, 32))
    assert g.item() == 1.0 and not p.any() and not _u8(s).any()


@needs_mo
@pytest.mark.parametrize("name,x,g", [c for c in CASES if c[1].shape[1] % 16 == 0 and c[0] != "zeros"],
                         ids=[c[0] for c in CASES if c[1].shape[1] % 16 == 0 and c[0] != "zeros"])
def test_quantize_bit_exact_with_modelopt(name, x, g):
    x = x.float()
    x = torch.where(x == 0, torch.zeros_like(x), x)        # ModelOpt stores -0.0 as +0; so does recipe=modelopt
    qt, s_mo, g_mo = NVFP4QTensor.quantize(x.clone(), 16, weights_scaling_factor_2=None if g is None else g)
    p, s, g2 = fmt.quantize_nvfp4(x, g_mo, recipe="modelopt", nibble_order="lo_first", swizzle=False, pad_rows=1)
    assert torch.equal(g_mo.float().reshape(()), g2.reshape(()))
    assert torch.equal(p, qt._quantized_data), name
    assert torch.equal(_u8(s), _u8(s_mo.reshape(s.shape))), name
    # internal convention (hi_first, swizzled) decodes to the same values as ModelOpt's own dequantize
    d_mo = qt.dequantize(dtype=torch.float32, scale=s_mo, double_scale=g_mo, block_sizes={-1: 16})
    d = fmt.dequantize_nvfp4(fmt.swap_nibbles(p), fmt.swizzle_block_scales(s), g_mo, torch.float32,
                             shape=tuple(x.shape))
    assert torch.allclose(d, d_mo, rtol=1e-6, atol=0), name


def test_gaussian_roundtrip_error_is_the_formats_own():
    x = torch.randn(1024, 4096, generator=torch.Generator().manual_seed(0))
    t = fmt.quantize_nvfp4(x, return_tensor=True)
    err = ((t.dequantize() - x).norm() / x.norm()).item()
    assert 0.09 < err < 0.0998, err      # the format's own ~9.5% (within 5%)


def test_fp8_helpers():
    w = torch.randn(64, 128)
    q, s = fmt.quantize_fp8_rowwise(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (64,)
    assert ((q.float() * s[:, None] - w).norm() / w.norm()) < 0.04
    t = fmt.quantize_nvfp4(w, return_tensor=True)
    q2, s2 = fmt.nvfp4_to_fp8_rowwise(t)
    wd = t.dequantize()
    # NVFP4 -> FP8 re-quantization adds error well below NVFP4's own
    assert ((q2.float() * s2[:, None] - wd).norm() / wd.norm()) < 0.025
    # power-of-two row scales times g: values with <= 4 significant bits are kept exactly
    exact = (q2.float() * s2[:, None] == wd)
    assert exact.float().mean() > 0.5


def test_fp8_speed_path_costs_at_most_half_a_db():
    """Acceptance: the FP8 speed path (NVFP4 weight -> FP8 rows, per-token FP8 activations) adds <= 0.5 dB of
    error over the exact NVFP4 (W4A16) product, vs the fp32 product of the unquantized weights."""
    import math
    from seedvr2bw.optimization.nvfp4.emulation import expected_output
    from seedvr2bw.optimization.nvfp4.linear import NVFP4Linear
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3072, 3072, generator=g) * 0.02
    x = torch.randn(512, 3072, generator=g)
    ref = x.double() @ w.double().t()
    layer = NVFP4Linear.from_nvfp4(fmt.quantize_nvfp4(w, return_tensor=True), bias=None)

    def snr(y):
        return -20 * math.log10(((y - ref).norm() / ref.norm()).item())
    loss = snr(expected_output(layer, x, "fidelity")) - snr(expected_output(layer, x, "fp8_speed"))
    assert 0 < loss <= 0.5, loss
