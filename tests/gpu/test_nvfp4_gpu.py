"""NVFP4 / FP8 paths on a CUDA GPU, each checked against the exact CPU reference.

Needs a CUDA device (skips otherwise) and Triton for the kernel tests. The FP4 tensor-core test needs
sm_100 / sm_120 and skips elsewhere with that reason.
"""
import pytest
import torch

from seedvr2bw.optimization.nvfp4 import format as fmt
from seedvr2bw.optimization.nvfp4 import kernels as K
from seedvr2bw.optimization.nvfp4 import dispatch
from seedvr2bw.optimization.nvfp4.emulation import expected_output
from seedvr2bw.optimization.nvfp4.fp4_gemm import fp4_gemm_supported
from seedvr2bw.optimization.nvfp4.linear import FP8Linear, NVFP4Linear
from seedvr2bw.optimization.nvfp4.selftest import run_gemm_selftest

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_triton = pytest.mark.skipif(not K.HAS_TRITON, reason="needs Triton")
DEV = "cuda"


def _u8(t):
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _adversarial(m, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 3
    x[0] = 0                                   # an all-zero row
    x[1, :16] = 2.5                            # all-equal block
    x[2, :16] = 1e-30                          # scale underflows E4M3 -> zeros
    x[3, 16:32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2) * (6 / 6)  # ties
    x[4, :k] = torch.finfo(torch.bfloat16).max / 4 * torch.sign(torch.randn(k, generator=g))  # extreme finite
    x[5, 0] = -0.0
    return x.to(dtype)


@cuda
@needs_triton
@pytest.mark.parametrize("m,k", [(1, 16), (200, 96), (300, 48), (128, 3072), (513, 2560)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_act_nvfp4_kernel_bit_exact(m, k, dtype):
    x = _adversarial(m, k, dtype, m * 7 + k) if m > 8 else torch.randn(m, k).to(dtype)
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    g = fmt.global_scale_for(x)
    q, s = K.quantize_act_nvfp4(x.to(DEV), g.to(DEV))
    pr, sr, _ = fmt.quantize_nvfp4(x, g, pad_rows=1)
    assert q.shape == pr.shape and s.shape == sr.shape
    assert torch.equal(q.cpu(), pr)
    assert torch.equal(_u8(s.cpu()), _u8(sr))


@cuda
@needs_triton
def test_act_nvfp4_kernel_chunked_rows_match_unchunked():
    x = torch.randn(1000, 256, dtype=torch.bfloat16, device=DEV)
    g = fmt.global_scale_for(x)
    q1, s1 = K.quantize_act_nvfp4(x, g)
    q2, s2 = K.quantize_act_nvfp4(x, g, chunk_rows=128)
    assert torch.equal(q1, q2) and torch.equal(_u8(s1), _u8(s2))


@cuda
@needs_triton
@pytest.mark.parametrize("m,k", [(1, 32), (77, 3072), (256, 12288), (33, 100)])
def test_act_fp8_kernel_bit_exact(m, k):
    x = (torch.randn(m, k) * 5).to(torch.bfloat16)
    x[0] = 0
    q, s = K.quantize_act_fp8_rowwise(x.to(DEV))
    qr, sr = fmt.quantize_act_fp8_rowwise_reference(x)
    assert torch.equal(s.cpu(), sr)
    assert torch.equal(_u8(q.cpu()), _u8(qr))


@cuda
@needs_triton
@pytest.mark.parametrize("n,k", [(70, 96), (3072, 2560), (300, 48)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequant_kernel_bit_exact(n, k, dtype):
    t = fmt.quantize_nvfp4(torch.randn(n, k), return_tensor=True)
    want = t.dequantize(dtype)
    got = K.dequantize_nvfp4_triton(t.packed.to(DEV), t.block_scale.to(DEV), t.global_scale.to(DEV), t.shape, dtype)
    assert torch.equal(got.cpu(), want)


@cuda
@needs_triton
@pytest.mark.parametrize("n,k", [(70, 96), (3072, 12288), (12288, 3072)])
def test_fp8_copy_of_nvfp4_weights_bit_exact(n, k):
    """The FP8 copy fp8_speed derives on the GPU (each time BlockSwap brings a block) equals the CPU reference."""
    w = torch.randn(n, k) * torch.exp2(torch.randint(-20, 8, (n, 1)).float())
    w[0] = 0
    t = fmt.quantize_nvfp4(w, return_tensor=True)
    q, s = K.nvfp4_to_fp8_rowwise_triton(t.packed.to(DEV), t.block_scale.to(DEV), t.global_scale.to(DEV), t.shape)
    rq, rs = fmt.nvfp4_to_fp8_rowwise(t)
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s.cpu(), rs)


@cuda
@needs_triton
@pytest.mark.parametrize("n,k,c0,c1", [(70, 96, 16, 96), (3072, 2560, 640, 2560), (300, 1008, 0, 512),
                                       (300, 1008, 512, 1008)])
def test_dequant_kernel_column_range_bit_exact(n, k, c0, c1):
    t = fmt.quantize_nvfp4(torch.randn(n, k), return_tensor=True)
    want = t.dequantize(torch.bfloat16)
    want = torch.nn.functional.pad(want, (0, t.packed.shape[1] * 2 - k))[:, c0:c1]
    got = K.dequantize_nvfp4_triton(t.packed.to(DEV), t.block_scale.to(DEV), t.global_scale.to(DEV), (n, c1 - c0),
                                    torch.bfloat16, col0=c0)
    assert torch.equal(got.cpu(), want)


def _layer(n, k, path, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g) if bias else None
    return NVFP4Linear.from_nvfp4(fmt.quantize_nvfp4(w, return_tensor=True), bias=b, path=path)


@cuda
@pytest.mark.parametrize("path,tol", [("reference", 5e-3), ("fidelity", 1e-2), ("fp8_speed", 2e-2)])
@pytest.mark.parametrize("m", [1, 64, 256, 1000])
@pytest.mark.parametrize("n,k", [(96, 160), (512, 2560), (80, 72)])
def test_paths_match_their_cpu_emulation(path, tol, m, n, k):
    if path == "fp8_speed" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need sm_89+")
    layer = _layer(n, k, path, seed=m + n)
    x = torch.randn(m, k).to(torch.bfloat16)
    want = expected_output(layer, x, path)
    got = layer.to(DEV)(x.to(DEV))
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    err = ((got.double().cpu() - want).norm() / want.norm()).item()
    assert err < tol, err


@cuda
@needs_triton
@pytest.mark.parametrize("kernel", dispatch.FIDELITY_KERNELS)
@pytest.mark.parametrize("m,n,k", [(1, 96, 160), (64, 512, 2560), (200, 80, 72), (256, 3072, 3072),
                                   (1100, 1000, 160)])
def test_fidelity_small_m_kernels(kernel, m, n, k):
    layer = _layer(n, k, "fidelity", seed=m + k)
    layer.fidelity_kernel = kernel
    x = torch.randn(m, k).to(torch.bfloat16)
    want = expected_output(layer, x, "reference")
    got = layer.to(DEV)(x.to(DEV)).double().cpu()
    assert ((got - want).norm() / want.norm()).item() < 1e-2


@cuda
@needs_triton
@pytest.mark.parametrize("m,n,k", [(1, 3072, 3072), (16, 300, 512), (40, 2560, 6912), (64, 640, 2560),
                                   (130, 384, 96), (256, 1000, 3072), (600, 257, 208)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w4a16_swab_kernel_all_configs(m, n, k, bias, dtype):
    """Every row of the config table (split-K and not, even and odd K, N not a multiple of the tile)."""
    t = fmt.quantize_nvfp4(torch.randn(n, k) * 0.1, return_tensor=True)
    x = torch.randn(m, t.packed.shape[1] * 2).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    want = x.double() @ t.dequantize().double().t() + (b.double() if bias else 0)
    cfg = K.w4a16_config(m, n, x.shape[1], torch.device(DEV))
    got = K.w4a16_linear(x.to(DEV), t.packed.to(DEV), t.block_scale.to(DEV), t.global_scale.to(DEV), n,
                         b.to(DEV) if bias else None)
    assert got.dtype == dtype and got.shape == (m, n)
    err = ((got.double().cpu() - want).norm() / want.norm()).item()
    assert err < 5e-3, (err, cfg)


if K.HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _decode_probe(p_ptr, s_ptr, hi_ptr, lo_ptr, R: tl.constexpr, C: tl.constexpr, F16: tl.constexpr):
        offs = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
        hv, lv = K.e2m1_pairs_scaled(tl.load(p_ptr + offs), tl.load(s_ptr + offs), F16)
        tl.store(hi_ptr + offs, hv)
        tl.store(lo_ptr + offs, lv)


@cuda
@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ptx_e2m1_decode_exhaustive(dtype):
    """The PTX byte-table decode of the fused kernel: every byte (both nibbles, both signs) times every kind of
    E4M3 block scale (smallest subnormal, normal, 448, zero), each byte with its own scale: exact."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(64)[torch.randperm(256 * 64)].reshape(128, 128)
    scales = torch.tensor([2.0 ** -9, 2.0 ** -6, 0.4375, 1.0, 1.125, 13.0, 240.0, 448.0, 0.0])
    s = scales[torch.randint(0, len(scales), codes.shape)].to(torch.float8_e4m3fn).float()
    values = torch.tensor(fmt.E2M1_VALUES)
    want_hi = values[(codes >> 4).long()] * s
    want_lo = values[(codes & 15).long()] * s
    hi = torch.empty(codes.shape, dtype=dtype, device=DEV)
    lo = torch.empty_like(hi)
    _decode_probe[(1,)](codes.to(DEV), s.to(dtype).to(DEV), hi, lo, R=128, C=128, F16=dtype == torch.float16)
    assert torch.equal(hi.float().cpu(), want_hi.to(dtype).float())       # both exact in dtype
    assert torch.equal(lo.float().cpu(), want_lo.to(dtype).float())
    assert torch.equal(want_hi.to(dtype).float(), want_hi)                 # ... and the products need no rounding
    neg_zero = (codes >> 4 == 8) & (s > 0)
    assert torch.signbit(hi.float().cpu()[neg_zero]).all()                 # -0 keeps its sign


@cuda
@needs_triton
@pytest.mark.parametrize("cfg", [(64, 128, 64, 1, 4, 3, 0, 0), (64, 128, 64, 1, 4, 3, 1, 0),
                                 (128, 256, 64, 1, 8, 3, 1, 0), (128, 256, 64, 1, 8, 3, 1, 1),
                                 (64, 256, 128, 2, 4, 3, 1, 0), (128, 128, 64, 4, 8, 3, 1, 0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w4a16_large_tiles_and_decodes(cfg, dtype):
    """The large-M tiles, the PTX and the arithmetic decode, the transposed store: all equal the exact product
    (M, N not multiples of the tile; bias)."""
    m, n, k = 700, 333, 1024
    t = fmt.quantize_nvfp4(torch.randn(n, k) * 0.1, return_tensor=True)
    x = torch.randn(m, k).to(dtype)
    b = torch.randn(n).to(dtype)
    want = x.double() @ t.dequantize().double().t() + b.double()
    got = K.w4a16_linear(x.to(DEV), t.packed.to(DEV), t.block_scale.to(DEV), t.global_scale.to(DEV), n,
                         b.to(DEV), config=cfg)
    err = ((got.double().cpu() - want).norm() / want.norm()).item()
    assert err < 5e-3, (err, cfg)


@cuda
@needs_triton
def test_w4a16_kernel_matches_exact_product():
    t = fmt.quantize_nvfp4(torch.randn(300, 512), return_tensor=True)
    x = torch.randn(40, 512).to(torch.bfloat16)
    b = torch.randn(300).to(torch.bfloat16)
    got = K.w4a16_linear(x.to(DEV), t.packed.to(DEV), t.block_scale.to(DEV), t.global_scale.to(DEV), 300,
                         b.to(DEV)).double().cpu()
    want = x.double() @ t.dequantize().double().t() + b.double()
    assert ((got - want).norm() / want.norm()).item() < 5e-3


@cuda
def test_fidelity_is_close_to_exact_reference_across_the_small_m_switch():
    layer = _layer(384, 512, "fidelity")
    for m in (255, 256, 257):
        x = torch.randn(m, 512).to(torch.bfloat16)
        want = expected_output(layer, x, "reference")
        got = layer.to(DEV)(x.to(DEV)).double().cpu()
        assert ((got - want).norm() / want.norm()).item() < 1e-2


@cuda
@pytest.mark.parametrize("path", ["fidelity", "fp8_speed", "reference"])
def test_selftest_passes(path):
    if path == "fp8_speed" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need sm_89+")
    ok, why = run_gemm_selftest(path, DEV)
    assert ok, why


@cuda
def test_fp4_selftest_reports_reason_off_blackwell():
    ok, why = run_gemm_selftest("fp4_tensorcore", DEV)
    supported, reason = fp4_gemm_supported(DEV)
    if not supported:
        assert not ok and reason in why


@cuda
@pytest.mark.skipif(not torch.cuda.is_available() or not fp4_gemm_supported("cuda")[0],
                    reason="FP4 tensor-core GEMM needs an sm_100/sm_120 GPU "
                           "(this device has no FP4 tensor cores, or no GPU)")
@pytest.mark.parametrize("m", [1, 100, 128, 1000])
def test_fp4_tensorcore_matches_cpu_emulation(m):
    layer = _layer(256, 512, "fp4_tensorcore")
    x = torch.randn(m, 512).to(torch.bfloat16)
    want = expected_output(layer, x, "fp4_tensorcore")
    got = layer.to(DEV)(x.to(DEV)).double().cpu()
    err = ((got - want).norm() / want.norm()).item()
    assert err < 2e-2, err
    ok, why = run_gemm_selftest("fp4_tensorcore", DEV)
    assert ok, why


@cuda
def test_fp8_linear_scaled_mm_close_to_cast():
    from seedvr2bw.optimization.nvfp4.linear import FP8Linear
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need sm_89+")
    lin = torch.nn.Linear(256, 128).to(torch.bfloat16)
    a = FP8Linear.from_linear(lin, mode="cast").to(DEV)
    b = FP8Linear.from_linear(lin, mode="scaled_mm").to(DEV)
    x = torch.randn(64, 256, dtype=torch.bfloat16, device=DEV)
    ya, yb = a(x).float(), b(x).float()
    assert ((ya - yb).norm() / ya.norm()).item() < 5e-2
    assert a.weight.dtype == torch.float8_e4m3fn


@cuda
@pytest.mark.parametrize("recipe", ["comfy", "modelopt"])
def test_torch_quantizer_on_gpu_matches_cpu(recipe):
    """The converter quantizes on the GPU when one is there: same bytes as the CPU reference."""
    x = _adversarial(300, 256, torch.float32, 11)
    g = fmt.global_scale_for(x)
    p, s, _ = fmt.quantize_nvfp4(x, g, recipe=recipe)
    pg, sg, _ = fmt.quantize_nvfp4(x.to(DEV), g.to(DEV), recipe=recipe)
    assert torch.equal(pg.cpu(), p) and torch.equal(_u8(sg.cpu()), _u8(s))


@cuda
@needs_triton
@pytest.mark.parametrize("m,n,k", [(1, 3072, 3072), (64, 640, 2560), (256, 1000, 3072)])
def test_fast_relaunch_gives_the_same_bits(m, n, k):
    """Second and later calls reuse the compiled kernel through its launcher (launch.launch): same bytes as
    the first (normal) launch, for the fused W4A16 kernel (+ split-K reduce) and the dequant kernel."""
    t = fmt.quantize_nvfp4(torch.randn(n, k) * 0.1, return_tensor=True).to(DEV)
    b = torch.randn(n, dtype=torch.bfloat16, device=DEV)
    ys = []
    for i in range(3):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).to(DEV)
        ys.append(K.w4a16_linear(x, t.packed, t.block_scale, t.global_scale, n, b))
    ws = [K.dequantize_nvfp4_triton(t.packed, t.block_scale, t.global_scale, t.shape) for _ in range(3)]
    torch.cuda.synchronize()
    assert torch.equal(ys[0], ys[1]) and torch.equal(ys[0], ys[2])
    assert torch.equal(ws[0], ws[1]) and torch.equal(ws[0], ws[2])
    assert torch.equal(ws[0].cpu(), t.to("cpu").dequantize(torch.bfloat16))
    want = x.double().cpu() @ t.to("cpu").dequantize().double().t() + b.double().cpu()
    assert ((ys[2].double().cpu() - want).norm() / want.norm()).item() < 5e-3


@cuda
def test_fp8_cast_layers_share_one_scratch_weight_and_match_fresh_weights():
    """Two FP8 layers of different shapes in a row on the cast path: each output equals F.linear with a freshly
    dequantized weight (the second layer's dequantize must not corrupt the first's GEMM), and the allocator sees
    no new allocation once the scratch holds the largest layer."""
    a = FP8Linear.from_linear(torch.nn.Linear(256, 512).to(torch.bfloat16)).cuda()
    b = FP8Linear.from_linear(torch.nn.Linear(512, 384).to(torch.bfloat16)).cuda()
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        ya = a(x)
        yb = b(ya)
        ref_a = torch.nn.functional.linear(x, a.dequantize_weight(torch.bfloat16), a.bias)
        ref_b = torch.nn.functional.linear(ref_a, b.dequantize_weight(torch.bfloat16), b.bias)
        torch.cuda.synchronize()
        assert torch.equal(ya, ref_a) and torch.equal(yb, ref_b)
        n_before = torch.cuda.memory_stats()["allocation.all.allocated"]
        a(x)
        b(ya)
        torch.cuda.synchronize()
        # the two outputs only: no weight-sized buffer per call
        assert torch.cuda.memory_stats()["allocation.all.allocated"] - n_before <= 4
