#!/usr/bin/env python
"""Benchmark the streaming long-video upscale (models/seedvr2/video) on GPUs, with random weights of the real shapes.

Single GPU (``--gpus 1``): a synthetic clip (``--frames`` at ``--in-res``, with audio) streamed file to file at a
VRAM budget (the GPU filled until ``--budget`` GiB stay usable; the DiT under BlockSwap "auto", the VAE resident),
against the same chunks run back to back through the in-memory pipeline in the same process (the frames decoded
into memory first, the models staged the same way): frames/s of both, their ratio, and the streaming run's peak
host RSS.

Several GPUs (``--gpus 1,2,4``): the chunk-parallel upscale (models/seedvr2/video/parallel.py), one process per GPU
with its own model copy, timed from the moment every model is built; throughput against 1 GPU of the same machine.

    python scripts/bench_video.py --model 7b --linears nvfp4 --frames 1440 --budget 12 --json out.json
    python scripts/bench_video.py --model 7b --frames 504 --gpus 1,2,4
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import tempfile
import time
from collections import Counter

import _pack  # noqa: F401  (registers the checkout as `seedvr2bw`)
import numpy as np
import torch

from bench_seedvr2 import random_dit, set_linears
from bench_vae import make_random_vae
from seedvr2bw.models.seedvr2 import pipeline as P
from seedvr2bw.models.seedvr2.dit import SEEDVR2_3B, SEEDVR2_7B
from seedvr2bw.models.seedvr2.video import container as C
from seedvr2bw.models.seedvr2.staging import Staging
from seedvr2bw.optimization.blockswap.backend import CudaBackend
from seedvr2bw.optimization.runtime.device import free_device_bytes
from seedvr2bw.models.seedvr2.video.stream import FrameCursor, StreamSettings, plan, upscale_video

RES = {"360p": (360, 640), "480p": (480, 854), "720p": (720, 1280)}
GIB = 1 << 30
FILL_SLACK = 64 << 20   # usable memory beyond the budget that the fill leaves (allocator rounding)


def make_clip(path: str, frames: int, h: int, w: int, fps: int = 24) -> str:
    """Moving gradients, a scene cut every ~10 s, an AAC tone; H.264 (what users have)."""
    import av
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    with av.open(path, "w") as c:
        vs = c.add_stream("libx264", rate=fps)
        vs.height, vs.width, vs.pix_fmt = h, w, "yuv420p"
        a = c.add_stream("aac", rate=48000)
        a.layout = "mono"
        shot_len = fps * 10
        for i in range(frames):
            shot, t = divmod(i, shot_len)
            base = np.array([(0.15, 0.25, 0.8), (0.85, 0.3, 0.1), (0.2, 0.8, 0.3)][shot % 3], np.float32)
            img = base * (0.6 + 0.4 * np.sin(0.02 * xx[..., None] + 0.03 * yy[..., None] + 0.05 * t
                                             + np.arange(3, dtype=np.float32)))
            vf = av.VideoFrame.from_ndarray((img * 255).astype(np.uint8), format="rgb24").reformat(format="yuv420p")
            vf.pts = i
            for p in vs.encode(vf):
                c.mux(p)
        for p in vs.encode():
            c.mux(p)
        n = frames * 48000 // fps
        fmt = a.codec_context.format.name
        for k in range(0, n, 1024):
            t = np.arange(k, min(k + 1024, n)) / 48000.0
            af = av.AudioFrame.from_ndarray((0.2 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)[None],
                                            format=fmt, layout="mono")
            af.sample_rate, af.pts = 48000, k
            for p in a.encode(af):
                c.mux(p)
        for p in a.encode():
            c.mux(p)
    return path


def release_cached(device) -> None:
    """Collects what only reference cycles keep alive (a closed trainer, its CUDA graphs and their private pools),
    then hands torch's cache back to the driver once the GPU is idle."""
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


def fill_gpu_to(budget_gib: float, device) -> list[torch.Tensor]:
    """Allocates what the GPU has usable beyond ``budget_gib`` (the pack then sees only the budget) and returns the
    fill tensors, to be held while the pack runs. Usable counts memory torch has reserved but not allocated (a later
    allocation reuses it, mem_get_info does not see it as free), as the trainer's own measure does; a second tensor
    tops up whatever the first left beyond the budget."""
    release_cached(device)
    before = torch.cuda.memory_allocated(device)
    target = int(budget_gib * GIB)
    hold = []
    for _ in range(2):
        extra = free_device_bytes(device) - target
        if extra <= FILL_SLACK:
            break
        hold.append(torch.empty(extra, dtype=torch.uint8, device=device))
    free = torch.cuda.mem_get_info(device)[0]
    usable = free_device_bytes(device)
    print(f"[bench] GPU filled for a {budget_gib:g} GiB budget: {sum(t.numel() for t in hold) / GIB:.2f} GiB held "
          f"in {len(hold)} tensor(s); the pack sees {usable / GIB:.2f} GiB usable ({free / GIB:.2f} GiB free + "
          f"{(usable - free) / GIB:.2f} GiB in torch's cache; {before / GIB:.2f} GiB allocated before the fill)",
          flush=True)
    return hold


def build_models(model: str, linears: str, device, seed: int = 0):
    cfg = SEEDVR2_7B if model == "7b" else SEEDVR2_3B
    torch.manual_seed(seed)
    dit = random_dit(cfg, "auto")
    if linears != "bf16":
        set_linears(dit, linears)
    vae = make_random_vae(device, torch.bfloat16)
    emb = torch.randn(58, 5120, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    return dit, vae, emb


def chunk_upscaler(dit, vae, emb, settings, device, staging=None):
    """Upscales one chunk; with ``staging`` both models are staged per phase as the run's memory plan (made at the
    first chunk) says, as the CLI does."""
    phases = {"n": 0}

    def run(frames: np.ndarray) -> torch.Tensor:
        t0 = time.perf_counter()
        x = torch.from_numpy(frames)
        if staging is not None and "memory" not in phases:
            phases["memory"] = staging.plan(P.plan(x, settings), settings, device)
        mem = phases.get("memory")
        out = P.upscale(x, dit, vae, emb, settings, device=device, dit_dtype=torch.bfloat16, vae_dtype=torch.bfloat16,
                        output_device=device, memory=mem,
                        hooks=staging.hooks(device, mem) if staging is not None else None)
        phases["n"] += 1
        if phases["n"] <= 3:
            print(f"  chunk of {len(frames)} frames: {time.perf_counter() - t0:.2f} s", flush=True)
        return out
    run.memory = lambda: phases.get("memory")
    return run


def warm_up(up, src: str, args) -> list:
    """Runs a chunk of each length the clip's plan has (scene cuts make shorter ones): kernels, cuDNN's autotuning
    of each new shape and BlockSwap's first pass happen before any timed run, in every process (a rank of a wider
    run would otherwise pay each new shape inside its timed run). Returns the plan's chunks."""
    chunks = plan(C.read_frames(src), args.batch, args.overlap, StreamSettings().scene_threshold)
    for n in sorted({c.end - c.start for c in chunks}, reverse=True):
        up(np.stack([f for f, _ in zip(C.read_frames(src), range(n))]))
    torch.cuda.synchronize()
    return chunks


def rss_peak_gib() -> float:
    """The process's peak RSS since start or since ``reset_rss_peak`` (Linux VmHWM)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) / 2**20
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def rss_parts_gib() -> dict:
    """The RSS now by kind (Linux): anonymous (the process's own memory: weights, frames, buffers), file (mapped
    libraries: CUDA's, torch's) and shared."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
                    out[line.split(":")[0]] = round(int(line.split()[1]) / 2**20, 3)
    except OSError:
        pass
    return out


def reset_rss_peak() -> float:
    """Sets the peak RSS back to the current RSS (Linux: clear_refs 5), so a run's own peak can be read after it
    (building random weights peaks higher than a run); returns the RSS now."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return rss_peak_gib()


def single(args, src, tmp):
    dev = torch.device("cuda")
    dit, vae, emb = build_models(args.model, args.linears, dev)
    dit.to("cpu")
    vae.to("cpu")
    staging = Staging(dit, vae)
    hold = fill_gpu_to(args.budget, dev) if args.budget else None
    settings = P.UpscaleSettings(resolution=args.resolution, batch_size=args.batch, temporal_overlap=0,
                                 color_correction="wavelet", seed=42)
    up = chunk_upscaler(dit, vae, emb, settings, dev, staging=staging)
    s = StreamSettings(batch_size=args.batch, overlap=args.overlap, codec=args.codec, resume=False)

    def size(h, w):
        return P.compute_target_size(h, w, settings.resolution)
    chunks = warm_up(up, src, args)
    rss0 = reset_rss_peak()
    t0 = time.perf_counter()
    res = upscale_video(src, os.path.join(tmp, "out.mp4"), up, size, s)
    t_stream = time.perf_counter() - t0
    rss_stream = rss_peak_gib()
    rss_parts = rss_parts_gib()
    # the same chunks back to back, frames in memory
    if args.inmem_chunks:
        # the in-memory rate from the first chunks only (a chunk's time is steady): keeps a 1,440-frame run within
        # the device's 10-minute call
        chunks = chunks[:args.inmem_chunks]
    cursor = FrameCursor(src, args.overlap)
    frames = [cursor.take(c.start, c.end) for c in chunks]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for f in frames:
        up(f).cpu()    # the in-memory pipeline's output is on the host (what the image node returns)
    torch.cuda.synchronize()
    t_mem = time.perf_counter() - t0
    n, n_mem = res.frames, sum(c.end - c.start - c.tail for c in chunks)    # each shared frame counted once
    out = {"mode": "single", "model": args.model, "linears": args.linears, "budget_gib": args.budget,
           "swapped_blocks": len(up.memory().swapped) if up.memory() else 0, "frames": n, "chunks": len(chunks),
           "stream_s": t_stream, "stream_fps": n / t_stream, "inmem_frames": n_mem, "inmem_s": t_mem,
           "inmem_fps": n_mem / t_mem, "ratio": (n / t_stream) / (n_mem / t_mem), "rss_gib_before": rss0,
           "rss_parts_gib_after": rss_parts,
           "pinned_gib": CudaBackend.registered_bytes() / GIB,
           "rss_peak_gib_stream": rss_stream}
    del hold
    return out


def _worker(rank, world, store_path, args, src, out_path, result_path):
    import torch.distributed as dist
    from seedvr2bw.models.seedvr2.video.parallel import upscale_video_distributed
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))   # as the worker pool shares the cores out
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=world)
    dit, vae, emb = build_models(args.model, args.linears, dev)
    settings = P.UpscaleSettings(resolution=args.resolution, batch_size=args.batch, temporal_overlap=0, seed=42)
    up = chunk_upscaler(dit, vae, emb, settings, dev)
    warm_up(up, src, args)
    model_s = [0.0]

    def timed(frames):   # the model's share of a chunk, to the end of its GPU work
        t = time.perf_counter()
        out = up(frames)
        torch.cuda.synchronize(dev)
        model_s[0] += time.perf_counter() - t
        return out
    parts = Counter()
    dist.barrier()
    t0 = time.perf_counter()
    res = upscale_video_distributed(dist.PrefixStore("job", store), src, out_path, timed,
                                    lambda h, w: P.compute_target_size(h, w, settings.resolution),
                                    StreamSettings(batch_size=args.batch, overlap=args.overlap, codec=args.codec,
                                                   resume=False), timings=parts)
    dist.barrier()
    row = {"rank": rank, "model_s": model_s[0], **{f"{k}_s": v for k, v in parts.items()},
           "peak_gib": torch.cuda.max_memory_allocated(dev) / GIB}
    if rank == 0:
        row.update(world=world, seconds=time.perf_counter() - t0, frames=res.frames)
    with open(f"{result_path}.{rank}", "w") as f:
        json.dump(row, f)
    dist.destroy_process_group()


def multi(args, src, tmp):
    import torch.multiprocessing as mp
    rows = []
    for world in [int(x) for x in args.gpus.split(",")]:
        if world > torch.cuda.device_count():
            continue
        store = os.path.join(tmp, f"store{world}")
        result = os.path.join(tmp, f"res{world}.json")
        mp.spawn(_worker, args=(world, store, args, src, os.path.join(tmp, f"out{world}.mp4"), result),
                 nprocs=world, join=True)
        ranks = [json.load(open(f"{result}.{k}")) for k in range(world)]
        r = dict(ranks[0], ranks=ranks, peak_gib=max(x["peak_gib"] for x in ranks))
        r["fps"] = r["frames"] / r["seconds"]
        rows.append(r)
        print(f"  {world} GPU(s): {r['seconds']:.1f} s, {r['fps']:.2f} frames/s, peak {r['peak_gib']:.1f} GiB/GPU",
              flush=True)
        for x in ranks:   # where each rank's time went (chunks includes the model's time)
            print("    rank {}: ".format(x["rank"]) + ", ".join(f"{k[:-2]} {v:.1f} s" for k, v in x.items()
                                                         if k.endswith("_s") and k != "seconds"), flush=True)
    base = next((r["fps"] for r in rows if r["world"] == 1), None)
    for r in rows:
        r["speedup"] = r["fps"] / base if base else None
        if base:
            print(f"  {r['world']} GPU(s): {r['speedup']:.2f}x 1 GPU", flush=True)
    return {"mode": "multi", "model": args.model, "linears": args.linears, "rows": rows}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="7b", choices=["3b", "7b"])
    ap.add_argument("--linears", default="bf16", choices=["bf16", "nvfp4"])
    ap.add_argument("--frames", type=int, default=1440)
    ap.add_argument("--in-res", default="360p", choices=list(RES))
    ap.add_argument("--resolution", type=int, default=720)
    ap.add_argument("--batch", type=int, default=21)
    ap.add_argument("--overlap", type=int, default=4)
    ap.add_argument("--codec", default="h264")
    ap.add_argument("--inmem-chunks", type=int, default=0, help="time the in-memory run on the first N chunks (0: all)")
    ap.add_argument("--budget", type=float, default=0.0, help="GiB left free for the pack (0: the whole GPU)")
    ap.add_argument("--gpus", default="1", help="1 (the single-GPU comparison) or a list like 1,2,4 (scaling)")
    ap.add_argument("--commit", default=os.environ.get("GIT_COMMIT", ""))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench_video_")
    h, w = RES[args.in_res]
    t0 = time.perf_counter()
    src = make_clip(os.path.join(tmp, "in.mp4"), args.frames, h, w)
    print(f"clip: {args.frames} frames {w}x{h} in {time.perf_counter() - t0:.1f} s", flush=True)
    out = multi(args, src, tmp) if "," in args.gpus else single(args, src, tmp)
    out.update({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "commit": args.commit})
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
