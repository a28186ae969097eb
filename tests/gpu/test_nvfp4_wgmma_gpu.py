"""The sm_90a wgmma W4A16 kernel (optimization/nvfp4/w4a16_wgmma.cu) on a Hopper GPU: bit-exact decode through
the whole data path, every tile config against the exact product, the dispatch and launch plan of NVFP4Linear.
Skips without an sm_90 GPU (the kernel needs wgmma)."""
import pytest
import torch

from nvfp4_codes import weight_of_every_code
from seedvr2bw.optimization.nvfp4 import format as fmt
from seedvr2bw.optimization.nvfp4 import kernels as K
from seedvr2bw.optimization.nvfp4 import wgmma_w4a16 as W
from seedvr2bw.optimization.nvfp4.linear import NVFP4Linear

DEV = "cuda"
pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                reason="needs an sm_90 (Hopper) GPU: the kernel uses wgmma")
CONFIGS = [(1, 128, 3, 1), (1, 128, 3, 2), (1, 128, 4, 1), (1, 256, 3, 1), (2, 128, 4, 1), (2, 256, 3, 1),
           (1, 64, 4, 1), (2, 256, 4, 2), (2, 256, 5, 1), (2, 192, 4, 1), (2, 128, 3, 1), (4, 128, 4, 1),
           (4, 64, 4, 2)]


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("g", [1.0, 2.0 ** -5])
def test_identity_activations_return_the_weight_bit_exactly(cfg, g):
    """x = I (K tokens): y[k, n] = W[n, k] x g, one product per output, so every decoded weight (all 256 bytes,
    every kind of block scale, subnormal ones included) must come back exactly: checks the decode, the fragment
    layout, the activation swizzle, the split-K partials and the epilogue's mapping in one go."""
    n, k = 256, 256
    t = weight_of_every_code(n, k, g, seed=cfg[0] * 10 + cfg[3])
    want = t.dequantize(torch.float32)                       # exact: <= 6 significant bits times a power of 2
    x = torch.eye(k, dtype=torch.bfloat16, device=DEV)
    td = t.to(DEV)
    y = W.wgmma_linear(x, td.packed, td.block_scale, td.global_scale, n, None, cfg)
    assert y is not None, W.DISABLED_REASONS
    assert torch.equal(y.t().float().cpu(), want)       # (-0 comes back as +0: the fp32 accumulator starts at +0)


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("m,n,k", [(65, 64, 64), (200, 192, 640), (513, 1024, 3072), (1, 128, 128)])
@pytest.mark.parametrize("bias", [False, True])
def test_configs_match_the_exact_product(cfg, m, n, k, bias):
    wg, bm, st, sk = cfg
    if n % (64 * wg) or (k // 64) % sk:
        pytest.skip("config does not tile this shape")
    gen = torch.Generator().manual_seed(m + n + k)
    t = fmt.quantize_nvfp4(torch.randn(n, k, generator=gen) * 0.05, return_tensor=True)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    b = (torch.randn(n, generator=gen) * 0.1).to(torch.bfloat16) if bias else None
    want = x.double() @ t.dequantize().double().t() + (b.double() if bias else 0)
    td = t.to(DEV)
    y = W.wgmma_linear(x.to(DEV), td.packed, td.block_scale, td.global_scale, n, b.to(DEV) if bias else None,
                       cfg)
    err = ((y.double().cpu() - want).norm() / want.norm()).item()
    assert err < 5e-3, (err, cfg)


def test_selftest_passes_on_this_gpu():
    assert W.selftest(torch.device(DEV)), W.DISABLED_REASONS


def _layer(n, k, bias=True, seed=0):
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05)
    return NVFP4Linear.from_linear(lin, path="fidelity").to(DEV)


@pytest.mark.parametrize("m,n,k", [(256, 3072, 3072), (77, 640, 2560), (256, 2560, 6912)])
def test_linear_uses_the_kernel_and_its_plan_gives_the_same_bits(m, n, k):
    layer = _layer(n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(DEV, torch.bfloat16)
    assert W.usable(x, n, k) and layer.decision(x).kernel == "w4a16_wgmma"
    direct = W.wgmma_linear(x, layer.weight, layer.weight_scale, layer.weight_scale_2, n, layer.bias)
    first = layer(x)                                # the full forward; it records the launch plan
    assert len(layer.plans) == 1
    later = [layer(x) for _ in range(3)]            # the plan
    torch.cuda.synchronize()
    assert torch.equal(first, direct)
    assert all(torch.equal(first, y) for y in later)
    triton_y = K.w4a16_linear(x, layer.weight, layer.weight_scale, layer.weight_scale_2, n, layer.bias)  # same product
    err = ((first.float() - triton_y.float()).norm() / triton_y.float().norm()).item()
    assert err < 2e-3


def test_plan_reads_the_weight_storage_at_each_call():
    """Block swap replaces ``weight.data`` between calls: the plan must use the new storage."""
    layer = _layer(1024, 1024, seed=2)
    x = torch.randn(256, 1024, generator=torch.Generator().manual_seed(3)).to(DEV, torch.bfloat16)
    layer(x)
    other = _layer(1024, 1024, seed=4)
    other.bias.data.copy_(layer.bias.data)
    for name in ("weight", "weight_scale", "weight_scale_2"):
        getattr(layer, name).data = getattr(other, name).data.clone()
    assert len(layer.plans) == 1
    torch.cuda.synchronize()
    assert torch.equal(layer(x), other(x))
