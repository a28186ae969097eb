"""Device probe (H100), two questions left open by session 5 for the NVFP4 fidelity path:

A. M = 256 (CUDA-graph times): is the fused W4A16 kernel bound by re-reading the activations from L2? Each (BLOCK_N x BLOCK_M)
   tile reads its BLOCK_M tokens over the whole K, so the activation traffic is (N / BLOCK_N) x M x K x 2 bytes
   (295 MB for 3072 x 12288: 5 TB/s at the kernel's 0.059 ms). Tiles with 128 or 256 weight rows halve or
   quarter it; 4-warp variants keep 2-3 CTAs per SM. Timed against the production config and bf16 cuBLAS.
B. M >= 4096: dequantize + cuBLAS pays for the bf16 weight's write. Does dequantizing N chunks into one small
   scratch (kept in L2) before each chunk's GEMM (single stream, output column slices) beat the whole-weight
   dequantize? Also the dequantize alone and the GEMM alone, to split the time.
Every timed variant is checked against the dequantized product first. Times: do_bench medians, `inner` calls
per sample (as bench_nvfp4 --inner 8), and CUDA-graph replays of `inner` calls (GPU time without host gaps).
    python scripts/device/tile_l2_probe.py [--part A,B] [--json out.json]
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import _pack  # noqa: E402,F401
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from _graph_timing import graphed, rel  # noqa: E402

from seedvr2bw.optimization.nvfp4 import format as fmt  # noqa: E402
from seedvr2bw.optimization.nvfp4 import kernels as K  # noqa: E402
from seedvr2bw.optimization.nvfp4.linear import NVFP4Linear  # noqa: E402

SHAPES = [(2560, 6912), (6912, 2560), (3072, 12288), (12288, 3072), (3072, 9216), (3072, 3072)]
# (BLOCK_N, BLOCK_M, BLOCK_K, num_warps, num_stages); SPLIT_K swept
TILES_A = [(64, 128, 128, 4, 3), (128, 128, 64, 4, 3), (128, 128, 64, 4, 4), (128, 128, 128, 4, 2),
           (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
           (128, 64, 128, 4, 3), (128, 64, 64, 4, 4)]
SPLITS = (1, 2, 3, 4, 6)


def timed(fn, inner, rep_ms=60):
    def many():
        for _ in range(inner):
            fn()
    return do_bench(many, rep=rep_ms, return_mode="median") / inner


def part_a(dev, shapes, m, inner, out):
    gen = torch.Generator(device="cpu").manual_seed(1)
    for k, n in shapes:
        w = (torch.randn(n, k, generator=gen) * 0.02).to(dev)
        t = fmt.quantize_nvfp4(w, return_tensor=True)
        wb = w.to(torch.bfloat16)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ref = F.linear(x.float(), t.dequantize(torch.float32)[:n, :k])
        t_bf16 = graphed(lambda: F.linear(x, wb), inner)
        dflt = K.w4a16_config(m, n, k, dev)
        rows = []
        for bn, bm, bk, nw, st in TILES_A:
            kt = -(-k // bk)
            for sk in SPLITS:
                if kt % sk or (sk > 1 and kt // sk < 2):
                    continue
                cfg = (bn, bm, bk, sk, nw, st)
                try:
                    y = K.w4a16_linear(x, t.packed, t.block_scale, t.global_scale, n, None, config=cfg)
                    err = rel(y, ref)
                    if err > 5e-3:
                        rows.append({"config": cfg, "error": f"rel err {err:.2e}"})
                        continue
                    # CUDA-graph replays: the GPU time (the eager call here has no launch plan: host-bound)
                    ms = graphed(lambda: K.w4a16_linear(x, t.packed, t.block_scale, t.global_scale, n, None,
                                                        config=cfg), inner)
                    rows.append({"config": cfg, "ms": ms, "vs_bf16": t_bf16 / ms, "default": cfg == tuple(dflt)})
                except Exception as exc:  # noqa: BLE001
                    rows.append({"config": cfg, "error": str(exc).splitlines()[0][:160]})
        ok = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
        d = next((r for r in rows if r.get("default")), None)
        print(f"A K={k} N={n} M={m}: bf16 {t_bf16:.4f} | default {d['config'] if d else None} "
              f"{d['ms'] if d else float('nan'):.4f} | best " +
              ", ".join(f"{r['config']} {r['ms']:.4f}" for r in ok[:4]) +
              f" | {sum('error' in r for r in rows)} failed", flush=True)
        out.append({"part": "A", "K": k, "N": n, "M": m, "bf16_ms": t_bf16, "rows": rows})
        del w, t, wb


def part_b(dev, shapes, ms_list, inner, chunk_rows, out):
    gen = torch.Generator(device="cpu").manual_seed(2)
    for k, n in shapes:
        lin = torch.nn.Linear(k, n, bias=False)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, k, generator=gen) * 0.02)
        layer = NVFP4Linear.from_linear(lin, path="fidelity").to(dev)
        wb = lin.weight.detach().to(dev, torch.bfloat16)
        full = torch.empty((n, k), device=dev, dtype=torch.bfloat16)
        for m in ms_list:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = F.linear(x.float(), layer.dequantize_weight(torch.float32))
            y = torch.empty((m, n), device=dev, dtype=torch.bfloat16)

            def deq_full():
                layer._dequant_rows(0, n, torch.bfloat16, out=full)

            def deq_gemm():
                deq_full()
                torch.mm(x, full.t(), out=y)

            def chunked(rows):
                bounds = [(n0, min(n0 + rows, n)) for n0 in range(0, n, rows)]
                scratch = torch.empty((rows, k), device=dev, dtype=torch.bfloat16)

                def run():
                    for n0, n1 in bounds:
                        buf = scratch[: n1 - n0]
                        layer._dequant_rows(n0, n1, torch.bfloat16, out=buf)
                        torch.mm(x, buf.t(), out=y[:, n0:n1])
                return run

            # dequant_only first: it fills `full`, which gemm_only multiplies by
            cands = {"bf16": lambda: torch.mm(x, wb.t(), out=y), "dequant_only": deq_full,
                     "gemm_only": lambda: torch.mm(x, full.t(), out=y), "dequant+gemm": deq_gemm,
                     "layer": lambda: layer(x)}
            for r in chunk_rows:
                if r < n:
                    cands[f"chunk{r}"] = chunked(r)
            res = {}
            for name, fn in cands.items():
                fn()
                if name not in ("bf16", "dequant_only"):       # bf16 multiplies the unquantized weight
                    err = rel(layer(x) if name == "layer" else y, ref)
                    if err > 5e-3:
                        res[name] = {"error": f"rel err {err:.2e}"}
                        continue
                res[name] = {"eager_ms": timed(fn, inner), "graph_ms": graphed(fn, inner)}
            b = res["bf16"]
            line = ", ".join(f"{nm} {v['graph_ms']:.4f}/{v['eager_ms']:.4f} ({b['graph_ms'] / v['graph_ms']:.2f}x)"
                             if "graph_ms" in v else f"{nm} {v['error']}" for nm, v in res.items())
            print(f"B K={k} N={n} M={m} (graph/eager ms, x bf16 graph): {line}", flush=True)
            out.append({"part": "B", "K": k, "N": n, "M": m, "results": res})
        del layer, wb, full


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", default="A,B")
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES))
    ap.add_argument("--m-a", type=int, default=256)
    ap.add_argument("--m-b", default="4096")
    ap.add_argument("--chunks", default="768,1536,3072")
    ap.add_argument("--inner", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "commit": os.environ.get("GIT_COMMIT", "unknown")}
    print(info, flush=True)
    out = []
    parts = args.part.split(",")
    if "A" in parts:
        part_a(dev, shapes, args.m_a, args.inner, out)
    if "B" in parts:
        part_b(dev, shapes, [int(v) for v in args.m_b.split(",")], args.inner,
               [int(v) for v in args.chunks.split(",")], out)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"info": info, "results": out}, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
