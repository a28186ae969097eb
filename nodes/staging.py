"""Model staging for the SeedVR2 upscaler node: puts the DiT and the VAE on the GPU between the pipeline's phases
through ComfyUI's model manager (or attaches BlockSwap to the DiT), and releases them.

The handles are the loader nodes' outputs (``nodes.seedvr2.SeedVR2DiTModel`` / ``SeedVR2VAEModel``): a
``ModelPatcher`` (``patcher``), the torch module (``model``) and, for the DiT, the BlockSwap settings
(``blockswap``, None for resident).
"""
from __future__ import annotations

import logging

import torch

from ..models.seedvr2.pipeline import PipelineHooks
from ..optimization.blockswap import BlockSwapConfig, attach_blockswap, detach

_log = logging.getLogger(__name__)


def dit_activation_bytes(dit_model: torch.nn.Module, h: int, w: int, frames: int) -> int:
    """Rough peak activation memory of one DiT step on an h x w pixel chunk of ``frames`` (4n+1) frames."""
    cfg = getattr(dit_model, "config", None)
    dim = getattr(cfg, "dim", 2560)
    tokens = ((frames - 1) // 4 + 1) * (h // 16) * (w // 16)
    return int(tokens * dim * 2 * 24)


def vae_activation_bytes(pixels: int, frames: int, dtype=torch.bfloat16) -> int:
    """Rough peak activation memory of decoding ``frames`` frames of ``pixels`` pixels without tiling: what
    ComfyUI is asked to free before the VAE loads (the VAE's own tiler, vae/tiling.py, then fits the tiles to
    what is free). The VAE decodes at most ~5 frames at a time (causal slicing)."""
    scale = torch.finfo(dtype).bits / 16
    return int(pixels * min(frames, 5) * 1500 * scale)   # 1500 bytes per pixel-frame at 2 bytes/element


def all_on(module: torch.nn.Module, device: torch.device) -> bool:
    def same(t):
        return t.device.type == device.type and (device.index is None or t.device.index == device.index)
    return all(same(t) for t in module.parameters()) and all(same(b) for b in module.buffers())


def unload_patcher(patcher) -> None:
    import comfy.model_management as mm
    for i in range(len(mm.current_loaded_models) - 1, -1, -1):
        lm = mm.current_loaded_models[i]
        if lm.model is patcher:
            lm.model_unload()
            mm.current_loaded_models.pop(i)


class ModelStager:
    """Loads/offloads the two models between the pipeline phases through ComfyUI's model manager; its methods are
    the pipeline's ``PipelineHooks``."""

    def __init__(self, dit, vae, device, dit_bytes: int, vae_bytes: int):
        self.dit, self.vae, self.device = dit, vae, device
        self.dit_bytes, self.vae_bytes = dit_bytes, vae_bytes
        self.swapping = False

    def load_vae(self):
        import comfy.model_management as mm
        mm.load_models_gpu([self.vae.patcher], memory_required=self.vae_bytes, force_full_load=True)

    def load_dit(self):
        import comfy.model_management as mm
        if self.dit.blockswap is not None:
            if self.device.type == "cuda":
                self._attach_blockswap(self.dit.blockswap)
                return
            _log.info("[SeedVR2-BW] BlockSwap is for CUDA GPUs; running resident on %s", self.device)
        mm.load_models_gpu([self.dit.patcher], memory_required=self.dit_bytes)
        if not all_on(self.dit.model, self.device):
            # ComfyUI could only load part of the model (not enough free VRAM): stream the blocks instead.
            _log.warning("[SeedVR2-BW] the DiT does not fit into free VRAM; using BlockSwap (auto). "
                         "Connect a BlockSwap node to choose the settings.")
            unload_patcher(self.dit.patcher)
            self._attach_blockswap(BlockSwapConfig())

    def _attach_blockswap(self, config):
        import comfy.model_management as mm
        unload_patcher(self.dit.patcher)
        mm.free_memory(self.dit_bytes + (2 << 30), self.device)
        attach_blockswap(self.dit.model, config, self.device)
        self.swapping = True

    def release_dit(self):
        import comfy.model_management as mm
        if self.swapping:
            detach(self.dit.model, restore_device="cpu")
            self.dit.model.to(self.dit.patcher.offload_device)
            self.swapping = False
        mm.soft_empty_cache()

    def hooks(self):
        """The pipeline hooks: VAE before encode and decode, DiT before its phase, released after it."""
        return PipelineHooks(before_encode=self.load_vae, before_dit=self.load_dit, after_dit=self.release_dit,
                             before_decode=self.load_vae)
