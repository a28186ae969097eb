"""The DiT on and off the GPU for its phase of a run, as the memory plan says (used by the node and the benchmark).

``DiTStager(model)`` packs the DiT's host copy once (``optimization.blockswap.staging.StagedModel``: pinned arenas
kept across runs). ``footprint(device)`` is what the memory plan counts; ``attach(device, plan)`` puts the resident
blocks on the GPU and streams the others, with NVFP4 layers on the plan's path when the fast one does not fit;
``release()`` drops the GPU copies without copying anything back.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from ...optimization.blockswap import BlockSwapConfig
from ...optimization.blockswap.arena import SMALL_TENSOR_BYTES
from ...optimization.blockswap.staging import StagedModel
from .memory import DiTFootprint, MemoryPlan, dit_footprint

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
