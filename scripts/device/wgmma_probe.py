"""Device probe (H100): the sm_90a wgmma W4A16 kernel (optimization/nvfp4/w4a16_wgmma.cu).

check: every config on edge shapes (M not a multiple of the tile, bias, split-K, subnormal and zero block scales)
       against the fp32 product of the dequantized weight; prints the relative error (bf16 output: ~2e-3).
time:  the six SeedVR2 shapes at the given M: bf16 cuBLAS, the production fidelity path (NVFP4Linear), the Triton
       fused kernel at its default config, and each wgmma config; CUDA-graph replays (GPU time), median.
    python scripts/device/wgmma_probe.py [--part check,time] [--m 256,4096] [--json out.json]
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import _pack  # noqa: E402,F401
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from seedvr2bw.optimization.nvfp4 import format as fmt  # noqa: E402
from seedvr2bw.optimization.nvfp4 import kernels as K  # noqa: E402
from seedvr2bw.optimization.nvfp4 import wgmma_w4a16 as W  # noqa: E402
from seedvr2bw.optimization.nvfp4.linear import NVFP4Linear  # noqa: E402

from _graph_timing import graphed, rel  # noqa: E402

SHAPES = [(2560, 6912), (6912, 2560), (3072, 12288), (12288, 3072), (3072, 9216), (3072, 3072)]


def adversarial_weight(n, k, gen):
    w = torch.randn(n, k, generator=gen) * 0.02
    w[0, :16] = 0.0                                   # an all-zero block (scale 0)
    w[1, 16:32] *= 1e-5                               # tiny blocks -> subnormal E4M3 scales
    w[2, :] *= 1e-4
    w[3, 32:48] = 0.02                                # all-equal block
    w[5, 48:64] = torch.tensor([6.0, -6.0, 3.0, -0.5, 0.25, 1.0, -1.5, 2.0] * 2) * 0.01
    return w


def check(dev, out):
    gen = torch.Generator(device="cpu").manual_seed(0)
    cases = [(1, 64, 64), (77, 128, 192), (256, 192, 320), (300, 256, 1024), (129, 3072, 640)]
    cfgs = [(1, 128, 4, 1), (1, 128, 3, 2), (1, 256, 3, 1), (2, 128, 4, 1), (2, 256, 3, 1), (1, 64, 4, 1),
            (2, 256, 4, 2), (2, 256, 5, 1), (2, 192, 4, 1), (2, 128, 3, 3), (4, 128, 4, 1), (4, 64, 4, 2)]
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
            ref_small = F.linear(x.float()[:, :], wd[:8])     # rows 0..7 hold the adversarial blocks
            for cfg in cfgs:
                wg, bm, st, sk = cfg
                if n % (64 * wg) or (k // 64) % sk:
                    continue
                y = W.wgmma_linear(x, t.packed, t.block_scale, t.global_scale, n, b, cfg)
                if y is None:
                    print("check", (m, n, k), cfg, "unavailable:", W.DISABLED_REASONS[-1:], flush=True)
                    out.append({"part": "check", "case": (m, n, k), "cfg": cfg, "error": "unavailable"})
                    continue
                torch.cuda.synchronize()
                e = rel(y, ref)
                e_small = rel(y[:, :8] - (b[:8].float() if b is not None else 0), ref_small)
                yt = K.w4a16_linear(x, t.packed, t.block_scale, t.global_scale, n, b)
                e_tr = rel(y, yt.float())
                worst = max(worst, e, e_small)
                out.append({"part": "check", "case": (m, n, k), "bias": has_bias, "cfg": cfg, "rel": e,
                            "rel_adversarial_rows": e_small, "rel_vs_triton": e_tr})
                print(f"check M={m} N={n} K={k} bias={has_bias} cfg={cfg}: rel {e:.2e}, adversarial rows "
                      f"{e_small:.2e}, vs triton {e_tr:.2e}", flush=True)
    print(f"check worst rel {worst:.2e}", flush=True)
    return worst


def time_shapes(dev, m_list, shapes, out):
    gen = torch.Generator(device="cpu").manual_seed(1)
    for k, n in shapes:
        lin = torch.nn.Linear(k, n, bias=True)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, k, generator=gen) * 0.02)
        layer = NVFP4Linear.from_linear(lin, path="fidelity").to(dev)
        lin = lin.to(dev, torch.bfloat16)
        packed, bscale, gscale = layer.weight, layer.weight_scale, layer.weight_scale_2
        bias = lin.bias
        for m in m_list:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = F.linear(x.float(), layer.dequantize_weight(torch.float32), bias.float())
            res = {"bf16": graphed(lambda: lin(x), 8, 15), "layer": graphed(lambda: layer(x), 8, 15)}
            tcfg = K.w4a16_config(m, n, k, dev)
            res["triton"] = graphed(lambda: K.w4a16_linear(x, packed, bscale, gscale, n, bias), 8, 15)
            if m <= 512:
                cfgs = [W.config_for(m, n, k, dev)]
            else:
                cfgs = [(2, 256, 4, 1), (2, 256, 5, 1), (2, 192, 4, 1), (4, 128, 4, 1), (4, 128, 3, 1), (4, 64, 4, 1)]
            errs = {}
            for cfg in cfgs:
                wg, bm, st, sk = cfg
                label = str(cfg)
                if n % (64 * wg) or (k // 64) % sk or (sk > 1 and k // 64 // sk < 4):
                    continue
                try:
                    y = W.wgmma_linear(x, packed, bscale, gscale, n, bias, cfg)
                    if y is None:
                        continue
                    e = rel(y, ref)
                    if e > 5e-3:
                        errs[label] = e
                        continue
                    res[label] = graphed(lambda: W.wgmma_linear(x, packed, bscale, gscale, n, bias, cfg), 8, 15)
                except Exception as exc:  # noqa: BLE001
                    errs[label] = str(exc)[:200]
            b = res["bf16"]
            wg_rows = sorted(((v, c) for c, v in res.items() if c.startswith("(")))
            best = wg_rows[0] if wg_rows else (float("nan"), None)
            print(f"time K={k} N={n} M={m}: bf16 {b:.4f} | layer {res['layer']:.4f} ({b / res['layer']:.2f}x) | "
                  f"triton{tcfg[:4]} {res['triton']:.4f} ({b / res['triton']:.2f}x) | wgmma best {best[1]} "
                  f"{best[0]:.4f} ({b / best[0]:.2f}x); next " +
                  ", ".join(f"{c} {v:.4f}" for v, c in wg_rows[1:]) + (f" | errors {errs}" if errs else ""),
                  flush=True)
            out.append({"part": "time", "K": k, "N": n, "M": m, "ms": res, "errors": errs})
        del layer, lin


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", default="check,time", help="check, time (comma-separated)")
    ap.add_argument("--m", default="256,4096")
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "commit": os.environ.get("GIT_COMMIT", "unknown")}
    print(info, flush=True)
    out = []
    t0 = time.time()
    parts = args.part.split(",")
    if "check" in parts:
        worst = check(dev, out)
        if worst > 5e-3 and "time" in parts:
            print("check failed: timing skipped", flush=True)
            parts.remove("time")
    if "time" in parts:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        time_shapes(dev, [int(v) for v in args.m.split(",")], shapes, out)
    print(f"total {time.time() - t0:.0f} s; compile failures: {W.DISABLED_REASONS}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"info": info, "results": out}, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
