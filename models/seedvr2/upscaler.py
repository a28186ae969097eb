"""The SeedVR2 upscaler of two model files, for the processes that have no ComfyUI model manager (the CLI, the
multi-GPU workers): both models loaded at the first chunk that runs (a resumed or invalid run loads nothing) and
kept; on a GPU they stay in host RAM and are staged per phase as each run's memory plan says. With a process
``group`` (sequence parallel) every rank holds both models on its device and runs each chunk with the others."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from . import pipeline as P
from .dit.loader import load_dit
from .embeddings import load_text_embeddings
from .memory import MemoryPlan, SeedVR2MemoryError
from .staging import Staging
from .vae.loader import load_vae


class FileUpscaler:
    def __init__(self, dit_path: str, vae_path: str, device, dtype: torch.dtype, attention: str = "auto",
                 group=None):
        self.dit_path, self.vae_path, self.attention, self.group = dit_path, vae_path, attention, group
        self.device = torch.device(device)
        self.dtype = dtype if self.device.type == "cuda" else torch.float32
        self.dit = self.vae = self.emb = None
        self.staging: Optional[Staging] = None

    def load(self) -> None:
        """Both models, once (the first chunk or ``ChunkUpscaler.fits`` calls it)."""
        if self.dit is not None:
            return
        # sequence parallel: resident, no per-rank memory plan (the ranks must run the same chunks and calls)
        where = "cpu" if self.device.type == "cuda" and self.group is None else self.device
        try:
            dit = load_dit(self.dit_path, device=where, dtype=self.dtype, attention_backend=self.attention)
            self.vae = load_vae(self.vae_path, dtype=self.dtype, device=where)
        except torch.OutOfMemoryError as exc:
            raise SeedVR2MemoryError(
                f"{self.device}: sequence parallel keeps both models on every GPU, and they do not fit on this one "
                f"({str(exc).splitlines()[0]}). Fix: multi_gpu 'chunks' (each GPU streams the models under its own "
                "memory plan), or leave this GPU out of gpus.") from exc
        self.dit = dit
        self.emb = load_text_embeddings(self.dit_path).positive
        if self.device.type == "cuda" and self.group is None:
            self.staging = Staging(self.dit, self.vae)

    def chunk_upscaler(self, settings: P.UpscaleSettings) -> "ChunkUpscaler":
        """One job's upscaler of chunks: frames (T, H, W, C) float32 in [0, 1] -> the upscaled frames, float32 on the
        device (the stream takes them to the host as pixels)."""
        return ChunkUpscaler(self, settings)

    def close(self) -> None:
        if self.staging is not None:
            self.staging.close()


class ChunkUpscaler:
    """``FileUpscaler.chunk_upscaler``: the memory plan is made once per job, by ``fits`` or at the first chunk
    (from the device's free memory), and kept for the chunks after it."""

    def __init__(self, owner: FileUpscaler, settings: P.UpscaleSettings):
        self.owner, self.settings = owner, settings
        self.memory: Optional[MemoryPlan] = None

    def _plan(self, x: torch.Tensor) -> Optional[MemoryPlan]:
        o = self.owner
        if o.staging is not None and self.memory is None:
            self.memory = o.staging.plan(P.plan(x, self.settings), self.settings, o.device, vae_dtype=o.dtype)
        return self.memory

    def fits(self, frames: int, height: int, width: int) -> Optional[str]:
        """None when this device can run chunks of ``frames`` frames of height x width under some memory plan
        (that plan is then the job's), else why not (chunk-parallel workers leave such a device out of the job)."""
        self.owner.load()
        try:
            self._plan(torch.zeros(()).expand(frames, height, width, 3))   # only its shape is read
        except SeedVR2MemoryError as exc:
            return f"{self.owner.device}: {exc}"
        return None

    def __call__(self, frames: np.ndarray) -> torch.Tensor:
        o = self.owner
        x = torch.from_numpy(frames)
        o.load()
        memory = self._plan(x)
        try:
            return P.upscale(x, o.dit, o.vae, o.emb, self.settings, device=o.device, dit_dtype=o.dtype,
                             vae_dtype=o.dtype, output_device=o.device, memory=memory,
                             hooks=o.staging.hooks(o.device, memory) if o.staging else None, group=o.group)
        except torch.OutOfMemoryError as exc:
            if o.group is None:    # a memory plan was made: its own error, not this advice
                raise
            raise SeedVR2MemoryError(
                f"{o.device}: sequence parallel ran out of GPU memory on chunks of {len(frames)} frames of "
                f"{frames.shape[2]}x{frames.shape[1]} ({str(exc).splitlines()[0]}). Fix: more GPUs, a smaller "
                "batch_size, or multi_gpu 'chunks'.") from exc
