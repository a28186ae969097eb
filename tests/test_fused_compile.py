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
