"""One persistent multi-GPU worker of the SeedVR2 video nodes (models/seedvr2/video/workers.py starts it): loads
the two model files once (at its first chunk) and serves the pool's long-video jobs until the pool closes.

    python scripts/seedvr2_worker.py --dit DIT --vae VAE [--dtype bf16] [--attention auto] \\
        [--parallel chunks|sequence] --pool-store PATH --rank R --world N --device cuda:R
"""
from __future__ import annotations

import argparse
import logging

import _pack  # noqa: F401  (registers the checkout as `seedvr2bw`)
import torch

from seedvr2bw.models.seedvr2 import pipeline as P
from seedvr2bw.models.seedvr2.upscaler import FileUpscaler
from seedvr2bw.models.seedvr2.video.workers import PARALLEL_MODES, serve

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def settings_from(params: dict) -> P.UpscaleSettings:
    """The job's UpscaleSettings from their JSON form (``dataclasses.asdict``)."""
    d = dict(params["settings"])
    return P.UpscaleSettings(**dict(d, tiling=P.VAETiling(**d["tiling"])))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dit", required=True)
    ap.add_argument("--vae", required=True)
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--pool-store", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--device", required=True)
    ap.add_argument("--parallel", default="chunks", choices=list(PARALLEL_MODES),
                    help="whole chunks per worker, or every worker on every chunk (models resident on each)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"[worker {a.rank}] %(message)s")
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    made: list = []

    def make_upscaler(params, group):
        if not made:     # the group exists once the workers have met: the models are loaded for it
            made.append(FileUpscaler(a.dit, a.vae, device, DTYPES[a.dtype], a.attention, group=group))
        return made[0].chunk_upscaler(settings_from(params))
    try:
        serve(a.pool_store, a.rank, a.world, a.device, make_upscaler, parallel=a.parallel)
    finally:
        for upscaler in made:
            upscaler.close()


if __name__ == "__main__":
    main()
