"""Is there a cuBLASLt algorithm faster than the one ``F.linear`` runs, for the bf16 GEMM of the NVFP4 fidelity
path (dequantize + bf16 GEMM) at M = 4096? Per shape: every algorithm cuBLASLt's heuristic offers (bias epilogue,
the operands' real alignment) is checked against ``F.linear`` and timed once; the fastest few are then timed with
``F.linear``, the shipped fidelity path and dequantize + the fastest algorithm in rotating rounds (CUDA-graph
replays, ``inner`` calls per replay; ratios are medians of per-round ratios).

    python scripts/device/lt_algo_probe.py [--m 4096] [--shapes 2560x6912,...] [--candidates 32] [--rounds 5]
"""
import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _pack  # noqa: E402,F401
import torch
import torch.nn.functional as F

from _graph_timing import graphed, rel
from seedvr2bw.optimization.nvfp4 import cublaslt
from seedvr2bw.optimization.nvfp4 import format as fmt
from seedvr2bw.optimization.nvfp4 import kernels as K
from seedvr2bw.optimization.nvfp4.linear import NVFP4Linear

SHAPES = "2560x6912,6912x2560,3072x12288,12288x3072,3072x9216,3072x3072"


def rotating(fns: dict, rounds: int, inner: int) -> dict:
    """name -> list of per-round ms, each round timing every fn once, order rotated per round."""
    names, out = list(fns), {k: [] for k in fns}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for k in order:
            out[k].append(graphed(fns[k], inner))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="4096")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--candidates", type=int, default=32)
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--inner", type=int, default=8)
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "lt_algo_probe.json"))
    a = ap.parse_args()
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), torch.__version__, os.environ.get("GIT_COMMIT", "?"), flush=True)
    results = []
    for shape in a.shapes.split(","):
        k, n = map(int, shape.split("x"))
        gen = torch.Generator(device=dev).manual_seed(0)
        w32 = torch.randn(n, k, device=dev, generator=gen) * 0.02
        t = fmt.quantize_nvfp4(w32, return_tensor=True)
        bias = (torch.randn(n, device=dev, generator=gen) * 0.01).bfloat16()
        layer = NVFP4Linear.from_nvfp4(t, bias=bias, path="fidelity")
        w = layer.dequantize_weight(torch.bfloat16)
        for m in map(int, a.m.split(",")):
            xs = [torch.randn(m, k, device=dev, generator=gen).bfloat16() for _ in range(4)]
            ref = F.linear(xs[0], w, bias)
            layer(xs[0])
            dq = K.dequant_plan(layer.weight, layer.weight_scale, layer.weight_scale_2, (n, k), torch.bfloat16)
            align = cublaslt.alignment_of(xs[0].data_ptr(), w.data_ptr(), k * 2, n * 2, bias.data_ptr())
            lt = cublaslt.LtLinear(m, n, k, k, k, n, torch.bfloat16, dev, True, align, candidates=a.candidates)
            it = [0]

            def nxt():
                it[0] = (it[0] + 1) % len(xs)
                return xs[it[0]]

            def lt_call(algo, weight=None):
                def f():
                    x = nxt()
                    wt = weight() if weight is not None else w
                    y = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
                    lt.algo = algo
                    lt(x.data_ptr(), wt.data_ptr(), y.data_ptr(), torch.cuda.current_stream().cuda_stream,
                       bias.data_ptr())
                    return y
                return f

            flin = graphed(lambda: F.linear(nxt(), w, bias), a.inner)
            cands = []
            for i, algo in enumerate(lt.candidates):
                it[0] = len(xs) - 1
                try:
                    y = lt_call(algo)()
                    torch.cuda.synchronize()
                    err = rel(y, ref.float())
                    ms = graphed(lt_call(algo), a.inner)
                except Exception as exc:  # noqa: BLE001 - a candidate that fails is reported, not fatal
                    print(f"  algo {i}: {type(exc).__name__}: {exc}", flush=True)
                    continue
                cands.append(dict(i=i, ms=ms, ratio=flin / ms, err=err, waves=round(algo.waves, 3),
                                  ws=algo.workspace, **algo.config()))
                print(f"  {shape} M={m} algo {i}: {ms:.4f} ms x{flin / ms:.3f} vs F.linear, err {err:.2e}, "
                      f"{cands[-1]}", flush=True)
            good = sorted((c for c in cands if c["err"] < 1e-2), key=lambda c: c["ms"])[:a.top]
            fns = {"F.linear": lambda: F.linear(nxt(), w, bias), "fidelity": lambda: layer(nxt())}
            for c in good:
                fns[f"lt{c['i']}"] = lt_call(lt.candidates[c["i"]])
            if good:
                fns[f"dq+lt{good[0]['i']}"] = lt_call(lt.candidates[good[0]["i"]], weight=dq)
            per = rotating(fns, a.rounds, a.inner)
            base = per["F.linear"]
            row = dict(shape=shape, m=m, candidates=cands, ms={k: statistics.median(v) for k, v in per.items()},
                       x_flinear={k: statistics.median(b / t for b, t in zip(base, v)) for k, v in per.items()})
            results.append(row)
            print(f"{shape} M={m}: " + ", ".join(f"{k} {row['ms'][k]:.4f} ms x{row['x_flinear'][k]:.3f}"
                                                  for k in fns), flush=True)
    with open(a.json, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
