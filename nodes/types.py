"""Socket types the pack's nodes pass between each other (the objects are never serialised)."""
from comfy_api.latest import io

SeedVR2DiT = io.Custom("SEEDVR2BW_DIT")          # models.seedvr2 DiT wrapped with its runtime settings
SeedVR2VAE = io.Custom("SEEDVR2BW_VAE")          # models.seedvr2 VAE with its tiling settings
BlockSwapConfig = io.Custom("SEEDVR2BW_BLOCKSWAP")  # optimization.blockswap.BlockSwapConfig
LoraDataset = io.Custom("SEEDVR2BW_LORA_DATASET")  # training.dataset description
LoraTrainingSettings = io.Custom("SEEDVR2BW_LORA_SETTINGS")

CATEGORY = "SeedVR2-Blackwell"
