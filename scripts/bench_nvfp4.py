"""Benchmark NVFP4 linear paths on SeedVR2 shapes: bf16 cuBLAS, comfy-kitchen, and our paths, in one run.

    python scripts/bench_nvfp4.py [--m 64,256,1024,4096,16384,32768] [--shapes 2560x6912,...]
                                  [--paths bf16,ck,fidelity,fp8_speed,fp4_tensorcore] [--json out.json]
                                  [--inner 8] [--variants] [--sweep]

--variants adds the fidelity path's kernels forced one by one (fid_dequant, fid_fused [M <= 1024],
fid_rs [M >= 1024, sm_90]), so the M thresholds in dispatch.py can be read off one run;
--sweep times the fused W4A16 kernel over a few tile configs (for kernels.W4A16_CONFIGS).

Shapes are KxN (in x out): SeedVR2 3B hidden 2560 / MLP 6912, 7B hidden 3072 / MLP 12288, plus qkv/out.
Timing: CUDA events via triton.testing.do_bench (median, warm-up first, rotating inputs), in --rounds rounds
that each time every path once in a rotating order (times: median over rounds; ratios: median of the per-round
ratios, so a clock drift during the run does not enter them); each path's
one-time weight preparation (NVFP4->FP8 conversion) happens before timing, per-call work (activation
quantization, weight dequantization) is inside. Accuracy vs the fp32 product of the *unquantized* weights:
relative error ||y - y_ref|| / ||y_ref|| and SNR dB on M=1024 (or the smallest M given).

"ck" = comfy-kitchen's NVFP4 linear as ComfyUI runs it on this GPU. On sm < 10 ComfyUI disables the nvfp4
compute format and runs it with full_precision_mm: ck.dequantize_nvfp4(weight) -> bf16, then F.linear.
The backend comfy-kitchen picked (cuda / triton / eager) is reported.
"""
import argparse
import json
import math
import platform
import statistics
import sys
import time

import _pack
import torch
import torch.nn.functional as F

from seedvr2bw.optimization.nvfp4 import format as fmt
from seedvr2bw.optimization.nvfp4 import kernels as K
from seedvr2bw.optimization.nvfp4 import launch
from seedvr2bw.optimization.nvfp4.fp4_gemm import fp4_gemm_supported
from seedvr2bw.optimization.nvfp4.linear import NVFP4Linear

DEFAULT_SHAPES = "2560x6912,6912x2560,3072x12288,12288x3072,3072x9216,3072x3072"
DEFAULT_M = "64,256,1024,4096,16384,32768"


def _bench(fn, warmup_ms=25, rep_ms=100):
    from triton.testing import do_bench
    return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def _timed_call(fn, xs, inner):
    """``inner`` calls of fn over the rotating inputs xs (a model queues layers back to back)."""
    it = [0]

    def call():
        for _ in range(inner):
            it[0] = (it[0] + 1) % len(xs)
            out = fn(xs[it[0]])
        return out
    return call


def _ck_setup():
    try:
        import comfy_kitchen as ck
        backends = ck.list_backends()
        return ck, backends
    except Exception as exc:  # noqa: BLE001
        return None, f"comfy-kitchen unavailable: {type(exc).__name__}: {exc}"



# (BLOCK_N, BLOCK_M, BLOCK_K, num_warps, num_stages, PTX decode, transposed store) per M bucket; each tried
# with every SPLIT_K that splits the K tiles evenly (only SPLIT_K = 1 from M = 2048 on)
SWEEP_CONFIGS = {
    16: [(64, 16, 256, 4, 4, 1, 0)],
    64: [(128, 64, 64, 4, 4, 1, 0), (64, 64, 128, 4, 3, 1, 0)],
    256: [(64, 128, 128, 4, 3, 1, 0), (64, 128, 128, 4, 2, 1, 0), (64, 128, 128, 4, 4, 1, 0),
          (64, 256, 128, 4, 2, 1, 0)],
    1024: [(64, 128, 128, 4, 3, 1, 0), (64, 256, 128, 4, 3, 1, 0), (128, 256, 64, 8, 4, 1, 0)],
    1 << 30: [(64, 128, 64, 4, 3, 0, 0), (64, 128, 64, 4, 3, 1, 0), (64, 256, 64, 4, 3, 1, 0),
              (128, 128, 64, 8, 3, 1, 0), (128, 256, 64, 8, 3, 1, 0), (128, 256, 64, 8, 4, 1, 0),
              (128, 128, 128, 8, 3, 1, 0), (64, 256, 128, 4, 3, 1, 0), (128, 256, 64, 8, 3, 1, 1),
              (256, 128, 64, 8, 3, 1, 0)],
}
SWEEP_SPLIT_K = (1, 2, 3, 4, 6, 8, 12)


def sweep_w4a16(dev, args, shapes, ms, ck=None):
    """Fused W4A16 kernel over tile configs x SPLIT_K per M (one row each), vs bf16 cuBLAS, vs dequantize +
    bf16 cuBLAS (the fidelity path's other kernel) and vs comfy-kitchen (when given), all single calls."""
    out = []
    gen = torch.Generator(device="cpu").manual_seed(1)
    for (k, n) in shapes:
        w = (torch.randn(n, k, generator=gen) * 0.02).to(dev)
        t = fmt.quantize_nvfp4(w, return_tensor=True)
        wb = w.to(torch.bfloat16)
        for m in ms:
            cfgs = SWEEP_CONFIGS[min((b for b in SWEEP_CONFIGS if b >= m), default=max(SWEEP_CONFIGS))]
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            t_bf16 = _bench(lambda: F.linear(x, wb), rep_ms=args.rep_ms)
            wd = torch.empty((n, k), device=dev, dtype=torch.bfloat16)
            t_deq = _bench(lambda: F.linear(x, K.dequantize_nvfp4_triton(t.packed, t.block_scale, t.global_scale,
                                                                         (n, k), out=wd)), rep_ms=args.rep_ms)
            t_ck = None
            if ck is not None:
                t_ck = _bench(lambda: F.linear(x, ck.dequantize_nvfp4(t.packed, t.global_scale, t.block_scale,
                                                                      torch.bfloat16)[:n, :k]), rep_ms=args.rep_ms)
            ref = F.linear(x.float(), t.dequantize(torch.float32)[:n, :k])
            best = None
            for (bn, bm, bk, nw, st, asm, trans) in cfgs:
                k_tiles = -(-k // bk)
                for sk in (SWEEP_SPLIT_K if m < 2048 else (1,)):
                    if k_tiles % sk or k_tiles // sk < 2 or (trans and sk > 1):
                        continue
                    cfg = (bn, bm, bk, sk, nw, st, asm, trans)
                    try:
                        y = K.w4a16_linear(x, t.packed, t.block_scale, t.global_scale, n, None, config=cfg)
                        err = ((y.float() - ref).norm() / ref.norm()).item()
                        ms_ = _bench(lambda: K.w4a16_linear(x, t.packed, t.block_scale, t.global_scale, n, None,
                                                            config=cfg), rep_ms=args.rep_ms)
                        row = {"K": k, "N": n, "M": m, "config": list(cfg), "ms": ms_, "bf16_ms": t_bf16,
                               "dequant_bf16_ms": t_deq, "ck_ms": t_ck, "vs_bf16": t_bf16 / ms_, "rel_err": err,
                               "default": list(cfg[:6]) == list(K.w4a16_config(m, n, k, dev))
                               and bool(asm) == K.W4A16_ASM_DECODE and not trans}
                        if err > 5e-3:
                            row["error"] = f"relative error {err:.2e} vs the dequantized product"
                        elif best is None or ms_ < best["ms"]:
                            best = row
                    except Exception as exc:  # noqa: BLE001
                        row = {"K": k, "N": n, "M": m, "config": list(cfg), "error": str(exc).splitlines()[0][:200]}
                    out.append(row)
            dflt = next((r for r in out if r.get("default") and r["K"] == k and r["N"] == n and r["M"] == m), None)
            bad = [r for r in out if "error" in r and r["K"] == k and r["N"] == n and r["M"] == m]
            nan = float("nan")
            b_ms = best["ms"] if best else nan
            vs_ck = f", {t_ck / b_ms:.2f}x ck" if t_ck else ""
            print(f"sweep K={k} N={n} M={m}: bf16 {t_bf16:.4f} ms, dequant+bf16 {t_deq:.4f} ms, "
                  f"ck {t_ck if t_ck is not None else nan:.4f} ms, "
                  f"fused default {dflt['ms'] if dflt else nan:.4f} ms {dflt['config'] if dflt else ''}, "
                  f"fused best {b_ms:.4f} ms {best['config'] if best else ''} ({t_bf16 / b_ms:.2f}x bf16{vs_ck}); "
                  f"{len(bad)} failed" + (f": {bad[0]['config']} {bad[0]['error']}" if bad else ""), flush=True)
        del w, t, wb
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default=DEFAULT_M)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--paths", default="bf16,ck,fidelity,fp8_speed,fp4_tensorcore")
    ap.add_argument("--rep-ms", type=float, default=100)
    ap.add_argument("--acc-m", type=int, default=1024)
    ap.add_argument("--inner", type=int, default=1,
                    help="calls per timed sample (time / calls). do_bench flushes L2 before each sample, so with 1 a "
                         "path's host-side launch overhead shows up when it exceeds the GPU time of the flush; a "
                         "model queues layers back to back, which --inner 8 reproduces")
    ap.add_argument("--rounds", type=int, default=5,
                    help="timing rounds per shape; each round times every path once (rotating order); the "
                         "rep-ms budget is split between the rounds")
    ap.add_argument("--json", default=None)
    ap.add_argument("--components", action="store_true", help="also time dequant / act-quant / GEMM alone")
    ap.add_argument("--variants", action="store_true", help="also time each fidelity kernel forced")
    ap.add_argument("--sweep", action="store_true", help="tile-config x SPLIT_K sweep of the fused W4A16 kernel")
    ap.add_argument("--sweep-m", default="64,256", help="M values of the sweep")
    ap.add_argument("--sweep-only", action="store_true", help="only the sweep (no path table)")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    dev = torch.device("cuda")
    ms = [int(v) for v in args.m.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    paths = args.paths.split(",")
    if "fp4_tensorcore" in paths and not fp4_gemm_supported(dev)[0]:
        print(f"fp4_tensorcore skipped: {fp4_gemm_supported(dev)[1]}")
        paths.remove("fp4_tensorcore")
    ck, ck_info = _ck_setup() if "ck" in paths else (None, "not requested")
    if "ck" in paths and ck is None:
        print(ck_info)
        paths.remove("ck")
    info = {"device": torch.cuda.get_device_name(dev), "capability": list(torch.cuda.get_device_capability(dev)),
            "torch": torch.__version__, "cuda": torch.version.cuda, "commit": _pack.git_commit(),
            "python": platform.python_version(), "comfy_kitchen": str(ck_info),
            "triton": __import__("triton").__version__ if K.HAS_TRITON else None, "paths": paths,
            "time": time.strftime("%Y-%m-%d %H:%M:%S"), "inner": args.inner, "rounds": args.rounds}
    if ck is not None:
        info["comfy_kitchen_version"] = getattr(ck, "__version__", "?")
    if args.variants:
        paths += ["fid_dequant", "fid_fused", "fid_rs"]
    print(json.dumps(info))
    results = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    for (k, n) in ([] if args.sweep_only else shapes):
        w = (torch.randn(n, k, generator=gen) * 0.02).to(dev)
        bias = (torch.randn(n, generator=gen) * 0.01).to(dev, torch.bfloat16)
        w_bf16 = w.to(torch.bfloat16)
        t = fmt.quantize_nvfp4(w, return_tensor=True)
        wrel = ((t.dequantize(torch.float32) - w).norm() / w.norm()).item()
        layers = {p: NVFP4Linear.from_nvfp4(t, bias=bias, path=p) for p in ("fidelity", "fp8_speed", "fp4_tensorcore")
                  if p in paths}
        if "fp8_speed" in layers:
            layers["fp8_speed"].fp8_weight(dev)        # one-time conversion, outside the timing
        for p in paths:
            if p.startswith("fid_"):
                lay = NVFP4Linear.from_nvfp4(t, bias=bias, path="fidelity")
                kind = p[4:]
                lay.fidelity_kernel = kind
                layers[p] = lay
        if ck is not None:
            ck_q = t.packed
            ck_s = t.block_scale
            ck_g = t.global_scale

            def ck_linear(x):
                wd = ck.dequantize_nvfp4(ck_q, ck_g, ck_s, torch.bfloat16)
                if wd.shape != (n, k):
                    wd = wd[:n, :k]
                return F.linear(x, wd, bias)
        fns = {"bf16": lambda x: F.linear(x, w_bf16, bias)}
        if ck is not None:
            fns["ck"] = ck_linear
        for p, layer in layers.items():
            fns[p] = layer
        for m in ms:
            xs = [torch.randn(m, k, device=dev, dtype=torch.bfloat16) for _ in range(2 if m * k > 2 ** 26 else 4)]
            row = {"K": k, "N": n, "M": m, "weight_rel_err": wrel}
            flops = 2.0 * m * k * n
            calls = {}
            for p in paths:
                if p == "fid_fused" and m > 1024:
                    continue
                calls[p] = _timed_call(fns[p], xs, args.inner)
                try:
                    calls[p]()
                    torch.cuda.synchronize()
                except Exception as exc:  # noqa: BLE001
                    row[f"{p}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                    del calls[p]
            # R rounds, each timing every path once, in an order that rotates: a clock or power drift during
            # the run then lands on every path alike. Path time = median over rounds; ratio = median of the
            # per-round ratios (bf16 and the path timed minutes apart would carry the drift into the ratio).
            samples = {p: [] for p in calls}
            order = list(calls)
            for r in range(args.rounds):
                for p in order[r % len(order):] + order[: r % len(order)]:
                    samples[p].append(_bench(calls[p], rep_ms=args.rep_ms / args.rounds) / args.inner)
            for p, ts in samples.items():
                row[f"{p}_ms"] = statistics.median(ts)
                row[f"{p}_tflops"] = flops / row[f"{p}_ms"] / 1e9
                row[f"{p}_spread"] = (max(ts) - min(ts)) / row[f"{p}_ms"]
            for p in samples:
                if p != "bf16" and "bf16" in samples:
                    row[f"{p}_vs_bf16"] = statistics.median(b / t for b, t in zip(samples["bf16"], samples[p]))
                if p not in ("bf16", "ck") and "ck" in samples:
                    row[f"{p}_vs_ck"] = statistics.median(c / t for c, t in zip(samples["ck"], samples[p]))
            if args.components and K.HAS_TRITON:
                x = xs[0]
                try:
                    row["c_dequant_ms"] = _bench(lambda: K.dequantize_nvfp4_triton(
                        t.packed, t.block_scale, t.global_scale, (n, k), torch.bfloat16), rep_ms=args.rep_ms)
                    row["c_act_fp8_ms"] = _bench(lambda: K.quantize_act_fp8_rowwise(x), rep_ms=args.rep_ms)
                    if "fp8_speed" in layers:
                        w8, sw = layers["fp8_speed"].fp8_weight(dev)
                        xq, sx = K.quantize_act_fp8_rowwise(x)
                        row["c_fp8_gemm_ms"] = _bench(lambda: torch._scaled_mm(
                            xq, w8.t(), scale_a=sx.reshape(-1, 1), scale_b=sw.reshape(1, -1), out_dtype=torch.bfloat16,
                            bias=bias, use_fast_accum=True), rep_ms=args.rep_ms)
                    if m <= 256:
                        row["c_w4a16_ms"] = _bench(lambda: K.w4a16_linear(
                            x, t.packed, t.block_scale, t.global_scale, n, bias), rep_ms=args.rep_ms)
                except Exception as exc:  # noqa: BLE001
                    row["c_error"] = str(exc).splitlines()[0]
                print("   components: " + " ".join(f"{kk[2:]}={vv:.4f}" for kk, vv in row.items()
                                                  if kk.startswith("c_") and isinstance(vv, float)), flush=True)
            if m == args.acc_m or (args.acc_m not in ms and m == ms[0]):
                x = xs[0]
                ref = x.float() @ w.t() + bias.float()
                for p in paths:
                    if p == "fid_fused" and m > 1024:
                        continue
                    try:
                        y = fns[p](x).float()
                        e = (y - ref).norm() / ref.norm()
                        row[f"{p}_rel_err"] = e.item()
                        row[f"{p}_snr_db"] = -20 * math.log10(max(e.item(), 1e-30))
                    except Exception as exc:  # noqa: BLE001
                        row[f"{p}_acc_error"] = str(exc).splitlines()[0]
            if "fidelity" in layers:
                row["fidelity_kernel"] = layers["fidelity"].decision(xs[0]).kernel
            results.append(row)
            line = f"K={k:5d} N={n:5d} M={m:5d} " + " ".join(
                f"{p}={row[f'{p}_ms']:.4f}ms" + (f"({row[f'{p}_vs_bf16']:.2f}x)" if f"{p}_vs_bf16" in row else "")
                for p in paths if f"{p}_ms" in row)
            if "fidelity_vs_ck" in row:
                line += f" fid/ck={row['fidelity_vs_ck']:.2f}x"
            if "fidelity_kernel" in row:
                line += f" [{row['fidelity_kernel']}]"
            print(line, flush=True)
            if args.json:     # written after every row, so a run cut short still leaves its numbers
                with open(args.json, "w") as fh:
                    json.dump({"info": info, "results": results, "partial": True}, fh, indent=1)
            del xs
        del layers, fns
        torch.cuda.empty_cache()
    # accuracy summary
    acc = [r for r in results if "bf16_rel_err" in r]
    summary = {}
    for p in paths:
        es = [r[f"{p}_rel_err"] for r in acc if f"{p}_rel_err" in r]
        if es:
            summary[f"{p}_rel_err_mean"] = sum(es) / len(es)
            summary[f"{p}_snr_db_mean"] = sum(-20 * math.log10(e) for e in es) / len(es)
    summary["weight_rel_err_mean"] = sum(r["weight_rel_err"] for r in acc) / max(len(acc), 1)
    from seedvr2bw.optimization.nvfp4.linear import W4A16_TRITON_BROKEN
    summary["fused_w4a16_unavailable"] = W4A16_TRITON_BROKEN[0] if W4A16_TRITON_BROKEN else None
    summary["fast_launch"] = launch.FAST_LAUNCH[0]
    print(json.dumps(summary))
    print("\n| K | N | M | " + " | ".join(f"{p} ms" for p in paths) + " | " +
          " | ".join(f"{p}/bf16" for p in paths if p != "bf16") + " | fid/ck | fid kernel |")
    print("|" + "---|" * (3 + 2 * len(paths) - 1 + 2))
    for r in results:
        cells = [f"{r.get(p + '_ms', float('nan')):.4f}" for p in paths]
        ratios = [f"{r.get(p + '_vs_bf16', float('nan')):.2f}" for p in paths if p != "bf16"]
        print(f"| {r['K']} | {r['N']} | {r['M']} | " + " | ".join(cells) + " | " + " | ".join(ratios) +
              f" | {r.get('fidelity_vs_ck', float('nan')):.2f} | {r.get('fidelity_kernel', '')} |")
    if args.sweep:
        results_sweep = sweep_w4a16(dev, args, shapes, [int(v) for v in args.sweep_m.split(",")], ck)
    else:
        results_sweep = []
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"info": info, "results": results, "accuracy": summary, "sweep": results_sweep}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
