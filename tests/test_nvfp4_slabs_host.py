"""Host-side logic of the NVFP4 fidelity path's "slabs" kernel: slab boundaries, alignment, the kernel choice
off CUDA. The kernel itself runs in tests/gpu/test_nvfp4_slabs_gpu.py."""
import pytest
import torch

from seedvr2bw.optimization.nvfp4 import cublaslt
from seedvr2bw.optimization.nvfp4 import format as fmt
from seedvr2bw.optimization.nvfp4 import linear as L
from seedvr2bw.optimization.nvfp4.linear import NVFP4Linear

MB = 1 << 20


@pytest.mark.parametrize("n,k,l2", [(12288, 3072, 50 * MB), (3072, 12288, 50 * MB), (6912, 2560, 96 * MB),
                                    (130, 48, 50 * MB), (3072, 3072, 2 * MB), (1000, 320, 1)])
@pytest.mark.parametrize("fraction", [0.125, 0.25, 0.5])
def test_slab_bounds_cover_rows_in_l2_sized_slabs(n, k, l2, fraction):
    b = L.slab_bounds(n, k, l2, 2, fraction)
    assert b[0][0] == 0 and b[-1][1] == n
    assert all(b[i][1] == b[i + 1][0] for i in range(len(b) - 1))           # contiguous, no overlap
    rows = b[0][1] - b[0][0]
    assert all(n0 % 128 == 0 for n0, _ in b)                                 # the scale layout's row groups
    assert all(n1 - n0 == rows for n0, n1 in b[:-1]) and 0 < b[-1][1] - b[-1][0] <= rows
    if rows > 128:
        assert rows * k * 2 <= l2 * fraction                                 # a slab fits its share of L2
    assert rows == 128 or (rows + 128) * k * 2 > l2 * fraction or rows >= n  # and is as large as allowed


def test_slab_bounds_h100_mlp_shapes():
    # 50 MiB L2, a quarter each: 3072-wide K -> 2048 rows (12 MiB), 12288-wide K -> 512 rows
    assert [r1 - r0 for r0, r1 in L.slab_bounds(12288, 3072, 50 * MB, 2, 0.25)] == [2048] * 6
    assert [r1 - r0 for r0, r1 in L.slab_bounds(3072, 12288, 50 * MB, 2, 0.25)] == [512] * 6


@pytest.mark.parametrize("values,want", [((512, 6144), 256), ((96, 96, 260), 4), ((2,), 2), ((3,), 1),
                                         ((256 * 7, 16 * 3), 16)])
def test_alignment_of(values, want):
    assert cublaslt.alignment_of(*values) == want


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU answer")
def test_cublaslt_unavailable_without_cuda_says_why():
    ok, why = cublaslt.available()
    assert not ok and "CUDA" in why


def test_cublaslt_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("SEEDVR2BW_CUBLASLT", "0")
    assert cublaslt.available() == (False, "SEEDVR2BW_CUBLASLT=0")


def test_slabs_kernel_off_cuda_is_the_dequant_kernel():
    g = torch.Generator().manual_seed(0)
    t = fmt.quantize_nvfp4(torch.randn(384, 64, generator=g), return_tensor=True)
    layer = NVFP4Linear.from_nvfp4(t, bias=torch.randn(384, generator=g), path="fidelity")
    layer.fidelity_kernel = "slabs"
    x = torch.randn(L.SLABS_MIN_M, 64, generator=g, dtype=torch.bfloat16)
    assert layer._fidelity_kernel_for(x) == "dequant"
    layer.fidelity_kernel = "dequant"
    want = layer(x)
    layer.fidelity_kernel = "slabs"
    assert torch.equal(layer(x), want)
