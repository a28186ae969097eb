"""Where the frozen FLUX base lives while a LoRA trains: its host copy stays in RAM, the blocks the memory plan
streams stay in pinned host arenas, the rest is copied onto the GPU once, and nothing is copied back at the end.

This is ``optimization.blockswap.staging.StagedModel`` (the inference stager) applied to the FLUX model's 57 blocks
(double then single, one run order) and its other children: ``to_device`` packs each unit's frozen tensors into
one host arena (the model's only host copy from then on), copies the resident units in and streams the swapped
ones through a ``BlockSwapRunner`` (whose hooks also serve the backward recompute). Trainable tensors (the LoRA)
are not the model's parameters and stay where the trainer made them. ``close`` re-points every tensor at its host
arena (no copy), frees the GPU copies and unpins; a model that was on the compute device when training started is
copied back there (the caller's layout).

A quantized base (``quant.QuantizedBase``) is made before staging, so the arenas hold its buffers in their stored
formats (e4m3, NVFP4 codes and scales) and the high-precision weights it set aside never reach the GPU.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from ..optimization.blockswap import BlockSwapConfig, BlockSwapRunner, spread_indices
from ..optimization.blockswap.staging import StagedModel

log = logging.getLogger(__name__)
GiB = 1 << 30


def _tensors(model: nn.Module) -> list:
    seen, out = set(), []
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def on_device(model: nn.Module, device) -> bool:
    """Whether every parameter and buffer of ``model`` is on ``device`` already (the caller loaded it there)."""
    device = torch.device(device)
    return all(t.device == device or (t.device.type == device.type and device.index is None)
               for t in _tensors(model))


def flux_units(dm: nn.Module) -> nn.Module:
    """A module over ``dm``'s own submodules (nothing copied): ``blocks`` = the double then the single blocks (the
    run order the memory plan counts in) and every other child; ``dm``'s direct tensors too."""
    view = nn.Module()
    view.blocks = nn.ModuleList(list(dm.double_blocks) + list(dm.single_blocks))
    for name, child in dm.named_children():
        if name not in ("double_blocks", "single_blocks"):
            view.add_module(name, child)
    for name, p in dm.named_parameters(recurse=False):
        view.register_parameter(name, p)
    for name, b in dm.named_buffers(recurse=False):
        view.register_buffer(name, b)
    return view


class TrainStaging:
    """The FLUX model staged on ``device`` with ``blocks_to_swap`` blocks (spread evenly, as the memory plan
    counts them) streamed from pinned host RAM; ``block_runner`` is the BlockSwap runner (None: all resident)."""

    def __init__(self, dm: nn.Module, device, blocks_to_swap: int = 0, backend=None, pool=None,
                 config: Optional[BlockSwapConfig] = None):
        device = torch.device(backend.device if backend is not None else device)
        self.device = device
        # a caller that loaded the model onto the compute device gets it back there; a host model stays on the host
        self.restore_device = device if device.type != "cpu" and on_device(dm, device) else None
        config = config or BlockSwapConfig(blocks_to_swap=0)
        view = flux_units(dm)
        self.swapped = spread_indices(len(view.blocks), int(blocks_to_swap))
        config = BlockSwapConfig(**{**vars(config), "blocks_to_swap": len(self.swapped)})
        self.staged = StagedModel(view, "blocks", pool=pool, small_bytes=config.small_tensor_bytes)
        self._closed = False
        try:
            runner = self.staged.to_device(device, self.swapped, config, backend)
        except BaseException:
            self.close()
            raise
        self.block_runner = runner if isinstance(runner, BlockSwapRunner) else None
        if device.type == "cuda":
            torch.cuda.empty_cache()   # a model that was on the GPU: its former storage
        blocks = self.staged.block_bytes
        log.info("[FluxLoraTrain] staged: %d of %d blocks streamed from host RAM (%.2f GiB), %.2f GiB resident on "
                 "%s, %.2f GiB pinned", len(self.swapped), len(blocks), sum(blocks[i] for i in self.swapped) / GiB,
                 (sum(blocks) - sum(blocks[i] for i in self.swapped) + self.staged.other_bytes) / GiB, device,
                 self.staged.pinned_bytes() / GiB)

    def host_tensors(self) -> list:
        """The host tensors every staged model tensor points at when not on the device (its arena views and the
        small tensors' own host copies)."""
        out = [v for _, arena in self.staged.units.values() for v in arena.host_views]
        return out + [host for _, host in self.staged.rest]

    def close(self) -> None:
        """Every tensor back on its host arena (no copy), GPU copies freed, arenas unpinned; then, for a model that
        came on the compute device, copied back there."""
        if self._closed:
            return
        self._closed = True
        self.staged.close()
        self.block_runner = None
        if self.restore_device is not None:
            with torch.no_grad():
                for t in _tensors(self.staged.model):
                    t.data = t.data.to(self.restore_device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
