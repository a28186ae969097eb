"""The INT8 ConvRot layer's fused Triton kernels (``optimization/nvfp4/int8_kernels.py``) on the CPU through the Triton
interpreter (TRITON_INTERPRET=1), against the torch reference of ``int8.py``; the same kernels run on a GPU in
``tests/gpu/test_int8_gpu.py``.

The bound: the rotate+quantize kernel sums ``x_g @ H`` in float32 in another order than torch's matmul, so a rotated
value can round to a neighbouring bf16 / fp16 value and its int8 code move by one. Measured here (interpreter vs
torch CPU, 2000 x 3072 rows of mixed magnitudes, groups 16 / 64 / 256): 0 to 3 codes of 6.1 M off by one (at most
4.9e-7 of them), no scale different; on the small cases below, none. The tests allow codes off by at most one, at
most 1e-4 of them, and equal scales; the rescale epilogue is the reference expression bit for bit, so the layer's
output is ``dequantize_product`` of the kernel's own codes exactly, and within 1e-3 (relative norm) of
``int8_linear``, the error 1e-4 of the codes off by one would give (the int8 quantization itself: ~1.3e-2).

Each check runs in a subprocess so that the flag is set before Triton is imported."""
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from triton_interpreter import needs_triton, pack_prelude, run_checked, skip_unless_loops_run  # noqa: E402

pytestmark = needs_triton

_PRELUDE = pack_prelude("from seedvr2bw.optimization.nvfp4 import int8 as I8, int8_kernels as K8") + textwrap.dedent("""
    def rows_of_mixed_size(m, k, dtype):
        x = torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-6, 6, (m, 1), generator=gen).float())
        return (x * torch.exp2(torch.randint(-3, 3, (m, k), generator=gen).float())).to(dtype)
    def rel(a, b):
        a, b = a.double(), b.double()
        return float((a - b).norm() / b.norm())
""")


@pytest.fixture(scope="module", autouse=True)
def interpreter_runs_loops():
    skip_unless_loops_run()


def _run(body: str) -> str:
    return run_checked(_PRELUDE + textwrap.dedent(body), timeout=600)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_rotate_quantize_kernel_matches_quantize_rows_of_rotate(dtype):
    """Rows not a multiple of the tile (both tile configurations), K = 256 k for k = 1, 2, 3 and groups of 16 and
    64; a zero row, a row whose scale underflows fp16 (the reference's smallest-normal fallback), a row of equal
    values (ties in the division)."""
    out = _run(f"""
        dt = torch.{dtype}
        off_codes = total = 0
        for m, k, g in [(37, 256, 256), (21, 512, 256), (70, 768, 256), (19, 128, 64), (18, 64, 16)]:
            x = rows_of_mixed_size(m, k, dt)
            x[0] = 0
            x[1] = 1e-7
            x[2] = 0.75
            h = I8.hadamard(g, "cpu", dt)
            rq, rs = I8.quantize_rows(I8.rotate(x, g))
            for config in K8.ROTATE_QUANT_CONFIGS:
                q, s = K8.rotate_quantize(x, h, config)
                assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (m, 1)
                assert torch.equal(s, rs), (m, k, g, config)
                d = (q.int() - rq.int()).abs()
                assert d.max() <= 1, (m, k, g, config)
                off_codes += int((d > 0).sum())
                total += d.numel()
        assert off_codes <= 1e-4 * total, off_codes
        print("off", off_codes, "of", total)
    """)
    assert "off" in out


def test_rescale_kernel_is_the_reference_expression_bit_for_bit():
    """int32 sums up to 2^30 (rounded when converted to float32), rows strided (the slice ``int_mm`` returns for
    padded rows), tiles cut at both edges, bias or none, a scalar weight scale, an fp16 output overflowing to inf."""
    out = _run("""
        for dt in (torch.bfloat16, torch.float16):
            for m, n, bias in [(5, 72, True), (45, 200, False), (33, 136, True)]:
                acc = torch.randint(-2 ** 30, 2 ** 30, (m + 7, n + 8), generator=gen, dtype=torch.int32)[:m, :n]
                acc[0, :8] = torch.tensor([0, 1, -1, 2 ** 24 + 1, -(2 ** 24 + 3), 2 ** 31 - 1, -2 ** 31, 7])
                sx = torch.rand(m, 1, generator=gen) * 1e-6
                sw = torch.rand(n, 1, generator=gen) * 1e-3
                b = (torch.randn(n, generator=gen) * 100).to(dt) if bias else None
                want = I8.dequantize_product(acc, sx, sw, b, dt)
                got = K8.rescale(acc, sx, sw, b, dt)
                assert got.dtype == dt and torch.equal(got, want), (dt, m, n, bias)
            one = torch.tensor(3e-4)
            assert torch.equal(K8.rescale(acc, sx, one, None, dt), I8.dequantize_product(acc, sx, one, None, dt))
        big = torch.full((3, 8), 2 ** 30, dtype=torch.int32)
        y = K8.rescale(big, torch.ones(3, 1), torch.ones(8), None, torch.float16)
        assert torch.equal(y, I8.dequantize_product(big, torch.ones(3, 1), torch.ones(8), None, torch.float16))
        assert torch.isinf(y).all()
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_int8_layer_takes_the_fused_kernels_within_the_bound():
    """Under the interpreter the layer's decision is ``int8_int_mm`` (its fused self-test passes), and its output
    is ``dequantize_product`` of the kernel's codes exactly and within 1e-3 of ``int8_linear`` (here: identical),
    for few rows (padded for ``_int_mm``) and many, bf16 and fp16."""
    out = _run("""
        torch.manual_seed(0)
        for dt in (torch.bfloat16, torch.float16):
            layer = I8.Int8Linear.from_linear(torch.nn.Linear(512, 72).to(dt), convrot_group=256)
            for shape in ((3, 40, 512), (5, 512)):
                x = torch.randn(*shape).to(dt)
                x2 = x.reshape(-1, 512)
                d = layer.decision(x2)
                assert d.kernel == "int8_int_mm", d
                y = layer(x)
                assert y.shape == shape[:-1] + (72,) and y.dtype == dt
                xq, sx = K8.rotate_quantize(x2, I8.hadamard(256, "cpu", dt))
                own = I8.dequantize_product(I8.int_matmul(xq, layer.weight), sx, layer.weight_scale, layer.bias, dt)
                assert torch.equal(y.reshape(own.shape), own)
                want = I8.int8_linear(x2, layer.weight, layer.weight_scale, layer.bias, 256)
                assert rel(y.reshape(want.shape), want) <= 1e-3
                print("identical" if torch.equal(y.reshape(want.shape), want) else "within the bound")
    """)
    assert out.split() == ["identical"] * 4


def test_a_failed_fused_selftest_falls_back_to_torch_ops_with_its_reason():
    """A fused kernel that returns wrong codes fails the self-test; the layer logs why once and runs the torch steps
    around ``_int_mm`` (``int8_int_mm_eager``), bit-identical to the reference."""
    out = _run("""
        import logging
        logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
        right = K8.rotate_quantize
        def wrong(x, h, config=None):
            q, s = right(x, h, config)
            return q // 2, s
        K8.rotate_quantize = wrong
        ok, why = I8.fused_selftest("cpu")
        assert not ok and "codes" in why, why
        layer = I8.Int8Linear.from_linear(torch.nn.Linear(512, 40).to(torch.bfloat16), convrot_group=256)
        x = torch.randn(24, 512).to(torch.bfloat16)
        d = layer.decision(x)
        assert d.kernel == "int8_int_mm_eager" and "failed their self-test" in d.reason, d
        assert torch.equal(layer(x), I8.int8_linear(x, layer.weight, layer.weight_scale, layer.bias, 256))
        layer(x)
        print("done")
    """)
    lines = out.strip().splitlines()
    assert lines[-1] == "done"
    warned = [line for line in lines if "fused Triton kernels not used" in line]
    assert len(warned) == 1 and "codes" in warned[0], out
