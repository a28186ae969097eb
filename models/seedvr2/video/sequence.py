"""A long video sequence parallel: every rank upscales every chunk together (``pipeline.upscale(group=...)``: the
DiT's windows and the VAE's rows split), for clips whose chunks are too large or too slow for one GPU.

Rank 0 runs the streaming upscale (it reads the chunks, writes the output, resumes) and hands each chunk's frames to
the other ranks, which only follow: ``lead`` wraps rank 0's chunk upscaler, ``follow`` is the other ranks' loop.
The frames travel on ``control`` (a gloo group: CPU tensors), the model work on the compute group.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from .stream import StreamResult, StreamSettings, upscale_video

END, ABORT = 0, -1      # the header's first entry when no chunk follows


def compute_group(device: torch.device):
    """The group the model work runs on (call on every rank of an initialised default gloo group): NCCL between
    GPUs, the default gloo group itself between CPU processes."""
    return dist.new_group(backend="nccl") if torch.device(device).type == "cuda" else dist.group.WORLD


def lead(upscale_chunk: Callable[[np.ndarray], np.ndarray], control=None):
    """(rank 0's chunk upscaler, ``done(ok)``): each chunk is sent to the other ranks before it is upscaled;
    ``done`` tells them the video ended (or failed) and must be called once, also after an error."""
    def chunk(frames: np.ndarray) -> np.ndarray:
        frames = np.ascontiguousarray(frames, dtype=np.float32)
        dist.broadcast(torch.tensor(frames.shape, dtype=torch.int64), 0, group=control)
        dist.broadcast(torch.from_numpy(frames), 0, group=control)
        return upscale_chunk(frames)

    def done(ok: bool = True) -> None:
        dist.broadcast(torch.tensor([END if ok else ABORT, 0, 0, 0], dtype=torch.int64), 0, group=control)
    return chunk, done


def follow(upscale_chunk: Callable[[np.ndarray], np.ndarray], control=None) -> int:
    """The other ranks' part: upscale each chunk rank 0 sends, until it says the video ended; returns the chunks
    done. Raises if rank 0 reported a failure."""
    n = 0
    while True:
        header = torch.zeros(4, dtype=torch.int64)
        dist.broadcast(header, 0, group=control)
        if int(header[0]) == END:
            return n
        if int(header[0]) == ABORT:
            raise RuntimeError("rank 0 stopped the sequence-parallel video (see its error)")
        frames = torch.empty(tuple(int(v) for v in header), dtype=torch.float32)
        dist.broadcast(frames, 0, group=control)
        upscale_chunk(frames.numpy())
        n += 1


def upscale_video_sequence(in_path: str, out_path: str, upscale_chunk: Callable[[np.ndarray], np.ndarray],
                           out_size: Callable[[int, int], tuple[int, int]], settings: Optional[StreamSettings] = None,
                           model_key: str = "", progress=None, control=None) -> Optional[StreamResult]:
    """Call on every rank: rank 0 runs the streaming upscale (reads, resumes, writes) and sends each chunk to the
    others, which follow (``upscale_chunk`` runs every chunk on every rank). Rank 0's result; None elsewhere."""
    if dist.get_rank() != 0:
        follow(upscale_chunk, control)
        return None
    chunk, done = lead(upscale_chunk, control)
    ok = False
    try:
        res = upscale_video(in_path, out_path, chunk, out_size, settings, model_key=model_key, progress=progress)
        ok = True
    finally:
        done(ok)
    return res
