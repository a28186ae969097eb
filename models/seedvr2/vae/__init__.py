"""SeedVR2 causal video VAE ("video_vae_v3") in plain PyTorch. See autoencoder.py for the API."""
from .autoencoder import VideoAutoencoder
from .causal_conv import CausalConv3d, TemporalCache
from .config import SEEDVR2_VAE, VAEConfig, config_from_state_dict
from .loader import NotASeedVR2VAE, build_vae, load_vae, read_state_dict
from .posterior import LatentDistribution, VAECancelled
from .tiling import decode_tiled, encode_tiled, plan_tiles

__all__ = [
    "VideoAutoencoder", "LatentDistribution", "VAECancelled", "CausalConv3d", "TemporalCache", "VAEConfig",
    "SEEDVR2_VAE", "config_from_state_dict", "NotASeedVR2VAE", "build_vae", "load_vae", "read_state_dict",
    "decode_tiled", "encode_tiled", "plan_tiles",
]
