"""INT8 ConvRot on a CUDA GPU: the fused Triton kernels (``optimization/nvfp4/int8_kernels.py``) against the torch
reference of ``int8.py`` on the 7B DiT's shapes, and ``Int8Linear`` on ``torch._int_mm`` between them.

The bound (why, and the CPU measurement behind it: ``tests/test_int8_fused.py``): the kernel's codes within one of
``quantize_rows(rotate(x))``, at most 1e-4 of them off; its scales equal on all but 1e-3 of the rows, and there
within a bf16 step; the rescale epilogue, and so the layer's output given the kernel's codes, bit for bit; the
layer within 1e-3 (relative norm) of ``int8_linear`` with the exact float64 product.

Needs a CUDA device (skips otherwise) and Triton."""
import pytest
import torch

from seedvr2bw.optimization.nvfp4 import int8 as I8
from seedvr2bw.optimization.nvfp4 import int8_kernels as K8

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(not K8.HAS_TRITON, reason="needs Triton")]
DEV = "cuda"
MAX_CODES_OFF = 1e-4
MAX_ROWS_RESCALED = 1e-3
MAX_REL_ERR = 1e-3


def _activations(m, k, dtype, seed):
    """Rows of different magnitudes (2^-6 .. 2^5), as a DiT's tokens have; a zero row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-6, 6, (m, 1), generator=g).float())
    x[0] = 0
    return x.to(dtype).to(DEV)


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _reference_codes(x):
    """``quantize_rows(rotate(x))`` on the CPU, comfy-kitchen's eager steps (cuBLAS may reduce bf16 sums in bf16)."""
    return I8.quantize_rows(I8.rotate(x.cpu(), 256))


@pytest.mark.parametrize("dtype,m,k", [(torch.bfloat16, 4096, 3072), (torch.bfloat16, 4096, 12288),
                                       (torch.bfloat16, 77, 3072), (torch.bfloat16, 5, 3072),
                                       (torch.float16, 4096, 3072), (torch.float16, 77, 12288)])
def test_rotate_quantize_kernel_matches_the_reference(dtype, m, k):
    x = _activations(m, k, dtype, m + k)
    q, s = (t.cpu() for t in K8.rotate_quantize(x, I8.hadamard(256, DEV, dtype)))
    rq, rs = _reference_codes(x)
    d = (q.int() - rq.int()).abs()
    assert d.max().item() <= 1
    assert (d > 0).float().mean().item() <= MAX_CODES_OFF
    rescaled = (s != rs).squeeze(1)
    assert rescaled.float().mean().item() <= MAX_ROWS_RESCALED
    assert torch.allclose(s, rs, rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,bias", [(4096, True), (4096, False), (5, True)])
def test_rescale_epilogue_is_the_reference_expression_bit_for_bit(m, bias, dtype):
    """The int32 product of real codes (``int_mm``; few rows come back as a strided slice of the padded product)."""
    g = torch.Generator().manual_seed(m)
    n, k = 12288, 3072
    a = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8).to(DEV)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8).to(DEV)
    acc = I8.int_mm(a, w)
    sx = (torch.rand(m, 1, generator=g) * 1e-2).to(DEV)
    sw = (torch.rand(n, 1, generator=g) * 1e-4).to(DEV)
    b = torch.randn(n, generator=g).to(dtype).to(DEV) if bias else None
    assert torch.equal(K8.rescale(acc, sx, sw, b, dtype), I8.dequantize_product(acc, sx, sw, b, dtype))


@pytest.mark.parametrize("m", [1, 16, 17, 4096])
def test_int8_layer_runs_the_fused_kernels_within_the_bound(m):
    """INT8 ConvRot layers take ``int8_int_mm`` on this GPU (both self-tests pass); the output is the rescaled exact
    product of the kernel's own codes bit for bit, and within ``MAX_REL_ERR`` of ``int8_linear`` (its codes from the
    CPU, the exact product and the same float32 rescale here)."""
    torch.manual_seed(0)
    layer = I8.Int8Linear.from_linear(torch.nn.Linear(3072, 12288).to(torch.bfloat16), convrot_group=256).to(DEV)
    x = _activations(m, 3072, torch.bfloat16, m)
    assert I8.int_mm_selftest(DEV) == (True, "")
    assert I8.fused_selftest(DEV) == (True, "")
    assert layer.decision(x).kernel == "int8_int_mm"
    y = layer(x)
    xq, sx = K8.rotate_quantize(x, I8.hadamard(256, DEV, torch.bfloat16))
    own = I8.dequantize_product(I8.int_matmul(xq, layer.weight), sx, layer.weight_scale, layer.bias, torch.bfloat16)
    assert torch.equal(y, own)
    rq, rs = _reference_codes(x)
    want = I8.dequantize_product(I8.int_mm(rq.to(DEV), layer.weight), rs.to(DEV), layer.weight_scale, layer.bias,
                                 torch.bfloat16)
    assert _rel(y, want) <= MAX_REL_ERR
