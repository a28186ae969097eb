"""training/rope_kernel.py (FLUX RoPE as one Triton kernel), run by the Triton interpreter on CPU: equals the
torch rotation of flux_forward.rope_pairs_torch forward (sign +1) and backward (sign -1), batch-shared and per-sample angles."""
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


@needs_triton
def test_rope_kernel_matches_torch_rotation_interpreted():
    code = textwrap.dedent(f"""
        import os, sys
        os.environ["TRITON_INTERPRET"] = "1"
        sys.path.insert(0, {str(ROOT)!r})
        from pack_import import import_pack
        import_pack()
        import torch
        from seedvr2bw.training import rope_kernel as RK
        from seedvr2bw.training.flux_forward import rope_pairs_torch
        g = torch.Generator().manual_seed(0)
        for B, cb, H, L, D in ((1, 1, 3, 10, 16), (2, 2, 2, 7, 8), (2, 1, 1, 5, 4)):
            ang = torch.randn(cb, 1, L, D // 2, generator=g) * 3
            cos, sin = ang.cos(), ang.sin()
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(B, H, L, D, generator=g).to(dtype)
                assert RK.usable(x, cos)
                for sign in (1.0, -1.0):
                    got = RK.rope_pairs(x, cos, sin, sign)
                    want = rope_pairs_torch(x, cos, sin * sign)
                    assert got.dtype == dtype and got.shape == x.shape
                    tol = 1e-6 if dtype == torch.float32 else 1e-2
                    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol), (B, L, D, dtype, sign)
            xt = torch.randn(B, L, H, D, generator=g).transpose(1, 2)   # non-contiguous input
            assert torch.allclose(RK.rope_pairs(xt, cos, sin), rope_pairs_torch(xt, cos, sin), atol=1e-6)
        assert not RK.usable(torch.randn(1, 2, 5, 12), torch.randn(1, 1, 5, 6))   # D not a power of two
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr
