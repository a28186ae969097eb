#!/usr/bin/env python
"""The whole SeedVR2 upscale (encode, DiT, decode, colour fix) at card-sized VRAM budgets, staged as the node does it.

For each model and linear format, random weights of the real shapes; per case (``720p:21`` = 21 frames upscaled to a
720p shortest edge from a half-size input) the resident run (both models on the GPU the whole time, with the plan
for the whole GPU) and then, for each ``--budgets`` B, the GPU filled until B GiB stay usable (the pack sees only B) and the run
planned by ``models/seedvr2/memory.plan_memory`` and staged by ``DiTStager`` + a staged VAE. Prints per-phase times
(plan, encode, attach, DiT, release, decode), per-run samples, allocator retries per phase, the pack's peak memory per phase (above the fill), the
ratio to the resident median of the same run and the largest difference of the output to the resident output (with
the same VAE tiles when the budget tiles: the DiT path is then compared alone).

    python scripts/bench_upscale.py --models 7b --linears bf16,nvfp4 --cases 720p:21 --budgets 12,8 --runs 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import _pack  # noqa: F401  (registers the checkout as `seedvr2bw`)
import torch

from bench_seedvr2 import random_dit
from bench_video import fill_gpu_to
from bench_vae import make_random_vae
from seedvr2bw.models.seedvr2 import pipeline as P
from seedvr2bw.models.seedvr2.dit import SEEDVR2_3B, SEEDVR2_7B
from seedvr2bw.models.seedvr2.memory import SeedVR2MemoryError
from seedvr2bw.models.seedvr2.staging import Staging
from seedvr2bw.optimization.blockswap.backend import CudaBackend
from seedvr2bw.optimization.nvfp4.surgery import quantize_model_linears

GIB = 1 << 30
SHORT = {"480p": 480, "720p": 720, "1080p": 1080}


def build(model: str, linears: str, dev):
    torch.manual_seed(0)
    dit = random_dit(SEEDVR2_7B if model == "7b" else SEEDVR2_3B, "auto")
    if linears in ("nvfp4", "fp8"):
        quantize_model_linears(dit, path="auto", fmt_name=linears)
    dit.to("cpu")
    vae = make_random_vae(dev, torch.bfloat16).to("cpu")
    emb = torch.randn(58, 5120, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    torch.cuda.empty_cache()
    return dit, vae, emb


def case_inputs(case: str):
    """(frames, settings) of a case such as ``720p:21``: n random frames at half the target size (360x640 -> 720p),
    one chunk, wavelet colour fix."""
    res, n = case.split(":")
    n, short = int(n), SHORT[res]
    frames = torch.rand(n, short // 2, short * 16 // 9 // 2, 3, generator=torch.Generator().manual_seed(1))
    return frames, P.UpscaleSettings(resolution=short, batch_size=P.next_4n1(n), color_correction="wavelet")


def budget_now(dev) -> int:
    """What the pack may use: the device's free memory once torch's cache is handed back (cached holes inside
    segments that also hold live tensors are not counted: an allocation may not fit them)."""
    torch.cuda.empty_cache()
    return int(torch.cuda.mem_get_info(dev)[0])


class Phases:
    """Wall time, allocator retries and the pack's peak memory (above what was allocated at the start: the fill)
    between the pipeline's hooks."""

    def __init__(self, dev):
        self.dev, self.t, self.marks = dev, {}, []
        self.base = torch.cuda.memory_allocated(dev)

    def mark(self, name):
        torch.cuda.synchronize(self.dev)
        st = torch.cuda.memory_stats(self.dev)
        self.marks.append((name, time.perf_counter(), st.get("num_alloc_retries", 0),
                           torch.cuda.max_memory_allocated(self.dev)))
        torch.cuda.reset_peak_memory_stats(self.dev)

    def spans(self):
        out = {}
        for (a, ta, ra, _), (b, tb, rb, pb) in zip(self.marks, self.marks[1:]):
            out[b] = {"s": tb - ta, "retries": rb - ra, "peak_gib": (pb - self.base) / GIB}
        return out


def staged_run(frames, settings, staging, emb, dev, budget, blocks_to_swap="auto"):
    ph = Phases(dev)
    ph.mark("start")
    mem = staging.plan(P.plan(frames, settings), settings, dev, budget, blocks_to_swap)
    ph.mark("plan")
    try:
        out = P.upscale(frames, staging.dit.model, staging.vae.model, emb, device=dev, dit_dtype=torch.bfloat16,
                        vae_dtype=torch.bfloat16, output_device="cpu", hooks=staging.hooks(dev, mem, ph.mark),
                        memory=mem)
    except torch.OutOfMemoryError as exc:
        # where it ran out, under which plan, and what the pack held then
        exc.where = (f"in the phase after '{ph.marks[-1][0]}' under {mem.line()}; pack allocated "
                     f"{(torch.cuda.memory_allocated(dev) - ph.base) / GIB:.2f} GiB, reserved by torch "
                     f"{(torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)) / GIB:.2f} GiB unused")
        staging.dit.release()
        staging.vae_off()
        raise
    ph.mark("decode")
    staging.vae_off()
    ph.mark("vae_release")
    return out, mem, ph.spans()


def resident_run(frames, settings, dit, vae, emb, dev, memory=None):
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    out = P.upscale(frames, dit, vae, emb, settings, device=dev, dit_dtype=torch.bfloat16, vae_dtype=torch.bfloat16,
                    output_device="cpu", memory=memory)
    torch.cuda.synchronize(dev)
    return out, time.perf_counter() - t0


def rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / GIB


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="7b")
    ap.add_argument("--linears", default="bf16,nvfp4")
    ap.add_argument("--cases", default="720p:21")
    ap.add_argument("--budgets", default="12,8")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--commit", default="")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    info = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "commit": args.commit,
            "total_gib": torch.cuda.get_device_properties(dev).total_memory / GIB}
    print(info, flush=True)
    results = []
    for model in args.models.split(","):
        for lin in args.linears.split(","):
            dit, vae, emb = build(model, lin, dev)
            staging = Staging(dit, vae)
            dstager, vstager = staging.dit, staging.vae
            for case in args.cases.split(","):
                frames, settings = case_inputs(case)
                # resident: both models on the GPU the whole time, with the plan the node makes for the whole GPU
                # (one VAE tile grid for the run: tiles sized per call from the free memory vary run to run, and
                # each new conv shape is autotuned by cuDNN again)
                whole = staging.plan(P.plan(frames, settings), settings, dev, budget_now(dev))
                vstager.to_device(dev)
                dstager.staged.to_device(dev, ())
                times = []
                for i in range(args.warmup + args.runs):
                    ref, t = resident_run(frames, settings, dit, vae, emb, dev, memory=whole)
                    if i >= args.warmup:
                        times.append(t)
                res_med = statistics.median(times)
                dstager.release()
                vstager.release()
                row = {"model": model, "linears": lin, "case": case, "budget_gib": None, "runs_s": times,
                       "median_s": res_med}
                results.append(row)
                print(f"{model} {lin} {case} resident: median {res_med:.2f} s  runs {[round(x, 2) for x in times]}"
                      f"\n    {whole.line()}", flush=True)
                for b in [float(x) for x in args.budgets.split(",") if x]:
                    hold = fill_gpu_to(b, dev)
                    budget = budget_now(dev)
                    samples, err, firsts = [], None, []
                    rss, pinned = [], []
                    try:
                        for i in range(args.warmup + args.runs):
                            out, mem, spans = staged_run(frames, settings, staging, emb, dev, budget)
                            rss.append(rss_gib())
                            pinned.append(CudaBackend.registered_bytes() / GIB)
                            firsts.append(sum(v["s"] for v in spans.values()))
                            if i >= args.warmup:
                                samples.append(spans)
                    except (SeedVR2MemoryError, torch.OutOfMemoryError) as exc:
                        err = f"{type(exc).__name__} {getattr(exc, 'where', '')}: {str(exc)[:200]}"
                    del hold
                    torch.cuda.empty_cache()
                    row = {"model": model, "linears": lin, "case": case, "budget_gib": b, "error": err}
                    if samples:
                        totals = [sum(v["s"] for k, v in sp.items()) for sp in samples]
                        med = statistics.median(totals)
                        # the DiT path alone: the resident models with the budget run's VAE tiles
                        vstager.to_device(dev)
                        dstager.staged.to_device(dev, ())
                        same_tiles, _ = resident_run(frames, settings, dit, vae, emb, dev, memory=mem)
                        dstager.release()
                        vstager.release()
                        row.update(plan=mem.line(), runs_s=totals, first_run_s=firsts[0], median_s=med,
                                   ratio=med / res_med,
                                   spread=(max(totals) - min(totals)) / med, phases=samples, rss_gib=rss,
                                   pinned_gib=pinned, diff_vs_resident=float((out - ref).abs().max()),
                                   diff_vs_resident_same_tiles=float((out - same_tiles).abs().max()))
                        ph = {k: round(statistics.median(sp[k]["s"] for sp in samples), 3) for k in samples[0]}
                        retries = {k: max(sp[k]["retries"] for sp in samples) for k in samples[0]}
                        peaks = {k: round(max(sp[k]["peak_gib"] for sp in samples), 2) for k in samples[0]}
                        print(f"  {b:g} GiB: median {med:.2f} s ({med / res_med:.2f}x resident), first run "
                              f"{firsts[0]:.2f} s, runs {[round(x, 2) for x in totals]}\n    {mem.line()}\n    phases {ph}\n    retries "
                              f"{retries}\n    peak GiB {peaks}\n    diff vs resident {row['diff_vs_resident']:.4f}, "
                              f"same tiles {row['diff_vs_resident_same_tiles']:.2e}; RSS {rss[0]:.1f}->{rss[-1]:.1f} "
                              f"GiB, pinned {pinned[0]:.1f}->{pinned[-1]:.1f} GiB", flush=True)
                    else:
                        print(f"  {b:g} GiB: {err}", flush=True)
                    results.append(row)
            staging.close()
            del dit, vae, staging, dstager, vstager
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
