#!/usr/bin/env python
"""Upscale a video file of any length with SeedVR2, file to file: bounded memory (one chunk at a time), the audio
stream copied, fps / rotation / colour tags kept, resumable after a crash (``--resume``), scene-cut-aware chunks.

    python scripts/upscale_video.py IN.mp4 OUT.mp4 --dit seedvr2_ema_3b.safetensors --vae ema_vae.safetensors \\
        [--resolution 1080 | --scale 2] [--batch-size 21] [--overlap 4] [--codec h264] [--resume]

Codecs: h264 (8-bit), h265 (10-bit), prores (10-bit 4:2:2, .mov), ffv1 (16-bit lossless, .mkv), png16 (a folder of
16-bit PNGs). The text embeddings (pos_emb.pt) are looked for beside the DiT file.
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys

import _pack  # noqa: F401  (registers the checkout as `seedvr2bw`)
import torch

try:
    from tqdm import tqdm
except ImportError:   # optional: plain progress lines instead
    tqdm = None

from seedvr2bw.models.seedvr2 import pipeline as P
from seedvr2bw.models.seedvr2.dit.loader import load_dit
from seedvr2bw.models.seedvr2.embeddings import load_text_embeddings
from seedvr2bw.models.seedvr2.vae.loader import load_vae
from seedvr2bw.models.seedvr2.video.container import CODECS, VideoFileError
from seedvr2bw.models.seedvr2.video.stream import StreamSettings, upscale_video

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
    return ap.parse_args(argv)


def _file_id(path: str) -> str:
    st = os.stat(path)
    return hashlib.sha1(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    a = parse_args(argv)
    settings = StreamSettings(batch_size=a.batch_size, overlap=a.overlap, codec=a.codec, resume=a.resume,
                              keep_work=a.keep_work)
    if a.scene_threshold is not None:
        settings.scene_threshold = a.scene_threshold
    try:
        settings.validate()
        for p, what in ((a.dit, "--dit"), (a.vae, "--vae")):
            if not os.path.isfile(p):
                raise VideoFileError(f"{what} file {p!r} does not exist. Fix: give the path of the model file.")
    except VideoFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    device = torch.device(a.device)
    dtype = DTYPES[a.dtype] if device.type == "cuda" else torch.float32
    up = P.UpscaleSettings(resolution=a.resolution, scale_factor=a.scale, max_resolution=a.max_resolution,
                           batch_size=a.batch_size, temporal_overlap=0, color_correction=a.color_correction,
                           seed=a.seed)

    def out_size(h, w):
        return P.compute_target_size(h, w, up.resolution, up.scale_factor, up.max_resolution)

    models = {}

    def upscale_chunk(frames):
        if not models:   # loaded at the first chunk that runs: a resumed or invalid run loads nothing
            models["dit"] = load_dit(a.dit, device=device, dtype=dtype)
            models["vae"] = load_vae(a.vae, dtype=dtype, device=device)
            models["emb"] = load_text_embeddings(a.dit).positive
        x = torch.from_numpy(frames)
        out = P.upscale(x, models["dit"], models["vae"], models["emb"], up, device=device, dit_dtype=dtype,
                        vae_dtype=dtype, output_device="cpu")
        return out.numpy()

    bar = _progress_bar()
    key = f"dit={_file_id(a.dit)} vae={_file_id(a.vae)} res={a.resolution} scale={a.scale} max={a.max_resolution} " \
          f"seed={a.seed} cc={a.color_correction} dtype={a.dtype}"
    try:
        res = upscale_video(a.input, a.output, upscale_chunk, out_size, settings, model_key=key, progress=bar)
    except VideoFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        bar.close()
    print(f"wrote {res.out_path}: {res.frames} frames, {res.chunks} chunks ({res.resumed_chunks} resumed), "
          f"{res.fps:.2f} frames/s")
    return 0


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
