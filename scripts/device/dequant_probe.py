"""Device probe: the NVFP4 -> bf16 dequantize kernel (fidelity path at M > 256) against the HBM copy rate.

Times ``kernels._dequant_kernel`` (per-byte scale gather + table gather) and ``_dequant_blocks_kernel`` (one scale
per 16-block; PTX byte-table decode or the table gather) on the six SeedVR2 shapes, each checked bit-exact against
the first; bytes moved = packed + scales read + bf16 written; a bf16 device-to-device copy of the output size as
the ceiling measured in the same run. Then dequantize + cuBLAS at M = 4096 with each kernel vs bf16 cuBLAS.
CUDA-graph replays (8 calls per replay), medians of 25.
    python scripts/device/dequant_probe.py [--json out.json]
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import _pack  # noqa: E402,F401
import torch  # noqa: E402
import triton  # noqa: E402

from seedvr2bw.optimization.nvfp4 import format as fmt  # noqa: E402
from seedvr2bw.optimization.nvfp4 import kernels as K  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from tile_l2_probe import SHAPES, graphed  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": os.environ.get("GIT_COMMIT", "unknown")}
    print(info, flush=True)
    gen = torch.Generator(device="cpu").manual_seed(3)
    res = []
    for k, n in SHAPES:
        w = (torch.randn(n, k, generator=gen) * 0.02).to(dev)
        t = fmt.quantize_nvfp4(w, return_tensor=True)
        g = t.global_scale.float().reshape(1).to(dev)
        outs = {name: torch.empty((n, k), device=dev, dtype=torch.bfloat16) for name in ("old", "blk_asm", "blk_lut")}

        def launch(name):
            o = outs[name]
            a, _, half_c = K._dequant_args(t.packed, t.block_scale, g, o, n, k, 0)
            if name == "old":
                grid = lambda meta: (triton.cdiv(n, meta["BLOCK_R"]), triton.cdiv(half_c, meta["BLOCK_C"]))  # noqa
                return lambda: K._dequant_kernel[grid](*a)
            asm = name == "blk_asm"
            grid = lambda meta: (triton.cdiv(n, meta["BLOCK_R"]), triton.cdiv(half_c, meta["BLOCK_C"]))  # noqa
            return lambda: K._dequant_blocks_kernel[grid](*a, ASM_DECODE=asm)

        fns = {name: launch(name) for name in outs}
        for f in fns.values():
            f()
        torch.cuda.synchronize()
        exact = {name: torch.equal(outs[name].view(torch.int16), outs["old"].view(torch.int16)) for name in outs}
        nbytes = t.packed.numel() + t.block_scale.numel() + n * k * 2
        src = torch.empty((n, k), device=dev, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        t_copy = graphed(lambda: dst.copy_(src), 8)
        row = {"K": k, "N": n, "bytes": nbytes, "copy_ms": t_copy, "copy_TBps": 2 * n * k * 2 / t_copy / 1e9}
        for name, f in fns.items():
            ms = graphed(f, 8)
            row[name] = {"ms": ms, "TBps": nbytes / ms / 1e9, "exact_vs_old": exact[name],
                         "config": str(getattr(K._dequant_kernel if name == "old" else K._dequant_blocks_kernel,
                                               "best_config", ""))}
        x = torch.randn(args.m, k, device=dev, dtype=torch.bfloat16)
        wb = w.to(torch.bfloat16)
        y = torch.empty((args.m, n), device=dev, dtype=torch.bfloat16)
        row["bf16_gemm_ms"] = graphed(lambda: torch.mm(x, wb.t(), out=y), 8)
        for name in ("old", "blk_asm"):
            f = fns[name]
            o = outs[name]

            def deq_mm():
                f()
                torch.mm(x, o.t(), out=y)
            row[name]["fidelity_ms"] = graphed(deq_mm, 8)
            row[name]["fidelity_vs_bf16"] = row["bf16_gemm_ms"] / row[name]["fidelity_ms"]
        print(f"K={k} N={n}: copy {t_copy:.4f} ms ({row['copy_TBps']:.2f} TB/s) | " + " | ".join(
            f"{nm} {row[nm]['ms']:.4f} ms {row[nm]['TBps']:.2f} TB/s exact={row[nm]['exact_vs_old']}"
            for nm in outs) + f" | M={args.m}: bf16 {row['bf16_gemm_ms']:.4f}, deq(old)+mm "
            f"{row['old']['fidelity_ms']:.4f} ({row['old']['fidelity_vs_bf16']:.3f}x), deq(blk_asm)+mm "
            f"{row['blk_asm']['fidelity_ms']:.4f} ({row['blk_asm']['fidelity_vs_bf16']:.3f}x)", flush=True)
        res.append(row)
        del w, t, outs, src, dst, x, wb, y
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"info": info, "results": res}, fh, indent=1)


if __name__ == "__main__":
    main()
