"""Host (CPU) cost of one NVFP4Linear.forward call, with the GPU work removed. Runs on a CPU-only machine.

    python scripts/bench_nvfp4_host.py [--m 1,16,64,256] [--shapes 2560x6912,...] [--paths fidelity,fp8_speed]
                                       [--calls 3000] [--profile 3072x3072:256] [--json out.json]

At M <= 256 the NVFP4 linears are host-bound on an H100 (0.08-0.2 ms per call for 10-50 us of GPU work): the
time is Python dispatch, path resolution, config lookups, tensor checks, allocation and the Triton launch.
This script measures exactly that part on the CPU:

* the layer believes it runs on CUDA through the seams ``kernels.on_cuda`` / ``device_is_cuda`` /
  ``raw_stream`` (replaced here by stand-ins returning True / a null stream; the code itself is unchanged);
* every Triton kernel the fidelity / fp8 paths launch is replaced by a stand-in JIT function whose
  ``kernel[grid](...)`` returns a stand-in compiled kernel with a no-op launcher ``run`` (so the cached
  "fast launch" relaunch path is exercised as on the GPU, minus the launcher's own C cost, ~3-5 us there);
* ``torch._scaled_mm`` returns a preallocated output of the right shape.

Allocations are real (CPU allocator instead of the CUDA caching allocator: similar cost at these sizes).
What is NOT in the numbers: the Triton launcher's C code and cuLaunchKernel (a few us per launch), the
CUDA-side dispatch of torch ops (CPU ops dispatch similarly), and - for a kernel launched with a plain
``kernel[grid](...)`` instead of the cached relaunch - Triton's binder (~40 us on the H100, see kernels.py).

Prints a table of median us/call per path, shape and M, and a cProfile breakdown of one case.
"""
import argparse
import cProfile
import gc
import io
import json
import pstats
import statistics
import sys
import time

import _pack
import torch

from seedvr2bw.optimization.nvfp4 import kernels as K
from seedvr2bw.optimization.nvfp4 import launch
from seedvr2bw.optimization.nvfp4 import linear as L
from seedvr2bw.optimization.nvfp4.linear import NVFP4Linear

DEFAULT_SHAPES = "2560x6912,6912x2560,3072x12288,12288x3072,3072x9216,3072x3072"
H100_SMS = 132


_LUT = torch.zeros(256, dtype=torch.int32)


class _FakeCompiled:
    """Stands for a Triton CompiledKernel: the launcher ``run`` does nothing."""
    function = None
    packed_metadata = None

    def __init__(self, name):
        self.name = name
        self.launches = 0

    def run(self, *args):
        self.launches += 1


class _FakeJit:
    """Stands for a @triton.jit function: ``fn[grid](*args, **kw)`` 'compiles' once and returns the kernel."""

    def __init__(self, name):
        self.name = name
        self.compiled = _FakeCompiled(name)
        self.binder_calls = 0

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.binder_calls += 1
            return self.compiled
        return launch


def install_fakes():
    if not K.HAS_TRITON:
        sys.exit("needs triton importable (the kernels module defines its kernels only then)")
    launch.on_cuda = lambda t: True
    launch.device_is_cuda = lambda d: True
    launch.raw_stream = lambda index: 0
    launch.SM_COUNT["cpu"] = H100_SMS
    fakes = {}
    for module, name in ((K, "w4a16_swab_kernel"), (launch, "splitk_reduce_kernel"), (K, "act_fp8_row_kernel"),
                         (K, "_act_nvfp4_kernel"), (K, "dequant_kernel")):
        fakes[name] = _FakeJit(name)
        setattr(module, name, fakes[name])
    # the dequantize kernel is autotuned: its chosen config is what the cached relaunch keys on
    fakes["dequant_kernel"].best_config = type("Cfg", (), {"kwargs": {"BLOCK_R": 32, "BLOCK_C": 64}})()
    K.byte_lut = lambda device: _LUT
    hooks = launch.hooks_set()
    if hooks:   # Triton without empty-hook detection in hooks_set: behave as on the H100 run (Triton 3.6)
        launch.hooks_set = lambda: False
    out_cache = {}

    def fake_scaled_mm(a, b, scale_a=None, scale_b=None, out_dtype=torch.bfloat16, **kw):
        key = (a.shape[0], b.shape[1], out_dtype)
        y = out_cache.get(key)
        if y is None:
            y = out_cache[key] = torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype)
        return y

    torch._scaled_mm = fake_scaled_mm

    def fake_linear(x, w, b=None):    # the fidelity path's dequantize + cuBLAS GEMM: the GEMM stubbed out
        key = (x.shape[:-1], w.shape[0], x.dtype)
        y = out_cache.get(key)
        if y is None:
            y = out_cache[key] = torch.empty((*x.shape[:-1], w.shape[0]), dtype=x.dtype)
        return y

    torch.nn.functional.linear = fake_linear
    return fakes, hooks


def make_layer(k, n, path):
    layer = NVFP4Linear(k, n, bias=True, dtype=torch.bfloat16, path=path)
    layer.weight_scale_2.fill_(1.0)
    return layer


def time_calls(fn, calls, reps=15):
    for _ in range(min(200, calls)):
        fn()
    per = []
    gc.disable()
    try:
        for _ in range(reps):
            t0 = time.perf_counter_ns()
            for _ in range(calls):
                fn()
            per.append((time.perf_counter_ns() - t0) / calls / 1000.0)
    finally:
        gc.enable()
    return statistics.median(per)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="1,16,64,256")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--paths", default="fidelity,fp8_speed")
    ap.add_argument("--calls", type=int, default=400, help="calls per timed batch (15 batches, median)")
    ap.add_argument("--full", action="store_true", help="no launch plans: time the full forward every call")
    ap.add_argument("--profile", default="3072x3072:256", help="KxN:M of the case to break down ('' = none)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    fakes, hooks = install_fakes()
    if args.full:
        L.make_plan = lambda *a: None
    ms = [int(v) for v in args.m.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    paths = args.paths.split(",")
    print(f"commit {_pack.git_commit()}  torch {torch.__version__}  fast launch {launch.FAST_LAUNCH[0]}  "
          f"(Triton hooks reported set: {hooks}{' -> treated as unset' if hooks else ''})"
          f"{'  launch plans off (--full)' if args.full else ''}")
    rows = []
    for path in paths:
        print(f"\npath {path}: median host us per forward call (GPU work removed)")
        print("  K x N        " + "".join(f"  M={m:<6}" for m in ms))
        for k, n in shapes:
            layer = make_layer(k, n, path)
            line = f"  {k:>5}x{n:<6}"
            for m in ms:
                x = torch.randn(1, m, k).to(torch.bfloat16)
                y = layer(x)
                assert y.shape == (1, m, n), y.shape
                us = time_calls(lambda: layer(x), args.calls)
                rows.append({"path": path, "k": k, "n": n, "m": m, "us": round(us, 2)})
                line += f"  {us:8.2f}"
            print(line)
    launches = {name: (f.binder_calls, f.compiled.launches) for name, f in fakes.items()}
    print("\nstand-in kernels (kernel[grid] binder calls, cached relaunches):", launches)
    if args.profile:
        shape, m = args.profile.split(":")
        k, n = (int(v) for v in shape.split("x"))
        m = int(m)
        for path in paths:
            layer = make_layer(k, n, path)
            x = torch.randn(1, m, k).to(torch.bfloat16)
            for _ in range(100):
                layer(x)
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(2000):
                layer(x)
            pr.disable()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
            print(f"\ncProfile, path {path}, {k}x{n}, M={m}, 2000 calls (tottime = own time; cProfile inflates "
                  f"Python calls):")
            print("\n".join(s.getvalue().splitlines()[4:]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"commit": _pack.git_commit(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
