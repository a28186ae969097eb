"""The NVFP4 fidelity path's "slabs" kernel (weight dequantized slab by slab, each slab multiplied into its column
slice of the output by cuBLASLt with the bias in the epilogue) and the cuBLASLt binding it uses. Needs a CUDA GPU
and Triton; skips otherwise."""
import pytest
import torch
import torch.nn.functional as F

from seedvr2bw.optimization.nvfp4 import cublaslt
from seedvr2bw.optimization.nvfp4 import format as fmt
from seedvr2bw.optimization.nvfp4 import kernels as K
from seedvr2bw.optimization.nvfp4 import linear as L
from seedvr2bw.optimization.nvfp4.linear import NVFP4Linear

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(not K.HAS_TRITON, reason="needs Triton")]
DEV = "cuda"


def _layer(n, k, bias, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = fmt.quantize_nvfp4(torch.randn(n, k, generator=g) * 0.05, return_tensor=True).to(DEV)
    b = (torch.randn(n, generator=g) * 0.5).to(DEV, dtype) if bias else None
    return NVFP4Linear.from_nvfp4(t, bias=b, path="fidelity", dtype=dtype)


def _ref(layer, x):
    w = layer.dequantize_weight(torch.float32)
    b = layer.bias.float() if layer.bias is not None else None
    return F.linear(x.float(), w, b)


def _rel(y, ref):
    return ((y.float() - ref).norm() / ref.norm()).item()


@pytest.fixture(params=[0, 8], ids=["one-stream", "overlap"])
def small_slabs(monkeypatch, request):
    """Slabs of 128 rows whatever the GPU's L2 (many slabs on small test weights), dequantized on the GEMM's
    stream or on a side stream while the previous slab's GEMM runs."""
    monkeypatch.setattr(L, "SLAB_L2_FRACTION", 1e-9)
    monkeypatch.setattr(L, "SLAB_OVERLAP_SMS", request.param)


def test_cublaslt_available_here():
    ok, why = cublaslt.available()
    assert ok, why


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_ltlinear_into_column_slice_equals_f_linear(dtype, bias):
    """D = X @ W^T (+ b) written into columns [256, 256 + n) of a wider output, the other columns untouched."""
    g = torch.Generator().manual_seed(1)
    m, n, k, wide = 300, 384, 320, 1024
    x = torch.randn(m, k, generator=g).to(DEV, dtype)
    w = torch.randn(n, k, generator=g).to(DEV, dtype) * 0.1
    b = torch.randn(n, generator=g).to(DEV, dtype) if bias else None
    out = torch.full((m, wide), 7.0, dtype=dtype, device=DEV)
    lt = cublaslt.LtLinear(m, n, k, k, k, wide, dtype, torch.device(DEV), bias, 256)
    lt(x.data_ptr(), w.data_ptr(), out.data_ptr() + 256 * out.element_size(), torch.cuda.current_stream().cuda_stream,
       b.data_ptr() if bias else None)
    ref = F.linear(x.float(), w.float(), b.float() if bias else None)
    assert _rel(out[:, 256:256 + n], ref) < 4e-3
    assert (out[:, :256] == 7).all() and (out[:, 256 + n:] == 7).all()


@pytest.mark.parametrize("m,n,k", [(1100, 1000, 320), (1024, 384, 2560), (1030, 130, 48)])
@pytest.mark.parametrize("bias", [True, False])
def test_slabs_matches_dequant_path(small_slabs, m, n, k, bias):
    layer = _layer(n, k, bias, seed=m + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3)).to(DEV, torch.bfloat16)
    ref = _ref(layer, x)
    assert len(L.slab_bounds(n, k, L.l2_bytes(x.device))) == -(-n // 128)
    layer.fidelity_kernel = "dequant"
    e_dq = _rel(layer(x), ref)
    layer.fidelity_kernel = "slabs"
    layer._plans.clear()
    assert layer._fidelity_kernel_for(x) == "slabs"
    y1 = layer(x)                 # full forward
    y2 = layer(x)                 # launch plan
    assert any(p is not None for p in layer._plans.values()), "no launch plan was made for the slabs kernel"
    assert torch.equal(y1, y2)
    assert _rel(y1, ref) <= e_dq * 1.05 + 1e-6, (_rel(y1, ref), e_dq)


def test_auto_picks_slabs_for_large_m_only(small_slabs):
    layer = _layer(512, 256, True)
    big = torch.randn(L.SLABS_MIN_M, 256, device=DEV, dtype=torch.bfloat16)
    small = torch.randn(L.FUSED_MAX_M + 1, 256, device=DEV, dtype=torch.bfloat16)
    assert layer._fidelity_kernel_for(big) == "slabs"
    assert layer._fidelity_kernel_for(small) == "dequant"
    with torch.enable_grad():
        assert layer._fidelity_kernel_for(big.clone().requires_grad_()) == "dequant"   # no autograd through ctypes


def test_one_slab_is_the_dequant_kernel():
    layer = _layer(256, 256, True)            # 128 KB of bf16: one slab on any GPU
    x = torch.randn(2048, 256, device=DEV, dtype=torch.bfloat16)
    assert layer._fidelity_kernel_for(x) == "dequant"


def test_misaligned_input_falls_back_and_stays_correct(small_slabs):
    layer = _layer(512, 256, True)
    base = torch.randn(1024 * 256 + 1, device=DEV, dtype=torch.bfloat16)
    x = base[1:].view(1024, 256)              # 2-byte aligned only
    layer.fidelity_kernel = "slabs"
    for _ in range(2):
        assert _rel(layer(x), _ref(layer, x)) < 4e-3


def test_bias_storage_repointed_between_calls(small_slabs):
    """Block swap re-points ``bias.data`` at another buffer between calls: the plan must read the new pointer."""
    layer = _layer(512, 256, True)
    layer.fidelity_kernel = "slabs"
    x = torch.randn(1024, 256, device=DEV, dtype=torch.bfloat16)
    layer(x)
    layer(x)
    layer.bias.data = layer.bias.data.clone() + 1.0
    assert any(p is not None for p in layer._plans.values())
    assert _rel(layer(x), _ref(layer, x)) < 4e-3


def test_slabs_under_cuda_graph(small_slabs):
    layer = _layer(640, 320, True)
    layer.fidelity_kernel = "slabs"
    x = torch.randn(1024, 320, device=DEV, dtype=torch.bfloat16)
    want = layer(x).clone()
    layer(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        layer(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = layer(x)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, want)
