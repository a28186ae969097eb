"""Device probe for the RS W4A16 kernel (optimization/nvfp4/w4a16_rs.cu): correctness, then timing against bf16
F.linear and the shipped fidelity layer in the same run.

``--part check``: every config on edge shapes (M not a multiple of the tile, bias or not, zero and subnormal block
scales, grids smaller than the tile count so CTAs loop over tiles); the output is poisoned with NaN first and
compared with the fp32 product of the dequantized weight (relative L2; bf16 output rounding gives ~2e-3).
``--part time``: the six SeedVR2 shapes; per shape, CUDA-graph replays of ``--inner`` calls, ``--rounds`` rounds in
rotating order; ratio = median over rounds of bf16 / variant in the same round. Variants: ``bf16`` (F.linear on
the dequantized bf16 weight), ``layer`` (NVFP4Linear fidelity, dequantize + cuBLAS), ``rs`` (the default config),
``rsT_S`` (tokens per tile, stages), ``..._nosk`` (no stream-K tail).
    python scripts/device/rs_probe.py --part check,time [--m 4096,16384] [--variants ...] [--json out.json]
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import _pack  # noqa: E402,F401
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from seedvr2bw.optimization.nvfp4 import format as fmt  # noqa: E402
from seedvr2bw.optimization.nvfp4 import rs_w4a16 as R  # noqa: E402
from seedvr2bw.optimization.nvfp4.linear import NVFP4Linear  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _graph_timing import capture, rel  # noqa: E402

SHAPES = [(2560, 6912), (6912, 2560), (3072, 12288), (12288, 3072), (3072, 9216), (3072, 3072)]


def quantized(n, k, gen, dev, adversarial=True):
    w = torch.randn(n, k, generator=gen) * 0.02
    if adversarial:
        w[0, :64] = 0.0                       # zero blocks
        w[1, 16:48] *= 1e-5                   # subnormal E4M3 block scales
        w[5, :] *= 50.0                       # a row far above the others
    return fmt.quantize_nvfp4(w.to(dev), return_tensor=True)


def check(dev, gen, log):
    cases = [  # (M, K, N, config, grid)
        (130, 256, 128, (256, 4), None),
        (300, 640, 256, (128, 6), None),
        (1000, 512, 512, (256, 4), 3),              # 3 CTAs loop over 16 tiles (stores wait for the staging)
        (1000, 2048, 512, (256, 4), 3),             # stream-K: 1 tile over 3 CTAs (head, middle, end)
        (1000, 2048, 512, (224, 4), 7),             # stream-K: 2 tiles over 7 CTAs
        (1000, 2048, 512, (256, 4), 5),             # stream-K over 4 of 5 CTAs
        (4133, 3072, 3072, None, None),             # the default config, an M tail
        (4096, 2560, 6912, (256, 4), None),
        (4096, 6912, 2560, None, None),             # stream-K, 56 tiles over 132 CTAs
        (777, 3072, 1024, (192, 4), 5),
    ]
    worst = 0.0
    for M, Kd, N, cfg, grid in cases:
        t = quantized(N, Kd, gen, dev)
        wdq = t.dequantize(torch.float32)
        x = torch.randn(M, Kd, generator=gen).to(dev, torch.bfloat16)
        tn = (cfg or R.config_for(M, N, Kd))[0]
        sk = R.split(R.tiles(M, N, tn), Kd // 64, grid or 132)
        for with_bias in (False, True):
            bias = (torch.randn(N, generator=gen) * 0.1).to(dev, torch.bfloat16) if with_bias else None
            ref = F.linear(x.float(), wdq, bias.float() if with_bias else None)
            for rep in range(2):                    # twice: stream-K flags must be back to 0 after a launch
                out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=dev)
                y = R.rs_linear(x, t.packed, t.block_scale, t.global_scale, N, bias, cfg, grid, out=out)
                torch.cuda.synchronize()
                if y is None:
                    log(f"check M={M} K={Kd} N={N} cfg={cfg}: kernel unavailable {R.DISABLED_REASONS[-1:]}")
                    worst = float("inf")
                    continue
                e = rel(y, ref)
                nan = int(torch.isnan(y).sum())
                worst = max(worst, e if nan == 0 else float("inf"))
                log(f"check M={M} K={Kd} N={N} cfg={cfg or R.config_for(M, N, Kd)} grid={grid} split={sk} "
                    f"bias={with_bias} rep={rep}: rel {e:.2e} nan {nan}")
    log(f"check worst rel {worst:.3e} -> {'PASS' if worst < 5e-3 else 'FAIL'}")
    return worst


def time_rounds(fns, inner, rounds):
    names = list(fns)
    per = {nm: [] for nm in names}
    graphs = {nm: capture(fns[nm], inner) for nm in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for nm in order:
            g = graphs[nm]
            g.replay()
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            per[nm].append(a.elapsed_time(b) / inner)
    return per


def variant(name, x, t, n, bias):
    """fn for an rs variant name: rs | rsT_S (tokens per tile, stages) with an optional suffix _nosk (whole tiles
    only)."""
    parts = name[2:].split("_") if name.startswith("rs") else []
    nums = [int(p) for p in parts if p.isdigit()]
    cfg = (nums[0], nums[1]) if nums else None
    sk = "nosk" not in parts

    def fn(out=None):
        return R.rs_linear(x, t.packed, t.block_scale, t.global_scale, n, bias, cfg, stream_k=sk, out=out)
    return fn


def time_part(dev, gen, args, log):
    results = []
    for m in args.m:
        for k, n in args.shapes:
            t = quantized(n, k, gen, dev, adversarial=False)
            bias = (torch.randn(n, generator=gen) * 0.1).to(dev, torch.bfloat16)
            lin = NVFP4Linear.from_nvfp4(t, bias=bias, path="fidelity", dtype=torch.bfloat16)
            lin.fidelity_kernel = "dequant"
            x = torch.randn(m, k, generator=gen).to(dev, torch.bfloat16)
            wb = lin.dequantize_weight(torch.bfloat16)
            fns = {"bf16": lambda: F.linear(x, wb, bias), "layer": lambda: lin(x)}
            for nm in args.variants:
                fns[nm] = variant(nm, x, t, n, bias)
            ref = F.linear(x.float(), wb.float(), bias.float())
            errs = {}
            for nm, fn in fns.items():
                if nm.startswith("rs"):             # the output poisoned first: every element must be written
                    y = fn(torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev))
                else:
                    y = fn()
                errs[nm] = rel(y, ref) if y is not None else float("nan")
            fns = {nm: fn for nm, fn in fns.items() if errs.get(nm, 0.0) == errs.get(nm, 0.0)}
            per = time_rounds(fns, args.inner, args.rounds)
            ratio = {nm: statistics.median([per["bf16"][i] / per[nm][i] for i in range(args.rounds)]) for nm in per}
            ms = {nm: statistics.median(v) for nm, v in per.items()}
            flops = 2.0 * m * n * k
            row = {"m": m, "k": k, "n": n, "ms": ms, "x_bf16": ratio, "rel": errs,
                   "bf16_tflops": flops / ms["bf16"] / 1e9, "config": R.config_for(m, n, k),
                   "split": R.split(R.tiles(m, n, R.config_for(m, n, k)[0]), k // 64, 132)}
            results.append(row)
            log(f"M={m} {k}x{n} bf16 {ms['bf16']:.4f} ms ({row['bf16_tflops']:.0f} TF/s) | "
                + " ".join(f"{nm} {ratio[nm]:.3f}" for nm in per if nm != "bf16")
                + " | rel " + " ".join(f"{nm}={e:.1e}" for nm, e in errs.items() if nm != "bf16"))
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", default="check,time")
    ap.add_argument("--m", type=lambda v: [int(t) for t in v.split(",")], default=[4096])
    ap.add_argument("--shapes", type=lambda v: [tuple(int(a) for a in s.split("x")) for s in v.split(",")],
                    default=SHAPES)
    ap.add_argument("--variants", type=lambda v: v.split(","), default=["rs"])
    ap.add_argument("--inner", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.zeros(1, device=dev)
    gen = torch.Generator(device="cpu").manual_seed(11)
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "commit": os.environ.get("GIT_COMMIT", "unknown"), "inner": args.inner, "rounds": args.rounds}
    log(str(info))
    out = {"info": info}
    if "check" in args.part:
        out["check_worst"] = check(dev, gen, log)
    if "time" in args.part:
        out["time"] = time_part(dev, gen, args, log)
    out["log"] = lines
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
