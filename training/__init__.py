"""FLUX LoRA trainer for ComfyUI's FLUX model object (activation-side LoRA, frozen base, kohya-format output).

Importable without ComfyUI; the ComfyUI pieces (VAE/CLIP encoders, attention, progress) are used at run time.
"""
from .lora import FluxLoraNetwork, LoraTargetSpec, is_flux_diffusion_model  # noqa: F401
from .trainer import FluxLoraTrainer, TrainConfig  # noqa: F401
from .data import DatasetSpec, DatasetError, encode_dataset  # noqa: F401
