"""Running Triton kernels through the interpreter (TRITON_INTERPRET=1) on the CPU, for the tests of the pack's
kernels: each check runs in a subprocess so that the flag is set before Triton is imported."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


def run_subprocess(code: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)


def run_checked(code: str, timeout: int = 900) -> str:
    """``code`` in an interpreting subprocess; its stdout, or a failed assertion with its output."""
    r = run_subprocess(code, timeout)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return r.stdout


def skip_unless_loops_run() -> None:
    """Some Triton / NumPy pairs cannot interpret a loop bounded by a kernel argument (Triton 3.6 with NumPy 2.x:
    "only 0-dimensional arrays can be converted to Python scalars"); kernels that need one are skipped there."""
    r = run_subprocess(textwrap.dedent("""
        import os
        os.environ["TRITON_INTERPRET"] = "1"
        import torch, triton, triton.language as tl
        @triton.jit
        def k(o_ptr, n):
            acc = tl.zeros((4,), tl.float32)
            for _ in range(0, n):
                acc += 1.0
            tl.store(o_ptr + tl.arange(0, 4), acc)
        o = torch.zeros(4)
        k[(1,)](o, 3)
        assert o.tolist() == [3.0] * 4
    """))
    if r.returncode != 0:
        pytest.skip("this Triton interpreter cannot run a loop bounded by a kernel argument: "
                    + (r.stderr.strip().splitlines() or ["?"])[-1][:200])


ROOT = Path(__file__).resolve().parents[1]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


def pack_prelude(imports: str) -> str:
    """The start of a check's code: the interpreter flag, the pack imported, the line ``imports``, the interpreter
    confirmed by ``launch.INTERPRET``, and a seeded generator ``gen``."""
    return textwrap.dedent("""
        import os, sys, logging
        os.environ["TRITON_INTERPRET"] = "1"
        sys.path.insert(0, {root!r})
        from pack_import import import_pack
        import_pack()
        import torch
        from seedvr2bw.optimization.nvfp4 import launch
        assert launch.INTERPRET
        gen = torch.Generator().manual_seed(0)
    """).format(root=str(ROOT)) + imports.strip() + "\n"
