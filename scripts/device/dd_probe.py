"""Device probe (H100): the sm_90a W4A16 kernel with the decode shared between CTAs (optimization/nvfp4/w4a16_dd.cu)
for large M (each 64-k slice of a weight tile decoded once into a bf16 scratch, flagged; TMA copies; wgmma m64nTNk16).

check: configs on edge shapes (M not a multiple of the tile, bias, subnormal and zero block scales, a small grid so
       each CTA loops over many tiles) against the fp32 product of the dequantized weight (bf16 output: ~2e-3).
time:  the six SeedVR2 shapes at the given M: bf16 cuBLAS, the production fidelity layer (dequant + cuBLAS at
       these M) and each config; CUDA-graph replays, R rounds in rotating order, ratio = median of per-round ratios.
    python scripts/device/dd_probe.py [--part check,time] [--m 4096,16384] [--json out.json]
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

from seedvr2bw.optimization.nvfp4 import format as fmt  # noqa: E402
from seedvr2bw.optimization.nvfp4 import dd_w4a16 as W  # noqa: E402
from seedvr2bw.optimization.nvfp4.linear import NVFP4Linear  # noqa: E402

from _graph_timing import graphed, rel  # noqa: E402
from wgmma_probe import SHAPES, adversarial_weight  # noqa: E402

CONFIGS = [(256, 4, 64, 1), (256, 4, 64, 2), (256, 3, 64, 2)]  # (TN, stages, EPI_TOK, cluster)


def check(dev, out, configs):
    gen = torch.Generator(device="cpu").manual_seed(0)
    cases = [(1, 256, 64), (77, 256, 192), (300, 512, 1024), (129, 3072, 640), (1000, 768, 320)]
    worst = 0.0
    for m, n, k in cases:
        w = adversarial_weight(n, k, gen)
        t = fmt.quantize_nvfp4(w, return_tensor=True).to(dev)
        x = torch.randn(m, k, generator=gen).to(dev, torch.bfloat16)
        bias = (torch.randn(n, generator=gen) * 0.1).to(dev, torch.bfloat16)
        wd = t.dequantize(torch.float32)[:n, :k]
        for has_bias in (False, True):
            b = bias if has_bias else None
            ref = F.linear(x.float(), wd, b.float() if b is not None else None)
            ref_small = F.linear(x.float(), wd[:8])
            for cfg in configs:
                for grid in (None, 4):
                    if n % (128 * cfg[3]):
                        continue
                    y = W.dd_linear(x, t.packed, t.block_scale, t.global_scale, n, b, cfg, grid=grid)
                    if y is None:
                        print("check", (m, n, k), cfg, "unavailable:", W._DISABLED_REASON[-1:], flush=True)
                        out.append({"part": "check", "case": (m, n, k), "cfg": cfg, "error": "unavailable"})
                        worst = float("inf")
                        continue
                    torch.cuda.synchronize()
                    e = rel(y, ref)
                    e_small = rel(y[:, :8] - (b[:8].float() if b is not None else 0), ref_small)
                    worst = max(worst, e, e_small)
                    out.append({"part": "check", "case": (m, n, k), "bias": has_bias, "cfg": cfg, "grid": grid,
                                "rel": e, "rel_adversarial_rows": e_small})
                    print(f"check M={m} N={n} K={k} bias={has_bias} cfg={cfg} grid={grid}: rel {e:.2e}, "
                          f"adversarial rows {e_small:.2e}", flush=True)
    print(f"check worst rel {worst:.2e}", flush=True)
    return worst


def time_shapes(dev, m_list, shapes, configs, rounds, out):
    gen = torch.Generator(device="cpu").manual_seed(1)
    for k, n in shapes:
        lin = torch.nn.Linear(k, n, bias=True)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, k, generator=gen) * 0.02)
        layer = NVFP4Linear.from_linear(lin, path="fidelity").to(dev)
        lin = lin.to(dev, torch.bfloat16)
        packed, bscale, gscale, bias = layer.weight, layer.weight_scale, layer.weight_scale_2, lin.bias
        for m in m_list:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = F.linear(x.float(), layer.dequantize_weight(torch.float32), bias.float())
            paths = {"bf16": lambda: lin(x), "layer": lambda: layer(x)}
            errs = {}
            for cfg in configs:
                if n % (128 * cfg[3]):
                    continue
                y = W.dd_linear(x, packed, bscale, gscale, n, bias, cfg)
                if y is None:
                    errs[str(cfg)] = "unavailable"
                    continue
                e = rel(y, ref)
                if e > 5e-3:
                    errs[str(cfg)] = f"rel {e:.2e}"
                    continue
                paths[str(cfg)] = (lambda c: lambda: W.dd_linear(x, packed, bscale, gscale, n, bias, c))(cfg)
            names = list(paths)
            per_round = {p: [] for p in names}
            for r in range(rounds):
                order = names[r % len(names):] + names[:r % len(names)]
                for p in order:
                    per_round[p].append(graphed(paths[p], 8, 15))
            ms = {p: statistics.median(v) for p, v in per_round.items()}
            ratio = {p: statistics.median(b / v for b, v in zip(per_round["bf16"], per_round[p])) for p in names}
            flop = 2 * m * n * k
            print(f"time K={k} N={n} M={m}: bf16 {ms['bf16']:.4f} ms ({flop / ms['bf16'] / 1e9:.0f} TFLOP/s) | " +
                  " | ".join(f"{p} {ms[p]:.4f} ({ratio[p]:.3f}x)" for p in names[1:]) +
                  (f" | errors {errs}" if errs else ""), flush=True)
            out.append({"part": "time", "K": k, "N": n, "M": m, "ms": ms, "x_bf16": ratio, "errors": errs})
        del layer, lin


def bounds(dev, m_list, shapes, configs, out, diags=(0, 1, 8, 4)):
    """What limits a config: DIAG knobs drop one part of the work (1 = decode and flag waits, 2 = wgmma, 4 = output
    stores, 8 = flag waits; bits add up); results with a knob set are wrong and not checked."""
    gen = torch.Generator(device="cpu").manual_seed(2)
    for k, n in shapes:
        t = fmt.quantize_nvfp4(torch.randn(n, k, generator=gen) * 0.02, return_tensor=True).to(dev)
        w = t.dequantize(torch.bfloat16)
        for m in m_list:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            res = {"bf16": graphed(lambda: F.linear(x, w), 8, 15)}
            for cfg in configs:
                if n % (128 * cfg[3]):
                    continue
                for diag in diags:
                    W.DIAG[0] = diag
                    y = W.dd_linear(x, t.packed, t.block_scale, t.global_scale, n, None, cfg)
                    if y is None:
                        res[f"{cfg}d{diag}"] = "unavailable"
                        continue
                    res[f"{cfg}d{diag}"] = graphed(
                        lambda: W.dd_linear(x, t.packed, t.block_scale, t.global_scale, n, None, cfg), 8, 15)
            W.DIAG[0] = 0
            b = res["bf16"]
            print(f"bound K={k} N={n} M={m}: bf16 {b:.4f} | " + ", ".join(
                f"{c} {b / v:.3f}x" if isinstance(v, float) else f"{c} {v}" for c, v in res.items()
                if c != "bf16"), flush=True)
            out.append({"part": "bound", "K": k, "N": n, "M": m, "ms": res})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", default="check,time")
    ap.add_argument("--m", default="4096,16384")
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES))
    ap.add_argument("--configs", default=";".join(",".join(map(str, c)) for c in CONFIGS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--diags", default="0,1,8,4", help="DIAG values for --part bound")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "commit": os.environ.get("GIT_COMMIT", "unknown")}
    print(info, flush=True)
    configs = [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";")]
    out = []
    t0 = time.time()
    parts = args.part.split(",")
    if "check" in parts:
        worst = check(dev, out, configs)
        if worst > 5e-3 and "time" in parts:
            print("check failed: timing skipped", flush=True)
            parts.remove("time")
    if "bound" in parts:
        bounds(dev, [int(v) for v in args.m.split(",")],
               [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")], configs, out,
               [int(v) for v in args.diags.split(",")])
    if "once" in parts:   # one call of the first config per shape, for a profiler
        for s in args.shapes.split(","):
            k, n = (int(v) for v in s.split("x"))
            t = fmt.quantize_nvfp4(torch.randn(n, k) * 0.02, return_tensor=True).to(dev)
            x = torch.randn(int(args.m.split(",")[0]), k, device=dev, dtype=torch.bfloat16)
            for _ in range(3):
                W.dd_linear(x, t.packed, t.block_scale, t.global_scale, n, None, configs[0])
            torch.cuda.synchronize()
    if "time" in parts:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        time_shapes(dev, [int(v) for v in args.m.split(",")], shapes, configs, args.rounds, out)
    print(f"total {time.time() - t0:.0f} s; compile failures: {W._DISABLED_REASON}; max resident CTAs: "
          f"{ {k[:4]: v.max_ctas for k, v in W._KERNELS.items() if v is not None} }", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"info": info, "results": out}, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
