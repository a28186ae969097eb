"""The SeedVR2 upscaler of two model files, for the processes that have no ComfyUI model manager (the CLI, the
multi-GPU workers): both models loaded at the first chunk that runs (a resumed or invalid run loads nothing) and
kept; on a GPU they stay in host RAM and are staged per phase as each run's memory plan says. With a process
``group`` (sequence parallel) every rank holds both models on its device and runs each chunk with the others."""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from . import pipeline as P
from .dit.loader import load_dit
from .embeddings import load_text_embeddings
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

    def _load(self) -> None:
        # sequence parallel: resident, no per-rank memory plan (the ranks must run the same chunks and calls)
        where = "cpu" if self.device.type == "cuda" and self.group is None else self.device
        self.dit = load_dit(self.dit_path, device=where, dtype=self.dtype, attention_backend=self.attention)
        self.vae = load_vae(self.vae_path, dtype=self.dtype, device=where)
        self.emb = load_text_embeddings(self.dit_path).positive
        if self.device.type == "cuda" and self.group is None:
            self.staging = Staging(self.dit, self.vae)

    def chunk_upscaler(self, settings: P.UpscaleSettings) -> Callable[[np.ndarray], torch.Tensor]:
        """frames (T, H, W, C) float32 in [0, 1] -> the upscaled frames, float32 on the device (the stream takes
        them to the host as pixels); the memory plan is made at the first chunk (from the device's free memory) and
        kept for the chunks after it."""
        plans = {}

        def upscale(frames: np.ndarray) -> torch.Tensor:
            x = torch.from_numpy(frames)
            if self.dit is None:
                self._load()
            memory = None
            if self.staging is not None:
                if "memory" not in plans:
                    plans["memory"] = self.staging.plan(P.plan(x, settings), settings, self.device,
                                                        vae_dtype=self.dtype)
                memory = plans["memory"]
            out = P.upscale(x, self.dit, self.vae, self.emb, settings, device=self.device, dit_dtype=self.dtype,
                            vae_dtype=self.dtype, output_device=self.device, memory=memory,
                            hooks=self.staging.hooks(self.device, memory) if self.staging else None,
                            group=self.group)
            return out
        return upscale

    def close(self) -> None:
        if self.staging is not None:
            self.staging.close()
