"""SeedVR2 nodes: DiT loader, VAE loader, Upscaler (ComfyUI V3 API).

Model files are listed from ``models/SEEDVR2`` (folder key ``seedvr2``, also settable in
extra_model_paths.yaml) plus ComfyUI's ``diffusion_models`` (DiT) and ``vae`` (VAE) folders. The text
embeddings ``pos_emb.pt``/``neg_emb.pt`` are looked up beside the DiT file, then in the SEEDVR2 folders.

The loaded torch modules are wrapped in ``comfy.model_patcher.ModelPatcher`` objects, so ComfyUI's model
manager accounts for them: they are loaded with ``load_models_gpu`` right before use, evicted when another
model needs the memory, and unloaded by "Unload models" / ``POST /free``. The loader outputs are cached by
ComfyUI's executor while the loader inputs do not change.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Optional

import torch
from comfy_api.latest import io

from ..models.seedvr2 import pipeline as P
from ..models.seedvr2.color import COLOR_CORRECTION_MODES
from ..models.seedvr2.dit.loader import load_dit
from ..models.seedvr2.embeddings import TextEmbeddings, load_text_embeddings
from ..models.seedvr2.files import KIND_SEEDVR2_DIT, KIND_SEEDVR2_VAE, file_kind
from ..models.seedvr2.vae import load_vae
from ..optimization.attention import CHOICES as ATTENTION_CHOICES
from ..optimization.attention import backend_unavailable_reason
from ..optimization.runtime.policy import get_policy
from .staging import ModelStager, dit_stager, plan_run
from .types import CATEGORY, BlockSwapConfig, SeedVR2DiT, SeedVR2VAE

_log = logging.getLogger(__name__)

FOLDER_KEY = "seedvr2"
FOLDER_NAME = "SEEDVR2"
MODEL_EXTENSIONS = (".safetensors", ".gguf", ".pth", ".pt", ".ckpt", ".bin")
DTYPE_CHOICES = ["auto", "bf16", "fp16", "fp32"]
TILING_CHOICES = ["auto", "on", "off"]
SIZE_MODES = ["shortest_edge", "scale_factor"]
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ------------------------------------------------------------------------------------------- folders
def register_folders() -> None:
    """Make sure ``folder_paths`` knows the SEEDVR2 folder (models/SEEDVR2) under the key ``seedvr2``."""
    import folder_paths
    default = os.path.join(folder_paths.models_dir, FOLDER_NAME)
    if FOLDER_KEY not in folder_paths.folder_names_and_paths:
        folder_paths.folder_names_and_paths[FOLDER_KEY] = ([default], set(MODEL_EXTENSIONS))
    else:
        paths, exts = folder_paths.folder_names_and_paths[FOLDER_KEY]
        if default not in paths:
            paths.append(default)
        if exts:  # an empty set lists every file already; a set from elsewhere may lack .gguf
            exts.update(MODEL_EXTENSIONS)
    # extra_model_paths.yaml keys are case-sensitive; accept "SEEDVR2:" / "SeedVR2:" too
    for key, (paths, _exts) in list(folder_paths.folder_names_and_paths.items()):
        if key != FOLDER_KEY and key.lower() == FOLDER_KEY:
            for p in paths:
                folder_paths.add_model_folder_path(FOLDER_KEY, p)


def seedvr2_dirs() -> list[str]:
    import folder_paths
    register_folders()
    return folder_paths.get_folder_paths(FOLDER_KEY)


def _is_embedding(name: str) -> bool:
    stem = os.path.splitext(os.path.basename(name))[0].lower()
    return stem in ("pos_emb", "neg_emb")


def _is_vae_name(name: str) -> bool:
    return "vae" in os.path.basename(name).lower()


def _list(key: str) -> list[str]:
    import folder_paths
    try:
        files = folder_paths.get_filename_list(key)
    except KeyError:
        return []
    return [f for f in files if f.lower().endswith(MODEL_EXTENSIONS) and not _is_embedding(f)]


def _files_of_kind(kind: str, other_key: str, vae: bool) -> list[str]:
    """The files of models/SEEDVR2 and of ComfyUI's ``other_key`` folder whose header says they are ``kind``; a file
    whose header cannot be read cheaply (a .pth) is listed by its name in SEEDVR2, and always in ``other_key``."""
    import folder_paths
    names = []
    for key in (FOLDER_KEY, other_key):
        for name in _list(key):
            found = file_kind(folder_paths.get_full_path(key, name) or "")
            if found == kind or (found is None and (key == other_key or _is_vae_name(name) == vae)):
                names.append(name)
    return list(dict.fromkeys(names))


def dit_files() -> list[str]:
    register_folders()
    return _files_of_kind(KIND_SEEDVR2_DIT, "diffusion_models", vae=False)


def vae_files() -> list[str]:
    register_folders()
    return _files_of_kind(KIND_SEEDVR2_VAE, "vae", vae=True)


def resolve_model_path(name: str, keys: tuple[str, ...]) -> str:
    import folder_paths
    register_folders()
    for key in keys:
        try:
            p = folder_paths.get_full_path(key, name)
        except KeyError:
            p = None
        if p and os.path.isfile(p):
            return p
    where = []
    for key in keys:
        try:
            where += folder_paths.get_folder_paths(key)
        except KeyError:
            pass
    raise FileNotFoundError(f"model file {name!r} not found in: {', '.join(where)}")


# ------------------------------------------------------------------------------------------- handles
class _Host(torch.nn.Module):
    """Holds the model for a ModelPatcher (which writes bookkeeping attributes such as ``device`` on it)."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner
        self.device = None


def _make_patcher(model: torch.nn.Module, load_device, offload_device):
    import comfy.model_patcher
    return comfy.model_patcher.ModelPatcher(_Host(model), load_device=load_device, offload_device=offload_device)


@dataclass
class SeedVR2DiTModel:
    """What SEEDVR2BW_DIT carries: the DiT wrapped for ComfyUI's model manager + its text embeddings."""
    patcher: object
    embeddings: TextEmbeddings
    dtype: torch.dtype
    attention: str
    path: str
    variant: str
    blockswap: Optional[object] = None
    stager: Optional[object] = None       # nodes.staging.dit_stager: its host copy, pinned on the first GPU run
    workers: Optional[tuple] = None       # nodes.video: (key, WorkerPool) of the multi-GPU runs, closed with the handle

    @property
    def model(self):
        return self.patcher.model.inner


@dataclass
class SeedVR2VAEModel:
    patcher: object
    dtype: torch.dtype
    tiling: P.VAETiling = field(default_factory=P.VAETiling)
    path: str = ""

    @property
    def model(self):
        return self.patcher.model.inner


def _resolve_dtype(choice: str, device: torch.device) -> torch.dtype:
    if choice in _DTYPES:
        return _DTYPES[choice]
    if device.type == "cuda":
        import comfy.model_management as mm
        return torch.bfloat16 if mm.should_use_bf16(device) else torch.float16
    if device.type == "mps":
        return torch.float16
    return torch.float32


def _choose_attention(choice: str, device) -> str:
    if choice == "auto":
        name = get_policy(device).attention
        if name != "auto" and backend_unavailable_reason(name, device) is not None:
            name = "auto"
        return name
    why = backend_unavailable_reason(choice, device)
    if why is not None:
        _log.warning("[SeedVR2-BW] attention backend %r cannot run on %s (%s); using auto instead", choice, device, why)
        return _choose_attention("auto", device)
    return choice


def _safetensors_metadata(path: str) -> dict:
    if not path.endswith(".safetensors"):
        return {}
    try:
        from safetensors import safe_open
        with safe_open(path, framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception:  # noqa: BLE001
        return {}


# ------------------------------------------------------------------------------------------- nodes
class SeedVR2LoadDiT(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SeedVR2BW_LoadDiT",
            display_name="SeedVR2 Load DiT (SeedVR2-BW)",
            category=CATEGORY,
            description="Loads a SeedVR2 3B/7B DiT (fp16/bf16/fp32, fp8, NVFP4 or GGUF file) and its text "
                        "embeddings (baked into ComfyUI's converted files, else pos_emb.pt beside the file). Files: "
                        "models/SEEDVR2 or models/diffusion_models.",
            inputs=[
                io.Combo.Input("model", options=dit_files(),
                               tooltip="DiT checkpoint from models/SEEDVR2 or models/diffusion_models."),
                io.Combo.Input("compute_dtype", options=DTYPE_CHOICES, default="auto",
                               tooltip="dtype of the float weights and of the computation. auto: bf16 on GPUs "
                                       "that support it (fp16 otherwise), fp32 on CPU. fp8/NVFP4 files keep their "
                                       "weight format."),
                io.Combo.Input("attention", options=ATTENTION_CHOICES, default="auto",
                               tooltip="Attention backend. auto: the hardware policy's choice. A backend that "
                                       "cannot run here falls back to auto (logged)."),
                BlockSwapConfig.Input("blockswap", optional=True,
                                      tooltip="Stream transformer blocks from host RAM (BlockSwap node)."),
            ],
            outputs=[SeedVR2DiT.Output(display_name="dit")],
        )

    @classmethod
    def execute(cls, model, compute_dtype, attention, blockswap=None) -> io.NodeOutput:
        import comfy.model_management as mm
        path = resolve_model_path(model, (FOLDER_KEY, "diffusion_models"))
        device = mm.get_torch_device()
        dtype = _resolve_dtype(compute_dtype, device)
        backend = _choose_attention(attention, device)
        policy = get_policy(device)
        try:
            # weights land on the offload device; the ModelPatcher moves them to `device` when needed, and each
            # NVFP4 linear takes the path of the device it runs on
            dit = load_dit(path, device="cpu", dtype=dtype, attention_backend=backend)
        except (ValueError, NotImplementedError) as exc:
            raise ValueError(f"SeedVR2 Load DiT: {exc}") from exc
        cfg = getattr(dit, "config", None)
        emb = load_text_embeddings(path, extra_dirs=seedvr2_dirs(), expected_dim=getattr(cfg, "txt_in_dim", None))
        patcher = _make_patcher(dit, device, mm.unet_offload_device())
        _log.info("[SeedVR2-BW] DiT %s (%s, %s, attention %s)%s", os.path.basename(path),
                  getattr(cfg, "variant", "?"), dtype, backend, f"; {policy.summary()}")
        handle = SeedVR2DiTModel(patcher=patcher, embeddings=emb, dtype=dtype, attention=backend, path=path,
                                 variant=getattr(cfg, "variant", "?"), blockswap=blockswap)
        if device.type == "cuda":
            # the host copy packed and pinned once here, so no upscale run pays for it
            pinned = dit_stager(handle).staged.pin(device, cap=blockswap.pinned_cap_bytes if blockswap else None)
            _log.info("[SeedVR2-BW] DiT host copy: %.2f GiB pinned", pinned / 2**30)
        return io.NodeOutput(handle)


class SeedVR2LoadVAE(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SeedVR2BW_LoadVAE",
            display_name="SeedVR2 Load VAE (SeedVR2-BW)",
            category=CATEGORY,
            description="Loads the SeedVR2 causal video VAE (ema_vae.pth / ema_vae_fp16.safetensors) with its "
                        "spatial tiling settings. Files: models/SEEDVR2 or models/vae.",
            inputs=[
                io.Combo.Input("model", options=vae_files(), tooltip="VAE file from models/SEEDVR2 or models/vae."),
                io.Combo.Input("dtype", options=DTYPE_CHOICES, default="auto",
                               tooltip="auto: bf16 on GPUs that support it (the official setting), fp32 on CPU."),
                io.Combo.Input("encode_tiling", options=TILING_CHOICES, default="auto",
                               tooltip="auto: tile only when the frame does not fit into free VRAM."),
                io.Int.Input("encode_tile_size", default=0, min=0, max=16384, step=16,
                             tooltip="Encode tile edge in pixels; 0 = chosen from free VRAM."),
                io.Combo.Input("decode_tiling", options=TILING_CHOICES, default="auto",
                               tooltip="auto: tile only when the frame does not fit into free VRAM."),
                io.Int.Input("decode_tile_size", default=0, min=0, max=16384, step=16,
                             tooltip="Decode tile edge in output pixels; 0 = chosen from free VRAM."),
                io.Int.Input("tile_overlap", default=64, min=0, max=1024, step=16,
                             tooltip="Pixels shared by neighbouring tiles, cross-faded linearly."),
            ],
            outputs=[SeedVR2VAE.Output(display_name="vae")],
        )

    @classmethod
    def execute(cls, model, dtype, encode_tiling, encode_tile_size, decode_tiling, decode_tile_size,
                tile_overlap) -> io.NodeOutput:
        import comfy.model_management as mm
        path = resolve_model_path(model, (FOLDER_KEY, "vae"))
        device = mm.vae_device()
        torch_dtype = _resolve_dtype(dtype, device)
        meta = _safetensors_metadata(path)
        groups = meta.get("seedvr2.norm_num_groups") or meta.get("norm_num_groups")
        try:
            vae = load_vae(path, dtype=torch_dtype, device="cpu",
                           norm_num_groups=int(groups) if groups else None)
        except (ValueError, NotImplementedError) as exc:
            raise ValueError(f"SeedVR2 Load VAE: {exc}") from exc
        tiling = P.VAETiling(encode=encode_tiling, decode=decode_tiling, encode_tile=encode_tile_size,
                             decode_tile=decode_tile_size, overlap=tile_overlap)
        patcher = _make_patcher(vae, device, mm.vae_offload_device())
        return io.NodeOutput(SeedVR2VAEModel(patcher=patcher, dtype=torch_dtype, tiling=tiling, path=path))


def upscale_inputs(batch_size: int = 5, temporal_overlap: int = 0) -> list:
    """The upscale settings every SeedVR2 upscaler node offers (image batch, video, video file), in one order."""
    return [
        io.Int.Input("seed", default=42, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=True,
                     tooltip="Noise seed (drawn on the CPU: the same seed gives the same result on any GPU)."),
        io.Combo.Input("size_mode", options=SIZE_MODES, default="shortest_edge",
                       tooltip="shortest_edge: the short side becomes `resolution`; scale_factor: both "
                               "sides are multiplied by `scale_factor`."),
        io.Int.Input("resolution", default=1080, min=16, max=16384, step=2,
                     tooltip="Output shortest edge in pixels (shortest_edge mode)."),
        io.Float.Input("scale_factor", default=2.0, min=0.25, max=16.0, step=0.05,
                       tooltip="Output / input size (scale_factor mode)."),
        io.Int.Input("max_resolution", default=0, min=0, max=16384, step=2,
                     tooltip="Cap on the output's longest edge (shortest_edge mode); 0 = no cap."),
        io.Int.Input("batch_size", default=batch_size, min=1, max=1025, step=4,
                     tooltip="Frames per temporal chunk; must be 4n+1 (1, 5, 9, 13, ...). Larger chunks "
                             "are more temporally consistent and need more VRAM."),
        io.Int.Input("temporal_overlap", default=temporal_overlap, min=0, max=1024,
                     tooltip="Frames shared by consecutive chunks, cross-faded linearly (hides "
                             "chunk-boundary jumps). Must be < batch_size."),
        io.Combo.Input("color_correction", options=list(COLOR_CORRECTION_MODES), default="wavelet",
                       tooltip="wavelet: official (low frequencies from the input); adain: per-channel "
                               "mean/std; lab: mean/std in CIE Lab; none."),
    ]


def upscale_settings(seed, size_mode, resolution, scale_factor, max_resolution, batch_size, temporal_overlap,
                     color_correction, tiling) -> P.UpscaleSettings:
    """The node widgets as pipeline settings (the size fields of the mode not chosen are ignored)."""
    return P.UpscaleSettings(
        resolution=resolution, scale_factor=scale_factor if size_mode == "scale_factor" else 0.0,
        max_resolution=max_resolution if size_mode == "shortest_edge" else 0,
        batch_size=batch_size, temporal_overlap=temporal_overlap, color_correction=color_correction,
        seed=seed, tiling=tiling)


class SeedVR2Upscale(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SeedVR2BW_Upscale",
            display_name="SeedVR2 Upscale (SeedVR2-BW)",
            category=CATEGORY,
            description="One-step SeedVR2 image/video upscaling. A batch of images is treated as video frames, "
                        "processed in temporal chunks of batch_size (4n+1) frames. RGBA keeps its alpha.",
            inputs=[
                io.Image.Input("image", tooltip="Frames (a single image or a video as an image batch)."),
                SeedVR2DiT.Input("dit"),
                SeedVR2VAE.Input("vae"),
                *upscale_inputs(),
            ],
            outputs=[io.Image.Output(display_name="image")],
        )

    @classmethod
    def execute(cls, image, dit, vae, seed, size_mode, resolution, scale_factor, max_resolution, batch_size,
                temporal_overlap, color_correction) -> io.NodeOutput:
        import comfy.model_management as mm
        import comfy.utils
        device = mm.get_torch_device()
        settings = upscale_settings(seed, size_mode, resolution, scale_factor, max_resolution, batch_size,
                                    temporal_overlap, color_correction, vae.tiling)
        memory = plan_run(dit, vae, device, tuple(image.shape), settings)   # checks before the models are touched
        stager = ModelStager(dit, vae, device, memory)
        bar = None

        def progress(done, total):
            nonlocal bar
            if bar is None:
                bar = comfy.utils.ProgressBar(total)
            bar.update_absolute(done, total)

        out = P.upscale(image, dit.model, vae.model, dit.embeddings.positive, settings, device=device,
                        dit_dtype=dit.dtype, vae_dtype=vae.dtype, offload_device=mm.unet_offload_device(),
                        output_device=mm.intermediate_device(),
                        should_stop=mm.throw_exception_if_processing_interrupted,
                        progress=progress, hooks=stager.hooks(), memory=memory)
        mm.soft_empty_cache()
        return io.NodeOutput(out)


NODES = [SeedVR2LoadDiT, SeedVR2LoadVAE, SeedVR2Upscale]
