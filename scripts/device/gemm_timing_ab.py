"""Why did the diagnostic and bench_nvfp4.py time the same bf16 GEMM 14 % apart? Times F.linear on the diagnostic's
shape (4096x3072x12288) with each timer (the diagnostic's CUDA-event timer vs triton's do_bench as the benchmark
calls it), each operand recipe (bias or not, weight scale 0.02 vs K^-1/2) and calls per sample, in one process.

    python scripts/device/gemm_timing_ab.py
"""
import itertools
import statistics

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _pack  # noqa: E402,F401
import torch
import torch.nn.functional as F
from triton.testing import do_bench

from seedvr2bw.optimization.diagnostics.timing import cuda_ms

M, K, N = 4096, 3072, 12288


def main():
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(M, K, device=dev, generator=gen).bfloat16()
    base = torch.randn(N, K, device=dev, generator=gen)
    bias = (torch.randn(N, device=dev, generator=gen) * 0.01).bfloat16()
    flops = 2 * M * K * N
    rows = []
    for rnd in range(2):   # two rounds: drift between the first and second pass shows up as a difference
        for scale, use_bias, inner, timer in itertools.product(("0.02", "K^-1/2"), (True, False), (1, 4),
                                                               ("diag", "do_bench")):
            w = (base * (0.02 if scale == "0.02" else K ** -0.5)).bfloat16()
            b = bias if use_bias else None

            def call():
                for _ in range(inner):
                    F.linear(x, w, b)
            if timer == "diag":
                ms = cuda_ms(lambda: F.linear(x, w, b), reps=20, warmup=10, inner=inner, flush_l2=True)
            else:
                ms = do_bench(call, warmup=25, rep=100, return_mode="median") / inner
            rows.append((rnd, scale, use_bias, inner, timer, ms))
            print(f"round {rnd} w {scale:7s} bias {use_bias!s:5s} inner {inner} {timer:8s}: {ms:.4f} ms "
                  f"{flops / ms / 1e9:.0f} TFLOP/s", flush=True)
    for key, idx in (("timer", 4), ("bias", 2), ("w scale", 1), ("inner", 3)):
        groups = {}
        for r in rows:
            groups.setdefault(r[idx], []).append(r[5])
        print(f"by {key}: " + ", ".join(f"{k}: median {statistics.median(v):.4f} ms" for k, v in groups.items()))


if __name__ == "__main__":
    main()
