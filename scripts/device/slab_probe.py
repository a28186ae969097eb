"""Device probe: the NVFP4 fidelity path's "slabs" kernel (dequantize an L2-sized slab of weight rows, multiply it
into its column slice of the output through cuBLASLt with the bias in the epilogue) against the whole-weight
dequantize + cuBLAS, and bf16 cuBLAS, on the six SeedVR2 shapes.

Each shape x M: R rounds, each round times every variant once in a rotating order (CUDA-graph replays of `inner`
calls: GPU time; and `inner` calls queued without a graph: what the bench sees); times are medians over rounds,
ratios the median of per-round ratios against bf16. Also checks: cuBLASLt on the whole bf16 weight is bitwise
F.linear's output (same library, same heuristic) and the slabs output's error against the fp32 product equals the
dequant path's.
    python scripts/device/slab_probe.py [--m 1024,4096,16384] [--slabs 0.25:0,0.125:8] [--json out.json]
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import _pack  # noqa: E402,F401
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from seedvr2bw.optimization.nvfp4 import cublaslt  # noqa: E402
from seedvr2bw.optimization.nvfp4 import format as fmt  # noqa: E402
from seedvr2bw.optimization.nvfp4 import linear as L  # noqa: E402
from seedvr2bw.optimization.nvfp4.linear import NVFP4Linear  # noqa: E402

from _graph_timing import graphed, rel  # noqa: E402

SHAPES = [(2560, 6912), (6912, 2560), (3072, 12288), (12288, 3072), (3072, 9216), (3072, 3072)]


def queued(fn, inner, reps=5):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / inner)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="1024,4096,16384")
    ap.add_argument("--slabs", default="0.25:0,0.5:0,0.125:8,0.125:16,0.0625:8,0.25:8",
                    help="fraction:overlap_sms pairs (SLAB_L2_FRACTION, SLAB_OVERLAP_SMS)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--inner", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "L2", L.l2_bytes(dev) >> 20, "MiB",
          "cuBLASLt", cublaslt.available(), "commit", os.environ.get("GIT_COMMIT", "?"), flush=True)
    slabs = [(float(p.split(":")[0]), int(p.split(":")[1])) for p in args.slabs.split(",")]
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    t_start = time.time()
    for k, n in SHAPES:
        w = torch.randn(n, k, generator=gen) * 0.02
        t = fmt.quantize_nvfp4(w, return_tensor=True).to(dev)
        bias = (torch.randn(n, generator=gen) * 0.01).to(dev, torch.bfloat16)
        layer = NVFP4Linear.from_nvfp4(t, bias=bias, path="fidelity")
        wd = t.dequantize(torch.float32)[:n, :k]
        w16 = wd.to(torch.bfloat16)
        for m in [int(v) for v in args.m.split(",")]:
            x = (torch.randn(m, k, generator=gen) * 0.5).to(dev, torch.bfloat16)
            ref = F.linear(x.float(), wd, bias.float())
            row = {"k": k, "n": n, "m": m}
            # cuBLASLt on the whole bf16 weight vs F.linear: same bits?
            lt = cublaslt.LtLinear(m, n, k, k, k, n, torch.bfloat16, dev, True, 256)
            y_lt = torch.empty(m, n, dtype=torch.bfloat16, device=dev)

            def lt_full():
                lt(x.data_ptr(), w16.data_ptr(), y_lt.data_ptr(), torch.cuda.current_stream().cuda_stream,
                   bias.data_ptr())
                return y_lt
            y_f = F.linear(x, w16, bias)
            lt_full()
            torch.cuda.synchronize()
            row["lt_bitwise_equal_F_linear"] = bool(torch.equal(y_lt, y_f))

            def make(kern, frac=None, sms=0):
                def fn():
                    return layer(x)
                layer.fidelity_kernel = kern
                if frac is not None:
                    L.SLAB_L2_FRACTION, L.SLAB_OVERLAP_SMS = frac, sms
                layer._plans.clear()
                fn()
                fn()                      # second call runs the launch plan
                return fn
            variants = {"bf16": lambda: F.linear(x, w16, bias), "lt_full": lt_full}
            errs = {}
            for kern, frac, sms in [("dequant", None, 0)] + [("slabs", f, o) for f, o in slabs]:
                name = kern if frac is None else f"slabs_{frac}_{sms}"
                layer.fidelity_kernel = kern
                if frac is not None:
                    L.SLAB_L2_FRACTION, L.SLAB_OVERLAP_SMS = frac, sms
                layer._plans.clear()
                y = layer(x)
                y = layer(x)
                errs[name] = rel(y, ref)
                if frac is not None:
                    row[f"{name}_count"] = len(L.slab_bounds(n, k, L.l2_bytes(dev), 2, frac))
                variants[name] = (kern, frac, sms)
            row["rel_err"] = errs
            times = {v: [] for v in variants}
            qtimes = {v: [] for v in variants}
            names = list(variants)
            for r in range(args.rounds):
                order = names[r % len(names):] + names[:r % len(names)]
                for v in order:
                    spec = variants[v]
                    fn = make(*spec) if isinstance(spec, tuple) else spec
                    times[v].append(graphed(fn, args.inner, reps=10))
                    qtimes[v].append(queued(fn, 8))
            med = {v: statistics.median(ts) for v, ts in times.items()}
            ratio = {v: statistics.median([times["bf16"][i] / times[v][i] for i in range(args.rounds)])
                     for v in names}
            qmed = {v: statistics.median(ts) for v, ts in qtimes.items()}
            qratio = {v: statistics.median([qtimes["bf16"][i] / qtimes[v][i] for i in range(args.rounds)])
                      for v in names}
            row.update(ms=med, x_bf16=ratio, queued_ms=qmed, queued_x_bf16=qratio)
            rows.append(row)
            print(f"K={k} N={n} M={m}: lt==F.linear {row['lt_bitwise_equal_F_linear']}  "
                  + "  ".join(f"{v} {med[v]:.4f}ms {ratio[v]:.3f}x (q {qratio[v]:.3f}x)" for v in names)
                  + "  err " + " ".join(f"{v}={e:.2e}" for v, e in errs.items()), flush=True)
    print(f"total {time.time() - t_start:.0f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "commit": os.environ.get("GIT_COMMIT", "?"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
