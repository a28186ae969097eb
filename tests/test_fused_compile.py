"""Offline sm_90 compile of the fused Triton kernels (no GPU needed: Triton ships LLVM and ptxas): they
compile for Hopper, use no local memory (no spills to the stack) and move data with 16-byte global
accesses (v4.b32) where the layout allows. Skips when Triton or its NVIDIA backend is absent."""
import importlib.util
import re
from collections import Counter

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


def _compile(fn, sig, consts, num_warps=4, div16=()):
    """``div16``: integer arguments that a launch specialises as multiples of 16 (Triton does that for any
    int argument that is one, e.g. D = 3072 or 2560)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(sig.items()) if t.startswith("*") or n in div16}
    try:
        c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    except (ImportError, AttributeError, TypeError) as exc:  # another Triton API / no NVIDIA backend
        pytest.skip(f"offline compile unavailable: {type(exc).__name__}: {exc}")
    ptx = c.asm["ptx"]
    return ptx, Counter(re.findall(r"(?:ld|st)\.global[.a-z0-9:]*", ptx))


@pytest.mark.parametrize("split", [False, True])
def test_qkv_v2_v3_compile_with_16_byte_rows(split):
    from seedvr2bw.optimization.fused import kernels as k

    sig = {"QKV": "*bf16", "SRC": "*i64", "DST": "*i64", "WQ": "*bf16", "WK": "*bf16", "COS": "*fp32", "SIN": "*fp32",
           "OUT": "*bf16", "N_ALL": "i32", "H": "i32", "R2": "i32", "eps": "fp32", "D": "constexpr",
           "HAS_ROPE": "constexpr", "HAS_SRC": "constexpr", "BLOCK_H": "constexpr", "SPLIT": "constexpr"}
    ptx, ops = _compile(k.qkv_pack_kernel_v2, sig, {"D": 128, "HAS_ROPE": True, "HAS_SRC": True, "BLOCK_H": 32, "SPLIT": split})
    assert ".local" not in ptx
    assert ops["st.global.v4.b32"] > 0 and not ops["st.global.b16"], ops
    assert ops["ld.global.v4.b32"] > 0, ops


def test_norm_modulate_compiles_with_16_byte_rows():
    from seedvr2bw.optimization.fused import kernels as k

    sig = {"X": "*bf16", "O": "*bf16", "G": "*fp32", "XOUT": "*bf16", "Y": "*bf16", "S": "*fp32", "B": "*fp32",
           "SID": "*i32", "D": "i32", "eps": "fp32", "HAS_RES": "constexpr", "HAS_SID": "constexpr", "BLOCK_D": "constexpr"}
    ptx, ops = _compile(k.norm_mod_kernel, sig, {"HAS_RES": True, "HAS_SID": True, "BLOCK_D": 4096}, num_warps=8,
                        div16=("D",))
    assert ".local" not in ptx
    assert set(ops) <= {"ld.global.v4.b32", "st.global.v4.b32", "ld.global.b32"}, ops


def _ints(*names):
    return {n: "i32" for n in names}


def test_vae_channels_last_kernels_compile_with_16_byte_rows():
    # the VAE's channels-last passes at 128 channels (a multiple of 16, as every width of the model but its 3-channel
    # ends): the bias add and the residual read and write 16 bytes at a time, into a dense output or a strided one
    # (a conv's padded input); GroupNorm apply and depth-to-space compile with their edge-frame stores
    from seedvr2bw.optimization.fused import vae_kernels as vk

    tile = {"BLOCK_R": 32, "BLOCK_C": 128}
    sig = {"Y": "*bf16", "B": "*bf16", **_ints("NROWS", "C"), "BLOCK_R": "constexpr", "BLOCK_C": "constexpr"}
    ptx, ops = _compile(vk._bias_add_kernel, sig, tile, div16=("C",))
    assert ".local" not in ptx and ops["ld.global.v4.b32"] and ops["st.global.v4.b32"], ops
    sig = {"H": "*bf16", "X": "*bf16", "B": "*bf16", "XB": "*bf16", "OUT": "*bf16",
           **_ints("NROWS", "C", "HW", "WIDTH", "T", "OB", "OT", "OH"),
           **{n: "constexpr" for n in ("HAS_XB", "STRIDED", "BLOCK_R", "BLOCK_C")}}
    for strided in (False, True):
        ptx, ops = _compile(vk._residual_bias_kernel, sig, {"HAS_XB": True, "STRIDED": strided, **tile},
                            div16=("C", "OB", "OT", "OH"))
        assert ".local" not in ptx and ops["st.global.v4.b32"], (strided, ops)
    sig = {"H": "*bf16", "X": "*bf16", "B": "*bf16", "XB": "*fp32", "OUT": "*bf16", "PART": "*fp32",
           **_ints("HW", "C", "NBLK", "ROWS"), **{n: "constexpr" for n in ("HAS_XB", "SUB", "BLOCK_C")}}
    ptx, ops = _compile(vk._residual_moments_kernel, sig, {"HAS_XB": True, "SUB": 32, "BLOCK_C": 128},
                        div16=("C", "HW"))
    assert ".local" not in ptx and ops["ld.global.v4.b32"] and ops["st.global.v4.b32"], ops
    sig = {n: "*bf16" for n in ("X", "IN_B", "Y")}
    sig.update({"MEAN": "*fp32", "RSTD": "*fp32", "W": "*bf16", "BIAS": "*bf16",
                **_ints("HW", "WIDTH", "T", "C", "CG", "G", "YB", "YT", "YH", "HEAD"), "K": "*bf16",
                **_ints("K0", "KB", "KT", "KH"),
                **{n: "constexpr" for n in ("SILU", "HAS_IN_B", "HAS_K", "BLOCK_R", "BLOCK_C")}})
    ptx, ops = _compile(vk._gn_cl_apply_kernel, sig, {"SILU": True, "HAS_IN_B": True, "HAS_K": True, **tile},
                        div16=("C", "YB", "YT", "YH", "KB", "KT", "KH"))
    assert ".local" not in ptx and ops["st.global.v4.b32"], ops
    sig = {"Y": "*bf16", "B": "*bf16", "OUT": "*bf16",
           **_ints("HW", "WIDTH", "T", "CR", "C", "S", "RT", "OB", "OT", "OH", "HEAD"), "K": "*bf16",
           **_ints("K0", "KB", "KT", "KH"),
           **{n: "constexpr" for n in ("DROP", "HAS_B", "HAS_K", "BLOCK_P", "BLOCK_C")}}
    consts = {"DROP": True, "HAS_B": True, "HAS_K": True, "BLOCK_P": 32, "BLOCK_C": 128}
    ptx, ops = _compile(vk._depth_to_space_kernel, sig, consts, div16=("C", "CR", "OB", "OT", "OH", "KB", "KT", "KH"))
    assert ".local" not in ptx and ops["st.global.v4.b32"], ops


def test_softmax_split_compiles():
    # the VAE attention's row pass: float32 scores in, two bf16 parts out, no spills
    from seedvr2bw.optimization.fused import vae_kernels as vk

    sig = {"S": "*fp32", "HL": "*bf16", "L": "*fp32", "N": "i32", "SCALE": "fp32", "BLOCK": "constexpr"}
    ptx, ops = _compile(vk._softmax_split_kernel, sig, {"BLOCK": 2048}, num_warps=8, div16=("N",))
    assert ".local" not in ptx and ops["ld.global.v4.b32"], ops
