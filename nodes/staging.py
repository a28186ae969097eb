"""Model staging for the SeedVR2 upscaler nodes: the run's memory plan from what ComfyUI can give, the VAE through
ComfyUI's model manager, the DiT through its ``DiTStager`` (host copy pinned once per loaded model, resident blocks
copied in for the DiT phase, the rest streamed, nothing copied back).

The handles are the loader nodes' outputs (``nodes.seedvr2.SeedVR2DiTModel`` / ``SeedVR2VAEModel``): a
``ModelPatcher`` (``patcher``), the torch module (``model``), for the DiT the BlockSwap settings (``blockswap``,
None: automatic) and its stager (``stager``, made on the first run on a GPU, dropped with the handle: ComfyUI's
"free model and node cache" unpins it).
"""
from __future__ import annotations

import logging

import torch

from ..models.seedvr2 import pipeline as P
from ..models.seedvr2.memory import DiTFootprint, MemoryPlan, plan_memory
from ..models.seedvr2.pipeline import PipelineHooks
from ..models.seedvr2.staging import DiTStager
from ..optimization.blockswap import BlockSwapConfig, module_bytes

_log = logging.getLogger(__name__)


def dit_stager(dit) -> DiTStager:
    """The stager of a loaded DiT (one per handle, so its pinned host copy lives as long as ComfyUI caches it)."""
    if dit.stager is None:
        dit.stager = DiTStager(dit.model)
    return dit.stager


def comfy_budget(device) -> int:
    """VRAM this run may use: free now, plus what ComfyUI can free by unloading the models it holds there, less the
    reserve ComfyUI keeps for itself."""
    import comfy.model_management as mm
    held = sum(lm.model_loaded_memory() for lm in mm.current_loaded_models if lm.device == device)
    return int(mm.get_free_memory(device) + held - mm.extra_reserved_memory())


def plan_run(dit, vae, device, frames_shape, settings: P.UpscaleSettings) -> MemoryPlan:
    """The memory plan of upscaling frames of ``frames_shape`` (T, H, W, C) on ``device`` (logged, one line);
    raises ``SeedVR2MemoryError`` / ``SeedVR2InputError`` before any work."""
    run = P.plan(torch.empty(frames_shape, device="meta"), settings)
    blocks = dit.blockswap.blocks_to_swap if dit.blockswap is not None else "auto"
    buffers = dit.blockswap.buffers if dit.blockswap is not None else 2
    if device.type == "cuda":
        footprint, budget = dit_stager(dit).footprint(device), comfy_budget(device)
    else:
        footprint, budget = DiTFootprint((), (), 0, 0), None
    reserve = dit.blockswap.reserve_bytes if dit.blockswap is not None else None
    mem = plan_memory(run, settings, footprint, module_bytes(vae.model), budget, blocks_to_swap=blocks,
                      buffers=buffers, vae_dtype=vae.dtype, channels=frames_shape[-1], reserve=reserve,
                      whole_convs=vae.model.layout_on(device) == torch.channels_last_3d)
    _log.info("%s", mem.line())
    return mem


class ModelStager:
    """Loads/offloads the two models between the pipeline phases as ``memory`` says; its methods are the
    pipeline's ``PipelineHooks``."""

    def __init__(self, dit, vae, device, memory: MemoryPlan):
        self.dit, self.vae, self.device, self.memory = dit, vae, device, memory

    def load_vae(self):
        import comfy.model_management as mm
        mm.load_models_gpu([self.vae.patcher], memory_required=max(self.memory.vae_peak_bytes),
                           force_full_load=True)

    def load_dit(self):
        import comfy.model_management as mm
        m = self.memory
        if self.device.type != "cuda":
            mm.load_models_gpu([self.dit.patcher], memory_required=m.dit_activation_bytes)
            return
        # ComfyUI unloads what it must (the VAE too, unless the plan leaves room for it) before the DiT comes in
        mm.free_memory(m.dit_gpu_bytes + m.dit_activation_bytes + (0 if m.vae_stays else m.budget), self.device,
                       keep_loaded=[lm for lm in mm.current_loaded_models if lm.model is self.vae.patcher]
                       if m.vae_stays else [])
        cfg = self.dit.blockswap or BlockSwapConfig()
        dit_stager(self.dit).attach(self.device, m, BlockSwapConfig(
            blocks_to_swap=len(m.swapped), prefetch=cfg.prefetch, buffers=cfg.buffers,
            pinned_cap_bytes=cfg.pinned_cap_bytes, debug_timing=cfg.debug_timing))

    def release_dit(self):
        import comfy.model_management as mm
        if self.device.type == "cuda":
            dit_stager(self.dit).release()
        mm.soft_empty_cache()

    def hooks(self):
        """The pipeline hooks: VAE before encode and decode, DiT before its phase, released after it."""
        return PipelineHooks(before_encode=self.load_vae, before_dit=self.load_dit, after_dit=self.release_dit,
                             before_decode=self.load_vae)
