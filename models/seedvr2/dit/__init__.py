"""SeedVR2 DiT (3B and 7B) in plain PyTorch, loading the official checkpoints by their key names."""
from .config import CONFIGS, SEEDVR2_3B, SEEDVR2_7B, DiTConfig, config_from_reference_kwargs  # noqa: F401
from .nadit import DiTInterrupted, NaDiT  # noqa: F401
from .loader import (  # noqa: F401
    DiTCheckpointError,
    build_dit,
    config_from_state_dict,
    detect_variant,
    load_dit,
    read_state_dict,
)
