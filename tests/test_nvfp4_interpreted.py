"""CPU checks of the NVFP4 Triton kernels through the Triton interpreter (TRITON_INTERPRET=1), on small shapes,
against the exact CPU reference (``format.py``). The same kernels run on the GPU in ``tests/gpu/test_nvfp4_gpu.py``;
here their index math, masks, swizzled-scale offsets, split-K and epilogues are exercised on every CI run.

Two limits of the interpreter shape these checks (Triton 3.x):
* a float32 -> bfloat16 cast truncates instead of rounding to nearest even, so bit-exact outputs are compared in
  float32 (the dequantize kernel) and the fused W4A16 kernel, whose MMA operand is cast to the activation dtype
  inside the kernel, is run with float16 activations (bf16 there gives garbage under the interpreter only);
* a float32 -> E4M3 cast can lose the carry into the exponent when it rounds up (a scale of 127.9 became 64), so
  the activation checks build inputs whose scales (NVFP4) and quotients (FP8) are exact E4M3 values (no rounding
  in that cast; the GPU tests cover the rounding);
* inline PTX cannot run, so the kernels take their arithmetic decode (``ASM_DECODE`` is off when interpreting).
Each check runs in a subprocess so that the flag is set before Triton is imported."""
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from triton_interpreter import needs_triton, pack_prelude, run_checked, skip_unless_loops_run  # noqa: E402

pytestmark = needs_triton

_PRELUDE = pack_prelude("from seedvr2bw.optimization.nvfp4 import format as fmt, kernels as K") + textwrap.dedent("""
    def rnd(*s, scale=1.0):
        return torch.randn(*s, generator=gen) * scale
    def u8(t):
        return t.view(torch.uint8) if t.dtype != torch.uint8 else t
""")


@pytest.fixture(scope="module", autouse=True)
def interpreter_runs_loops():
    skip_unless_loops_run()


def _run(body: str) -> str:
    return run_checked(_PRELUDE + textwrap.dedent(body), timeout=900)


def test_dequant_kernel_interpreted_bit_exact():
    """Whole weights (rows and K not multiples of the tile, K not a multiple of 64) and column ranges."""
    out = _run("""
        for n, k in [(70, 96), (200, 336), (129, 1008)]:
            w = rnd(n, k) * torch.rand(n, 1, generator=gen) * 4
            w[0] = 0
            w[1, :16] = 2.5
            t = fmt.quantize_nvfp4(w, return_tensor=True)
            got = K.dequantize_nvfp4_triton(t.packed, t.block_scale, t.global_scale, t.shape, torch.float32)
            assert torch.equal(got, t.dequantize(torch.float32)), (n, k)
            full = torch.nn.functional.pad(t.dequantize(torch.float32), (0, t.packed.shape[1] * 2 - k))
            for c0, c1 in [(16, 96), (0, 48), (32, t.packed.shape[1] * 2)]:
                got = K.dequantize_nvfp4_triton(t.packed, t.block_scale, t.global_scale, (n, c1 - c0),
                                                torch.float32, col0=c0)
                assert torch.equal(got, full[:, c0:c1]), (n, k, c0, c1)
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_fp8_copy_of_nvfp4_weights_interpreted_bit_exact():
    """The FP8 copy the fp8_speed path derives (bf16 passes over the dequantize kernel) equals the fp32 reference
    bit for bit: rows of very different magnitudes (row exponents from -100 to above 0), a zero row, a row whose
    maximum lands exactly on 448 after scaling, K not a multiple of 64."""
    out = _run("""
        for n, k in [(70, 96), (129, 1008)]:
            w = rnd(n, k) * torch.exp2(torch.randint(-30, 12, (n, 1), generator=gen).float())
            w[0] = 0
            w[1, :16] = 448.0 * 6
            t = fmt.quantize_nvfp4(w, return_tensor=True)
            q, s = K.nvfp4_to_fp8_rowwise_triton(t.packed, t.block_scale, t.global_scale, t.shape)
            rq, rs = fmt.nvfp4_to_fp8_rowwise(t)
            assert q.dtype == rq.dtype and torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), (n, k)
            assert torch.equal(s, rs), (n, k)
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_activation_quantizers_interpreted_bit_exact():
    """The fused-path activation quantizers: NVFP4 (padded swizzled scales, row chunks) and FP8 per row."""
    out = _run("""
        g = torch.tensor(2.0 ** -6)
        for m, k in [(1, 16), (37, 96), (130, 48)]:
            # each block: random values with amax exactly 6 * g * v, v an E4M3 value (v = 448 somewhere, so the
            # global scale amax / (6 * 448) is g): every block scale is exact
            r = rnd(m, k // 16, 16)
            r = r / r.abs().amax(-1, keepdim=True)
            v = torch.randint(0, 127, (m, k // 16), generator=gen).to(torch.uint8).view(torch.float8_e4m3fn).float()
            v[0, 0] = 448.0
            x = (r * (6 * g * v).unsqueeze(-1)).reshape(m, k).to(torch.bfloat16)
            if m > 1:
                x[-1, :16] = 0                    # an all-zero block
            assert fmt.global_scale_for(x) == g
            q, s = K.quantize_act_nvfp4(x, g, chunk_rows=128)
            pr, sr, _ = fmt.quantize_nvfp4(x, g, pad_rows=1)
            assert torch.equal(q, pr) and torch.equal(u8(s), u8(sr)), (m, k)
        for m, k in [(1, 32), (33, 100)]:
            # E4M3 values times 2^-3, 448 in every row: the row scale is 2^-3 and every quotient an E4M3 value
            v = torch.randint(0, 127, (m, k), generator=gen).to(torch.uint8).view(torch.float8_e4m3fn).float()
            v = v * torch.where(torch.rand(m, k, generator=gen) < 0.5, -1.0, 1.0)
            v[:, k // 2] = 448.0
            x = (v * 2.0 ** -3).to(torch.bfloat16)
            if m > 1:
                x[-1] = 0
            q, s = K.quantize_act_fp8_rowwise(x)
            qr, sr = fmt.quantize_act_fp8_rowwise_reference(x)
            assert torch.equal(s, sr) and torch.equal(u8(q), u8(qr)), (m, k)
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_w4a16_swab_kernel_interpreted():
    """The fused W4A16 kernel: one tile, several tiles with M and N edges, split-K (partials + reduce), K not a
    multiple of BLOCK_K, bias; against the float64 product with the dequantized weight."""
    out = _run("""
        cases = [  # m, n, k, (BLOCK_N, BLOCK_M, BLOCK_K, SPLIT_K, warps, stages), bias
            (5, 64, 64, (64, 16, 64, 1, 4, 1), False),
            (40, 150, 192, (64, 32, 64, 3, 4, 1), True),
            (70, 130, 208, (64, 64, 128, 1, 4, 1), True),
        ]
        for m, n, k, cfg, bias in cases:
            t = fmt.quantize_nvfp4(rnd(n, k, scale=0.1), return_tensor=True)
            x = rnd(m, t.packed.shape[1] * 2).to(torch.float16)
            b = rnd(n).to(torch.float16) if bias else None
            want = x.double() @ t.dequantize().double().t() + (b.double() if bias else 0)
            got = K.w4a16_linear(x, t.packed, t.block_scale, t.global_scale, n, b, config=cfg)
            assert got.dtype == torch.float16 and got.shape == (m, n)
            err = ((got.double() - want).norm() / want.norm()).item()
            assert err < 2e-3, (m, n, k, cfg, err)
        print("ok")
    """)
    assert out.strip().endswith("ok")
