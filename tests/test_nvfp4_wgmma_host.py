"""CPU checks of the sm_90a wgmma W4A16 kernel's integer tricks (optimization/nvfp4/w4a16_wgmma.cu): the PRMT/shift
decode and the E4M3 scale conversion are emulated bit for bit (PTX semantics of prmt, shifts, masks, one
bf16 multiply) and compared with the format's reference for every code; one thread's 16 wgmma A registers are
rebuilt for every thread of a warpgroup and compared with the dequantized tile at their fragment positions.
The kernel itself runs in tests/gpu/test_nvfp4_wgmma_gpu.py; nvcc (when present) compiles every shipped config
here and ptxas must report no spills and no serialized wgmma."""
import ctypes
import struct

import pytest
import torch

from sm90_compile import assert_no_spills_or_serialized_wgmma, needs_nvcc, nvcc_report, nvrtc_report
from seedvr2bw.optimization.nvfp4 import format as fmt
from seedvr2bw.optimization.nvfp4 import wgmma_w4a16 as W

M32 = 0xFFFFFFFF


def prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode): output byte i = byte (sel nibble i & 7) of [a, b]; nibble bit 3 replicates
    that byte's sign bit."""
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = pool[nib & 7]
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def bf16(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def halves(word: int) -> tuple[float, float]:
    return bf16(word), bf16(word >> 16)


def e2m1x2(q: int, b: int) -> int:
    q4 = (q << 4) & M32
    z = prmt(q, q4, b | ((b | 8) << 4) | ((b + 4) << 8) | (((b + 4) | 8) << 12))
    return ((z << 2) & M32) & 0x81C081C0


def scale_pair(s: int) -> tuple[float, float]:
    lo, hi = halves((prmt(s, 0, 0x4140) << 4) & M32)
    return lo * 2.0 ** 118 * 2.0 ** 118, hi * 2.0 ** 118 * 2.0 ** 118


def bf16_exact(v: float) -> bool:
    return float(torch.tensor(v, dtype=torch.float64).to(torch.bfloat16)) == v


E2M1 = fmt.E2M1_VALUES


def _signed_e2m1(code: int) -> float:
    v = E2M1[code & 15]
    return -abs(v) if code & 8 else v


def test_e2m1_decode_every_byte_in_every_position():
    """Low half = the high nibble (the even k), high half = the low nibble, each E2M1 value x 2^-126, signs
    (and -0) included, whatever the other bytes of the word hold."""
    gen = torch.Generator().manual_seed(0)
    for byte in range(256):
        for pos in range(4):
            others = torch.randint(0, 256, (4,), generator=gen).tolist()
            others[pos] = byte
            q = sum(v << (8 * i) for i, v in enumerate(others))
            lo, hi = halves(e2m1x2(q, pos))
            want_lo, want_hi = _signed_e2m1(byte >> 4), _signed_e2m1(byte & 15)
            assert lo == want_lo * 2.0 ** -126 and hi == want_hi * 2.0 ** -126, (byte, pos)
            assert struct.pack("<f", lo)[3] & 0x80 == (0x80 if byte & 0x80 else 0)      # sign bit, -0 too
            assert struct.pack("<f", hi)[3] & 0x80 == (0x80 if byte & 0x08 else 0)


def test_scale_conversion_every_e4m3_code_and_exact_products():
    """code << 4 read as bf16 is scale x 2^-120 (subnormal scales included); x 2^118 twice = scale x 2^116, and
    (E2M1 x 2^-126) x (scale x 2^116) is the weight x 2^-10, exact in bf16 and never subnormal unless zero."""
    codes = list(range(0, 0x7F))                                   # every finite non-negative E4M3 code
    scales = torch.tensor(codes, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
    for i in range(0, len(codes), 2):
        c0, c1 = codes[i], codes[min(i + 1, len(codes) - 1)]
        f0, f1 = scale_pair(c0 | (c1 << 8) | (0xAB << 16) | (0xCD << 24))
        assert f0 == scales[i] * 2.0 ** 116 and f1 == scales[min(i + 1, len(codes) - 1)] * 2.0 ** 116
        for s in (scales[i],):
            assert bf16_exact(s * 2.0 ** -2) and bf16_exact(s * 2.0 ** 116)   # both multiplies exact
            for v in E2M1:
                prod = v * 2.0 ** -126 * s * 2.0 ** 116
                assert bf16_exact(prod)
                assert prod == 0 or abs(prod) >= 2.0 ** -126


def test_thread_fragments_rebuild_the_dequantized_tile():
    """Every thread of a warpgroup: its 16 A registers for one 64-row x 64-k tile (byte selection of chunk
    bytes c, decode, scale pairs, multiply) equal the tile's dequantized weight x 2^-10 at its wgmma fragment
    positions: a0 (r, 16s+2c..+1), a1 (r+8, ...), a2 (r, 16s+8+2c..+1), a3 (r+8, ...)."""
    gen = torch.Generator().manual_seed(1)
    n, k = 64, 64
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    codes = torch.randint(0, 0x7F, (n, k // 16), generator=gen, dtype=torch.uint8)
    t = fmt.NVFP4Tensor(packed, fmt.swizzle_block_scales(codes.view(torch.float8_e4m3fn)),
                        torch.tensor(1.0), (n, k))
    want = t.dequantize(torch.float32) * 2.0 ** -10
    row_bytes = packed.tolist()
    for tid in range(128):
        warp, lane = tid >> 5, tid & 31
        c, r0 = lane & 3, warp * 16 + (lane >> 2)
        sel = c | ((c + 4) << 4)
        regs = []
        for r in (r0, r0 + 8):
            words = [int.from_bytes(bytes(row_bytes[r][4 * j:4 * j + 4]), "little") for j in range(8)]
            q = [prmt(prmt(words[4 * h], words[4 * h + 1], sel), prmt(words[4 * h + 2], words[4 * h + 3], sel),
                      0x5410) for h in range(2)]
            sword = int.from_bytes(bytes(codes[r].tolist()), "little")
            pairs = [scale_pair(sword)[0], scale_pair(sword)[1], scale_pair(sword >> 16)[0],
                     scale_pair(sword >> 16)[1]]
            regs.append((q, pairs))
        for s in range(4):
            h, j = s >> 1, s & 1
            for reg, (ri, byte_in_word, koff) in enumerate([(0, 2 * j, 0), (1, 2 * j, 0), (0, 2 * j + 1, 8),
                                                           (1, 2 * j + 1, 8)]):
                q, pairs = regs[ri]
                lo, hi = halves(e2m1x2(q[h], byte_in_word))
                row = r0 + 8 * ri
                kk = 16 * s + koff + 2 * c
                assert lo * pairs[s] == want[row, kk].item(), (tid, s, reg)
                assert hi * pairs[s] == want[row, kk + 1].item(), (tid, s, reg)


def test_generated_wgmma_wrapper():
    src = W.wgmma_call(128)
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16" in src
    assert src.count('"+f"(d[') == 64 and '"+f"(d[63])' in src and "%64, %65, %66, %67}, %68, p" in src
    name, full = W.kernel_source(2, 256, 3, 1, True, False)
    assert name in full and "#define WG 2" in full and "#define SPLIT 1" in full and "//%%WGMMA%%" not in full
    assert W.smem_bytes(1, 128, 3) == 3 * 19456 + 1024
    # the kernel source (with the shared helpers) uses exactly the constants emulated above
    cu = W.kernel_source(1, 128, 3, 1, False, False)[1]
    for const in ("0x81C081C0u", "b | ((b | 8) << 4) | ((b + 4) << 8) | (((b + 4) | 8) << 12)", "(z << 2)",
                  "prmt(s, 0u, 0x4140u) << 4", "0x7A807A80u", "0x5410u", "0x1010u", "0x3232u",
                  "c | ((c + 4) << 4)", "qa[h] << 4"):
        assert const in cu, const


SHIPPED = [(1, 128, 3, W.default_min_blocks(1, 128), split, bias) for split in (False, True) for bias in (False, True)]


@needs_nvcc
@pytest.mark.parametrize("cfg", SHIPPED + [(2, 256, 3, 1, False, True), (1, 256, 3, 2, False, True),
                                 (2, 256, 5, 1, False, True), (2, 192, 4, 1, False, True), (2, 128, 4, 2, False, True)])
def test_compiles_for_sm90a_without_spills_or_serialized_wgmma(cfg, tmp_path):
    assert_no_spills_or_serialized_wgmma(nvcc_report(W.kernel_source(*cfg)[1], tmp_path))


@pytest.mark.parametrize("cfg", SHIPPED)
def test_nvrtc_compiles_without_spills_or_serialized_wgmma(cfg):
    """The compile users get (NVRTC: torch.cuda._compile_kernel)."""
    assert_no_spills_or_serialized_wgmma(nvrtc_report(W.kernel_source(*cfg)[1]))


def test_launch_arguments_outlive_their_builder():
    """The argument array holds addresses of ctypes values; a launch plan keeps only the array, so the values
    must stay alive with it (they were once freed, and the kernel then read garbage M / N / K)."""
    t = [torch.empty(64, dtype=torch.uint8) for _ in range(7)]
    x = torch.empty(3, 320, dtype=torch.bfloat16)
    vals, arr = W.Kernel.args(None, x, *t[1:], 300, 1024, 320, 5, 2)
    del vals
    churn = [ctypes.c_int(-1) for _ in range(20000)]              # would reuse freed value memory
    ints = [ctypes.cast(arr[i], ctypes.POINTER(ctypes.c_int)).contents.value for i in range(7, 13)]
    ptrs = [ctypes.cast(arr[i], ctypes.POINTER(ctypes.c_void_p)).contents.value for i in range(7)]
    assert ints == [300, 1024, 320, 320, 5, 2] and len(churn) == 20000
    assert ptrs == [x.data_ptr()] + [v.data_ptr() for v in t[1:]]


@pytest.mark.parametrize("wg,bm,stages", [(1, 128, 3), (1, 256, 3), (2, 128, 4), (2, 192, 4), (2, 256, 5),
                                          (4, 128, 5), (4, 64, 4), (1, 64, 4)])
def test_tiles_fit_the_sm(wg, bm, stages):
    """Shared memory of min_blocks CTAs (dynamic + the 1 KiB the mbarriers' static block is padded to) fits an
    sm_90 SM (228 KiB, 227 KiB per CTA), and the register budget __launch_bounds__ sets holds the accumulators."""
    minb = W.default_min_blocks(wg, bm)
    per_cta = W.smem_bytes(wg, bm, stages) + 1024
    assert per_cta <= 227 * 1024 and minb * (per_cta + 1024) <= 228 * 1024, (per_cta, minb)
    regs = 65536 // (128 * wg * minb)
    assert regs >= bm // 2 + 56, (regs, bm)
