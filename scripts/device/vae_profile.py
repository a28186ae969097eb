"""Where the SeedVR2 VAE's time goes on a GPU, and what cuDNN settings change it (device probe).

Times encode and decode of a random real-size VAE (bf16) under variants of the settings that do not change the
math: cudnn.benchmark (bench), channels_last_3d weights and activations (cl), the official memory limits off
(nolimit), torch's GroupNorm instead of the fused kernels (torchgn); "base" is the shipped default. Each variant
runs in its own round-robin slot so clock drift lands on all of them; then a torch.profiler table of the top CUDA
kernels for the baseline and one variant.

  python scripts/device/vae_profile.py --frames 9 --variants base,bench,nolimit,bench+nolimit --profile bench
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _pack  # noqa: F401,E402
import torch  # noqa: E402
from bench_vae import make_random_vae  # noqa: E402

from seedvr2bw.models.seedvr2.vae import SEEDVR2_VAE  # noqa: E402
from seedvr2bw.optimization.runtime import knobs  # noqa: E402


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def apply_variant(vae, variant: str):
    opts = set(variant.split("+"))
    os.environ["SEEDVR2BW_FUSED"] = "0" if "torchgn" in opts else "1"   # torchgn: torch's GroupNorm
    knobs.reset()
    torch.backends.cudnn.benchmark = "bench" in opts
    if "nolimit" in opts:
        vae.set_memory_limit(None, None)
    else:
        vae.set_memory_limit(SEEDVR2_VAE.conv_max_mem, SEEDVR2_VAE.norm_max_mem)
    fmt = torch.channels_last_3d if "cl" in opts else torch.contiguous_format
    for m in vae.modules():
        if isinstance(m, torch.nn.Conv3d):
            m.weight.data = m.weight.data.contiguous(memory_format=fmt)
    return fmt


def run_op(vae, op, x, z, fmt):
    if op == "encode":
        return vae.encode(x.contiguous(memory_format=fmt)).mean
    return vae.decode(z.contiguous(memory_format=fmt))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--height", type=int, default=720)
    ap.add_argument("--frames", type=int, default=9)
    ap.add_argument("--variants", default="base,bench,nolimit,bench+nolimit")
    ap.add_argument("--ops", default="encode,decode")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", default="", help="comma list of variants to profile (top CUDA kernels)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))   # out/ is git-ignored
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", action="store_true", help="profile by torch op and input shapes")
    a = ap.parse_args()
    dev = torch.device(a.device)
    vae = make_random_vae(dev, torch.bfloat16)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.rand((1, 3, a.frames, a.height, a.width), device=dev, generator=g).mul_(2).sub_(1).bfloat16()
    lt = (a.frames - 1) // 4 + 1
    z = torch.randn((1, 16, lt, a.height // 8, a.width // 8), device=dev, generator=g).bfloat16()
    variants = a.variants.split(",")
    ops = a.ops.split(",")
    times = {(v, op): [] for v in variants for op in ops}
    peaks = {}
    print(f"{torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'} torch {torch.__version__} commit {_pack.git_commit()} "
          f"{a.width}x{a.height}x{a.frames}", flush=True)
    for v in variants:                                       # warm-up (cudnn.benchmark autotunes here)
        fmt = apply_variant(vae, v)
        for op in ops:
            (torch.cuda.reset_peak_memory_stats(dev) if dev.type == "cuda" else None)
            run_op(vae, op, x, z, fmt)
            sync(dev)
            peaks[(v, op)] = torch.cuda.max_memory_allocated(dev) / 2 ** 30 if dev.type == "cuda" else 0.0
    for r in range(a.rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for v in order:
            fmt = apply_variant(vae, v)
            for op in ops:
                sync(dev)
                t0 = time.perf_counter()
                run_op(vae, op, x, z, fmt)
                sync(dev)
                times[(v, op)].append(time.perf_counter() - t0)
    rows = []
    for op in ops:
        base = statistics.median(times[(variants[0], op)])
        for v in variants:
            med = statistics.median(times[(v, op)])
            rows.append(dict(op=op, variant=v, s=med, vs_first=base / med, peak_gib=peaks[(v, op)],
                             samples=times[(v, op)]))
            print(f"{op:7s} {v:22s} {med:8.3f} s  x{base / med:5.2f} vs {variants[0]}  peak {peaks[(v, op)]:6.2f} GiB",
                  flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    with open(Path(a.out) / "vae_profile.json", "w") as f:
        json.dump(rows, f, indent=1)
    for v in filter(None, a.profile.split(",")):
        fmt = apply_variant(vae, v)
        for op in ops:
            run_op(vae, op, x, z, fmt)
            sync(dev)
            acts = [torch.profiler.ProfilerActivity.CUDA] + ([torch.profiler.ProfilerActivity.CPU] if a.shapes else [])
            with torch.profiler.profile(activities=acts, record_shapes=a.shapes) as prof:
                run_op(vae, op, x, z, fmt)
                sync(dev)
            print(f"\n=== profile {op} {v} ===")
            if a.shapes:   # which torch ops and input shapes the GPU time belongs to
                print(prof.key_averages(group_by_input_shape=True).table(
                    sort_by="cuda_time_total", row_limit=30, max_name_column_width=40, max_shapes_column_width=90))
            else:
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=90))


if __name__ == "__main__":
    main()
