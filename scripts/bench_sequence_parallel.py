#!/usr/bin/env python
"""Latency of one whole SeedVR2 upscale (encode, DiT, decode, colour fix) sequence parallel over 1, 2, 4 GPUs.

``pipeline.upscale(..., group=)``: every rank holds both models (random weights of the real shapes, resident), runs
its share of the DiT's windows and a band of the VAE's rows, over NCCL; one process per GPU, timed from a barrier
after a warm-up run. Prints the median latency per world size, the speed-up over 1 GPU of the same machine, each
rank's peak memory, each rank's time per phase, and the largest difference of the output to the 1-GPU output.
The output stays on the GPU, as the CLI's and the multi-GPU workers' upscaler (``upscaler.FileUpscaler``) keeps it
(``--output cpu``: a host tensor, as the single-GPU ComfyUI node returns; every rank then copies the whole output).

    python scripts/bench_sequence_parallel.py --model 7b --case 1080p:21 --gpus 1,2,4 --json out.json
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import tempfile
import time

import _pack  # noqa: F401  (registers the checkout as `seedvr2bw`)
import torch

from bench_seedvr2 import random_dit
from bench_upscale import case_inputs
from bench_vae import make_random_vae
from seedvr2bw.models.seedvr2 import pipeline as P
from seedvr2bw.models.seedvr2.dit import SEEDVR2_3B, SEEDVR2_7B

def _worker(rank, world, store_path, args, out_dir):
    import torch.distributed as dist
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))   # as the worker pool shares the cores out
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            device_id=dev)
    torch.manual_seed(0)
    dit = random_dit(SEEDVR2_7B if args.model == "7b" else SEEDVR2_3B, "auto")
    vae = make_random_vae(dev, torch.bfloat16)
    emb = torch.randn(58, 5120, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    frames, settings = case_inputs(args.case)
    group = dist.group.WORLD if world > 1 else None

    marks = []

    def mark(name):
        torch.cuda.synchronize(dev)
        marks.append((name, time.perf_counter()))
    hooks = P.PipelineHooks(before_encode=lambda: mark("prepare"), before_dit=lambda: mark("encode"),
                            after_dit=lambda: mark("dit") if marks[-1][0] == "encode" else None,
                            before_decode=lambda: mark("between"))

    def run():
        return P.upscale(frames, dit, vae, emb, settings, device=dev, dit_dtype=torch.bfloat16,
                         vae_dtype=torch.bfloat16, output_device=dev if args.output == "device" else "cpu",
                         group=group, hooks=hooks)
    for _ in range(args.warmup):
        out = run()
    times, phases = [], []
    for _ in range(args.runs):
        torch.cuda.synchronize(dev)
        if group is not None:
            dist.barrier()
        marks.clear()
        mark("start")
        out = run()
        mark("decode")
        times.append(marks[-1][1] - marks[0][1])
        phases.append({b: tb - ta for (_, ta), (b, tb) in zip(marks, marks[1:])})
    peak = torch.cuda.max_memory_allocated(dev) / 2**30
    if args.profile:   # one more run under the profiler: rank 0's kernels and host calls, for where the time goes
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize(dev)
        avg = prof.key_averages()
        with open(f"{args.profile}.w{world}.r{rank}.txt", "w") as f:
            f.write(avg.table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70) + "\n")
            f.write(avg.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70) + "\n")
        if args.trace:   # each rank's timeline (chrome://tracing), gzipped
            trace = f"{tempfile.mkdtemp()}/trace.json"
            prof.export_chrome_trace(trace)
            with open(trace, "rb") as src, gzip.open(f"{args.profile}.w{world}.r{rank}.json.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
    peaks = [torch.zeros(1, device=dev) for _ in range(world)]
    dist.all_gather(peaks, torch.tensor([peak], device=dev))
    # each rank's median time per phase (prepare, encode, dit, decode + colour fix + the copy out)
    ph = {k: statistics.median(p[k] for p in phases) for k in phases[0]}
    all_ph = [None] * world
    dist.all_gather_object(all_ph, ph)
    if rank == 0:
        torch.save({"times": times, "peaks": [float(p) for p in peaks], "out": out.cpu(), "phases": all_ph},
                   f"{out_dir}/w{world}.pt")
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="7b", choices=["3b", "7b"])
    ap.add_argument("--case", default="1080p:21")
    ap.add_argument("--gpus", default="1,2,4")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--output", default="device", choices=["device", "cpu"],
                    help="where the output is returned: the GPU (the CLI, the workers) or host memory")
    ap.add_argument("--commit", default=os.environ.get("GIT_COMMIT", ""))
    ap.add_argument("--json", default="")
    ap.add_argument("--profile", default="", help="path prefix: profile one extra run per world size (a table per "
                    "rank)")
    ap.add_argument("--trace", action="store_true", help="with --profile: each rank's timeline too (.json.gz)")
    args = ap.parse_args()
    import torch.multiprocessing as mp
    info = {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "torch": torch.__version__,
            "commit": args.commit, "model": args.model, "case": args.case, "output": args.output}
    print(info, flush=True)
    tmp = tempfile.mkdtemp(prefix="sp-bench-")
    rows, base, ref = [], None, None
    for world in [int(w) for w in args.gpus.split(",")]:
        if world > torch.cuda.device_count():
            print(f"{world} GPUs: skipped ({torch.cuda.device_count()} here)", flush=True)
            continue
        mp.spawn(_worker, args=(world, os.path.join(tmp, f"store{world}"), args, tmp), nprocs=world, join=True)
        r = torch.load(os.path.join(tmp, f"w{world}.pt"))
        med = statistics.median(r["times"])
        base = base or (med if world == 1 else None)
        ref = r["out"] if world == 1 else ref
        row = {"world": world, "median_s": med, "runs_s": r["times"], "peak_gib_per_gpu": r["peaks"],
               "speedup": base / med if base else None,
               "max_diff_vs_1gpu": float((r["out"] - ref).abs().max()) if ref is not None else None,
               "phases_per_rank": r["phases"]}
        rows.append(row)
        print(f"{world} GPU(s): median {med:.2f} s" + (f" ({row['speedup']:.2f}x 1 GPU)" if base else "")
              + f", peak {max(r['peaks']):.1f} GiB/GPU, runs {[round(t, 2) for t in r['times']]}"
              + (f", output vs 1 GPU {row['max_diff_vs_1gpu']:.2e}" if row["max_diff_vs_1gpu"] is not None else ""),
              flush=True)
        for k in r["phases"][0]:
            print(f"    {k:8s} " + " ".join(f"{p[k]:6.2f}" for p in r["phases"]) + " s (per rank)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
