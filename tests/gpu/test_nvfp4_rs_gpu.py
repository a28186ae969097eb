"""The sm_90a RS W4A16 kernel (optimization/nvfp4/w4a16_rs.cu) on a Hopper GPU: bit-exact decode through the whole
data path, edge shapes and stream-K splits against the exact product with every output element checked, launch
after launch, the NVFP4Linear dispatch, launch plan and block-swapped weights. Skips without an sm_90 GPU."""
import pytest
import torch

from nvfp4_codes import weight_of_every_code
from seedvr2bw.optimization.nvfp4 import dispatch
from seedvr2bw.optimization.nvfp4 import format as fmt
from seedvr2bw.optimization.nvfp4 import rs_w4a16 as R
from seedvr2bw.optimization.nvfp4.linear import NVFP4Linear

DEV = "cuda"
pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                reason="needs an sm_90 (Hopper) GPU: the kernel uses wgmma and TMA")


def _run(x, t, n, bias=None, config=None, grid=None, stream_k=True):
    out = torch.full((x.shape[0], n), float("nan"), dtype=torch.bfloat16, device=DEV)     # every element written
    y = R.rs_linear(x, t.packed, t.block_scale, t.global_scale, n, bias, config, grid, out=out, stream_k=stream_k)
    assert y is not None, R.DISABLED_REASONS
    return y


@pytest.mark.parametrize("config", [(256, 4), (224, 4), (128, 6)])
@pytest.mark.parametrize("g", [1.0, 2.0 ** -5])
def test_identity_activations_return_the_weight_bit_exactly(config, g):
    """x = I: y[k, n] = W[n, k] x g, one product per output, so every decoded weight (all 256 bytes, every kind of
    block scale, zero and subnormal ones included) must come back exactly: the decode, the fragment layout, the
    activation swizzle, the epilogue's mapping and the TMA store in one go."""
    n, k = 256, 512
    t = weight_of_every_code(n, k, g, seed=config[0])
    want = t.dequantize(torch.float32)                       # exact: <= 6 significant bits times a power of 2
    x = torch.eye(k, dtype=torch.bfloat16, device=DEV)
    y = _run(x, t.to(DEV), n, config=config)
    assert torch.equal(y.t().float().cpu().abs(), want.abs())   # -0 comes back as +0 (accumulators start at +0)
    assert torch.equal(y.t().float().cpu(), want + 0.0)


CASES = [  # (M, K, N, config, grid): M tails, one k tile, CTAs looping over tiles, stream-K over 2-4 CTAs
    (1, 64, 128, (256, 4), None),
    (300, 640, 256, (256, 4), None),
    (1000, 512, 512, (256, 4), 3),
    (1000, 2048, 512, (256, 4), 3),
    (1000, 2048, 512, (224, 4), 7),
    (1000, 2048, 512, (256, 4), 5),
    (4133, 3072, 1536, None, None),
    (2500, 6912, 1280, None, None),
]


@pytest.mark.parametrize("m,k,n,config,grid", CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_the_exact_product(m, k, n, config, grid, bias):
    gen = torch.Generator().manual_seed(m + n + k)
    w = torch.randn(n, k, generator=gen) * 0.05
    w[0, :64] = 0.0
    w[1, 16:48] *= 1e-5
    t = fmt.quantize_nvfp4(w, return_tensor=True)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    b = (torch.randn(n, generator=gen) * 0.1).to(torch.bfloat16) if bias else None
    want = x.double() @ t.dequantize().double().t() + (b.double() if bias else 0)
    td, xd = t.to(DEV), x.to(DEV)
    for _ in range(2):                                      # twice: stream-K flags are back to 0 after a launch
        y = _run(xd, td, n, b.to(DEV) if bias else None, config, grid)
        torch.cuda.synchronize()
        assert not torch.isnan(y).any()
        err = ((y.double().cpu() - want).norm() / want.norm()).item()
        assert err < 4e-3, err                              # bf16 output rounding: ~2e-3


def test_stream_k_equals_whole_tiles():
    """The same product with the tail tiles split by k tiles (partial sums through the workspace) and with whole
    tiles: equal up to fp32 summation order."""
    gen = torch.Generator().manual_seed(3)
    t = fmt.quantize_nvfp4(torch.randn(768, 4096, generator=gen) * 0.05, return_tensor=True).to(DEV)
    x = torch.randn(1500, 4096, generator=gen).to(DEV, torch.bfloat16)
    assert R.split(R.tiles(1500, 768, 256), 64, 5)[1] > 0
    a = _run(x, t, 768, config=(256, 4), grid=5)
    b = _run(x, t, 768, config=(256, 4), grid=5, stream_k=False)
    assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 5e-3


def test_layer_dispatch_plan_and_swapped_weights():
    gen = torch.Generator().manual_seed(5)
    n, k, m = 1024, 2048, dispatch.RS_AUTO_M + 37
    t = fmt.quantize_nvfp4(torch.randn(n, k, generator=gen) * 0.05, return_tensor=True)
    bias = torch.randn(n, generator=gen) * 0.1
    lin = NVFP4Linear.from_nvfp4(t, bias=bias, path="fidelity", dtype=torch.bfloat16).to(DEV)
    x = torch.randn(m, k, generator=gen).to(DEV, torch.bfloat16)
    assert lin.decision(x).kernel == "rs_w4a16"
    with torch.no_grad():
        y1 = lin(x)                                         # full forward, then a plan for this shape
        assert lin.plans, "no launch plan was made"
        y2 = lin(x)                                         # the plan
    assert torch.equal(y1, y2)
    want = torch.nn.functional.linear(x.float(), t.dequantize(torch.float32).to(DEV), bias.to(DEV).float())
    assert ((y1.float() - want).norm() / want.norm()).item() < 4e-3
    # block swap: the weight's storage is replaced (same values, new address; then other values)
    with torch.no_grad():
        lin.weight.data = lin.weight.data.clone()
        assert torch.equal(lin(x), y1)
        t2 = fmt.quantize_nvfp4(torch.randn(n, k, generator=gen) * 0.05, return_tensor=True)
        lin.weight.data = t2.packed.to(DEV)
        lin.weight_scale.data = t2.block_scale.to(DEV)
        lin.weight_scale_2.data = t2.global_scale.to(DEV)
        y3 = lin(x)
    want3 = torch.nn.functional.linear(x.float(), t2.dequantize(torch.float32).to(DEV), bias.to(DEV).float())
    assert ((y3.float() - want3).norm() / want3.norm()).item() < 4e-3


def test_autograd_takes_the_dequantize_path():
    gen = torch.Generator().manual_seed(6)
    t = fmt.quantize_nvfp4(torch.randn(256, 512, generator=gen) * 0.05, return_tensor=True)
    lin = NVFP4Linear.from_nvfp4(t, path="fidelity", dtype=torch.bfloat16).to(DEV)
    x = torch.randn(dispatch.RS_MIN_M, 512, generator=gen).to(DEV, torch.bfloat16).requires_grad_()
    assert lin.decision(x).kernel == "dequant_cublas"
    lin(x).float().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_selftest_passes_here():
    assert R.selftest(torch.device(DEV)), R.DISABLED_REASONS


def test_mid_m_is_timed_against_dequant_once():
    """RS_MIN_M <= M < RS_AUTO_M: the layer times the RS kernel against dequantize + cuBLAS once per shape, keeps the
    faster; either gives the right product."""
    from seedvr2bw.optimization.nvfp4 import linear as L
    gen = torch.Generator().manual_seed(8)
    t = fmt.quantize_nvfp4(torch.randn(512, 1024, generator=gen) * 0.05, return_tensor=True)
    lin = NVFP4Linear.from_nvfp4(t, path="fidelity", dtype=torch.bfloat16).to(DEV)
    x = torch.randn(dispatch.RS_MIN_M + 100, 1024, generator=gen).to(DEV, torch.bfloat16)
    with torch.no_grad():
        assert lin.decision(x).kernel == "rs_or_dequant"
        y = lin(x)
        assert L.TIMED[(x.shape[0], 512, 1024, str(x.device))] in ("rs_w4a16", "dequant_cublas")
    want = torch.nn.functional.linear(x.float(), t.dequantize(torch.float32).to(DEV))
    assert ((y.float() - want).norm() / want.norm()).item() < 4e-3
