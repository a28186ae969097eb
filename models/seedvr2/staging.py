"""The models on and off the GPU for their phases of a run, as the memory plan says.

``DiTStager(model)`` packs the DiT's host copy once (``optimization.blockswap.staging.StagedModel``: pinned arenas
kept across runs). ``footprint(device)`` is what the memory plan counts; ``attach(device, plan)`` puts the resident
blocks on the GPU and streams the others, with NVFP4 layers on the plan's path when the fast one does not fit;
``release()`` drops the GPU copies without copying anything back. ``Staging`` does the same for both models where
ComfyUI's model manager is not there (the CLI, the benchmarks); the nodes stage the VAE through ComfyUI.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from ...optimization.blockswap import BlockSwapConfig
from ...optimization.blockswap.arena import SMALL_TENSOR_BYTES
from ...optimization.blockswap.staging import StagedModel
from ...optimization.runtime.device import free_device_bytes
from .memory import DiTFootprint, MemoryPlan, dit_footprint, plan_memory
from .pipeline import PipelineHooks

_log = logging.getLogger(__name__)


class DiTStager:
    def __init__(self, model: torch.nn.Module, pool=None, small_bytes: int = SMALL_TENSOR_BYTES):
        self.model = model
        self.staged = StagedModel(model, "blocks", pool=pool, small_bytes=small_bytes)
        self._paths: Optional[list] = None

    def footprint(self, device) -> DiTFootprint:
        return dit_footprint(self.model, torch.device(device), self.staged.block_bytes, self.staged.other_bytes)

    def attach(self, device, plan: MemoryPlan, config: Optional[BlockSwapConfig] = None, backend=None):
        """The DiT on ``device`` with the plan's blocks streamed; returns the block runner."""
        if plan.nvfp4_path:
            layers = [m for m in self.model.modules() if callable(getattr(m, "derived_bytes", None))]
            self._paths = [(m, m.path) for m in layers]
            for m in layers:
                m.path = plan.nvfp4_path
        cfg = config or BlockSwapConfig(blocks_to_swap=len(plan.swapped))
        return self.staged.to_device(device, plan.swapped, cfg, backend=backend)

    def release(self) -> None:
        self.staged.release()
        for m, p in self._paths or []:
            m.path = p
        self._paths = None
        if self.staged.device is not None and self.staged.device.type == "cuda":
            # the DiT's freed buffers back to the driver: the VAE phase after it then allocates unfragmented
            torch.cuda.empty_cache()

    def close(self) -> None:
        self.release()
        self.staged.close()


def device_budget(device) -> Optional[int]:
    """VRAM a run outside ComfyUI may use on ``device``: free now plus torch's cached, unused blocks (None on the
    CPU)."""
    device = torch.device(device)
    return free_device_bytes(device) if device.type == "cuda" else None


class Staging:
    """Both models staged for runs outside ComfyUI (the CLI, the benchmarks): the DiT through its ``DiTStager``, the
    VAE as a ``StagedModel`` (its host copy pinned once too); ``hooks`` put each on the GPU for its phases only."""

    def __init__(self, dit: torch.nn.Module, vae: torch.nn.Module, pool=None, small_bytes: int = SMALL_TENSOR_BYTES):
        self.dit = DiTStager(dit, pool=pool, small_bytes=small_bytes)
        self.vae = StagedModel(vae, blocks_attr=None, pool=pool, small_bytes=small_bytes)
        self.vae_bytes = sum(self.vae.block_bytes) + self.vae.other_bytes
        self.vae_on = False

    def plan(self, run, settings, device, budget: Optional[int] = None, blocks_to_swap="auto",
             vae_dtype: torch.dtype = torch.bfloat16) -> MemoryPlan:
        """``plan_memory`` for ``run`` on ``device`` (budget: the device's free memory unless given); logged."""
        device = torch.device(device)
        budget = device_budget(device) if budget is None else budget
        mem = plan_memory(run, settings, self.dit.footprint(device), self.vae_bytes, budget,
                          blocks_to_swap=blocks_to_swap, vae_dtype=vae_dtype,
                          whole_convs=self.vae.model.layout_on(device) == torch.channels_last_3d)
        _log.info("%s", mem.line())
        return mem

    def hooks(self, device, memory: MemoryPlan, mark: Optional[Callable[[str], None]] = None) -> PipelineHooks:
        """The pipeline hooks of one run; ``mark(phase)`` (if given) is called as each phase ends (benchmarks)."""
        mark = mark or (lambda name: None)

        def vae_on():
            if not self.vae_on:
                self.vae.to_device(device)
                self.vae_on = True
            mark("vae_load")

        def before_dit():
            mark("encode")
            if not memory.vae_stays:
                self.vae_off()
            self.dit.attach(device, memory)
            mark("attach")

        def after_dit():
            mark("dit")
            self.dit.release()
            mark("release")

        return PipelineHooks(before_encode=vae_on, before_dit=before_dit, after_dit=after_dit, before_decode=vae_on)

    def vae_off(self) -> None:
        self.vae.release()
        self.vae_on = False

    def close(self) -> None:
        self.vae_off()
        self.vae.close()
        self.dit.close()
