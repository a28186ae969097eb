#!/usr/bin/env python
"""Upscale a video file of any length with SeedVR2, file to file: bounded memory (one chunk at a time), the audio
stream copied, fps / rotation / colour tags kept, resumable after a crash (``--resume``), scene-cut-aware chunks.

    python scripts/upscale_video.py IN.mp4 OUT.mp4 --dit seedvr2_ema_3b.safetensors --vae ema_vae.safetensors \\
        [--resolution 1080 | --scale 2] [--batch-size 21] [--overlap 4] [--codec h264] [--resume] [--gpus 0,1]

Several GPUs (``--gpus 0,1,2,3`` or ``all``, or ``torchrun --nproc-per-node N scripts/upscale_video.py ...``): one
process per GPU with its own model copy takes chunks as it finishes them (models/seedvr2/video/parallel.py).
``--workers N`` does the same with N CPU processes. ``--parallel sequence``: instead, every process works on every
chunk (the DiT's windows and the VAE's rows split over them; models/seedvr2/video/sequence.py), for chunks too
large or too slow for one GPU; each process then holds both models on its GPU.

Codecs: h264 (8-bit), h265 (10-bit), prores (10-bit 4:2:2, .mov), ffv1 (16-bit lossless, .mkv), png16 (a folder of
16-bit PNGs). The text embeddings (pos_emb.pt) are looked for beside the DiT file.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import uuid

import _pack  # noqa: F401  (registers the checkout as `seedvr2bw`)
import torch
import torch.distributed as dist

try:
    from tqdm import tqdm
except ImportError:   # optional: plain progress lines instead
    tqdm = None

from seedvr2bw.models.seedvr2 import pipeline as P
from seedvr2bw.models.seedvr2.upscaler import FileUpscaler
from seedvr2bw.models.seedvr2.video.container import CODECS, VideoFileError
from seedvr2bw.models.seedvr2.video.parallel import upscale_video_distributed
from seedvr2bw.models.seedvr2.video.sequence import compute_group, upscale_video_sequence
from seedvr2bw.models.seedvr2.video.stream import StreamSettings, upscale_video
from seedvr2bw.models.seedvr2.video.workers import devices_from_spec
from seedvr2bw.models.seedvr2.video.workdir import file_id

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("input")
    ap.add_argument("output")
    ap.add_argument("--dit", required=True, help="SeedVR2 DiT file (.safetensors / .pth)")
    ap.add_argument("--vae", required=True, help="SeedVR2 VAE file")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--resolution", type=int, default=1080, help="output shortest edge (default 1080)")
    size.add_argument("--scale", type=float, default=0.0, help="output / input size instead of --resolution")
    ap.add_argument("--max-resolution", type=int, default=0, help="cap on the output's longest edge (0: none)")
    ap.add_argument("--batch-size", type=int, default=21, help="frames per chunk, 4n+1 (default 21)")
    ap.add_argument("--overlap", type=int, default=4, help="frames shared by consecutive chunks (default 4)")
    ap.add_argument("--codec", default="h264", choices=list(CODECS))
    ap.add_argument("--resume", action="store_true", help="continue from the work folder of an earlier run")
    ap.add_argument("--keep-work", action="store_true", help="keep the work folder after success")
    ap.add_argument("--scene-threshold", type=float, default=None, help="scene-cut sensitivity (0: off)")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--color-correction", default="wavelet", choices=list(P.COLOR_CORRECTION_MODES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES), help="compute dtype on the GPU")
    ap.add_argument("--gpus", default="", help="GPUs to share the chunks: a list (0,1,2) or 'all'")
    ap.add_argument("--workers", type=int, default=1, help="CPU processes to share the chunks (--device cpu)")
    ap.add_argument("--parallel", default="chunks", choices=["chunks", "sequence"],
                    help="several processes: each takes whole chunks (chunks) or all work on every chunk (sequence)")
    return ap.parse_args(argv)


def _settings(a) -> StreamSettings:
    s = StreamSettings(batch_size=a.batch_size, overlap=a.overlap, codec=a.codec, resume=a.resume,
                       keep_work=a.keep_work)
    if a.scene_threshold is not None:
        s.scene_threshold = a.scene_threshold
    s.validate()
    for p, what in ((a.dit, "--dit"), (a.vae, "--vae")):
        if not os.path.isfile(p):
            raise VideoFileError(f"{what} file {p!r} does not exist. Fix: give the path of the model file.")
    return s


def run(a, device: torch.device, store=None, show_progress: bool = True) -> int:
    """One process's part: all of the job (``store`` None), its share of a distributed job, or (``--parallel
    sequence``, a process group initialised) its part of every chunk."""
    settings = _settings(a)
    dtype = DTYPES[a.dtype] if device.type == "cuda" else torch.float32
    up = P.UpscaleSettings(resolution=a.resolution, scale_factor=a.scale, max_resolution=a.max_resolution,
                           batch_size=a.batch_size, temporal_overlap=0, color_correction=a.color_correction,
                           seed=a.seed)

    def out_size(h, w):
        return P.compute_target_size(h, w, up.resolution, up.scale_factor, up.max_resolution)

    sequence = store is not None and a.parallel == "sequence"
    group = compute_group(device) if sequence else None
    upscaler = FileUpscaler(a.dit, a.vae, device, dtype, group=group)
    upscale_chunk = upscaler.chunk_upscaler(up)
    bar = _progress_bar() if show_progress else None
    key = f"dit={file_id(a.dit)} vae={file_id(a.vae)} res={a.resolution} scale={a.scale} max={a.max_resolution} " \
          f"seed={a.seed} cc={a.color_correction} dtype={a.dtype}"
    try:
        if sequence:
            res = upscale_video_sequence(a.input, a.output, upscale_chunk, out_size, settings, model_key=key,
                                         progress=bar)
        elif store is None:
            res = upscale_video(a.input, a.output, upscale_chunk, out_size, settings, model_key=key, progress=bar)
        else:
            res = upscale_video_distributed(store, a.input, a.output, upscale_chunk, out_size, settings,
                                            model_key=key, progress=bar)
    finally:
        if bar is not None:
            bar.close()
        upscaler.close()
    if res is not None:
        print(f"wrote {res.out_path}: {res.frames} frames, {res.chunks} chunks ({res.resumed_chunks} resumed), "
              f"{res.fps:.2f} frames/s")
    return 0


def _worker(rank: int, world: int, store_path: str, a, devices: list) -> None:
    device = torch.device(devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=world)
    try:
        run(a, device, dist.PrefixStore("job", store), show_progress=rank == 0)
        # every rank leaves together: a rank tearing its connections down while another still runs made gloo's
        # background threads abort that other process (seen with --parallel sequence, where rank 0 works longest)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    a = parse_args(argv)
    try:
        _settings(a)
        gpus = devices_from_spec(a.gpus)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:      # started by torchrun
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            local = int(os.environ.get("LOCAL_RANK", rank))
            device = torch.device(f"cuda:{local}") if torch.cuda.is_available() else torch.device("cpu")
            if device.type == "cuda":
                torch.cuda.set_device(device)
            dist.init_process_group("gloo")
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1, world, rank == 0)
            try:
                code = run(a, device, dist.PrefixStore("job", store), show_progress=rank == 0)
                dist.barrier()          # leave together (see _worker)
                return code
            finally:
                dist.destroy_process_group()
        devices = gpus or (["cpu"] * a.workers if a.workers > 1 else [])
        if len(devices) > 1:
            import torch.multiprocessing as mp
            store_path = os.path.join(tempfile.gettempdir(), f"seedvr2bw-store-{uuid.uuid4().hex}")
            try:
                mp.spawn(_worker, args=(len(devices), store_path, a, devices), nprocs=len(devices), join=True)
            finally:
                if os.path.exists(store_path):
                    os.remove(store_path)
            return 0
        return run(a, torch.device(devices[0] if devices else a.device))
    except VideoFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


class _progress_bar:
    """tqdm over frames, with the rate and the time left the streaming upscale reports."""

    def __init__(self):
        self.bar = None

    def __call__(self, done, total, fps, left):
        if self.bar is None:
            self.bar = tqdm(total=total, unit="frame") if tqdm is not None else False
        if self.bar:
            self.bar.n = done
            self.bar.set_postfix_str(f"{fps:.2f} frames/s, {left:.0f} s left" if fps else "")
            self.bar.refresh()
        else:
            print(f"{done}/{total} frames  {fps:.2f} frames/s  {left:.0f} s left", flush=True)

    def close(self):
        if self.bar:
            self.bar.close()


if __name__ == "__main__":
    sys.exit(main())
