"""DiT configurations: the two released SeedVR2 models and the tiny golden-test models.

One dataclass covers both code paths. ``variant`` selects the behaviour that differs between the
official ``models/dit_v2`` (3B) and ``models/dit`` (7B) code (docs/SPEC.md §4):

==============  ==========================================  =====================================
                3B (dit_v2)                                 7B (dit)
==============  ==========================================  =====================================
MLP             SwiGLU, no bias                             GELU(tanh), with bias
RoPE            mmrope3d on video and text                  axial "pixel" RoPE on video only
shared weights  blocks >= ``mm_layers`` use one ``.all``    every block has ``.vid``/``.txt``
last block      text skips ada and MLP (vid_only modules)   no special case
output head     RMSNorm(w) + modulation + Linear            Linear
==============  ==========================================  =====================================
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

WIN = "720pwin_by_size_bysize"
SWIN = "720pswin_by_size_bysize"


@dataclass(frozen=True)
class DiTConfig:
    variant: str  # "3b" (dit_v2 code path) or "7b" (dit code path)
    dim: int  # vid_dim == txt_dim
    heads: int
    head_dim: int
    num_layers: int
    txt_in_dim: int = 5120
    vid_in_channels: int = 33
    vid_out_channels: int = 16
    emb_dim: Optional[int] = None  # 6 * dim
    expand_ratio: int = 4
    mm_layers: Optional[int] = None  # 3B: blocks < mm_layers keep separate vid/txt weights; 7B: all
    rope_dim: Optional[int] = None  # 3B: rope_dim (128); 7B: head_dim // 2 (the official constructor)
    norm_eps: float = 1e-5
    patch_size: Tuple[int, int, int] = (1, 2, 2)
    window: Tuple[int, int, int] = (4, 3, 3)  # window *counts* at the 720p reference grid
    window_methods: Optional[Tuple[str, ...]] = None  # default: win on even blocks, swin on odd
    sinusoidal_dim: int = 256

    def __post_init__(self):
        if self.variant not in ("3b", "7b"):
            raise ValueError(f"DiTConfig.variant must be '3b' or '7b', got {self.variant!r}")
        if self.emb_dim is None:
            object.__setattr__(self, "emb_dim", 6 * self.dim)
        if self.emb_dim != 6 * self.dim:
            raise ValueError("AdaSingle needs emb_dim == 6 * dim")
        if self.mm_layers is None:
            object.__setattr__(self, "mm_layers", self.num_layers)
        if self.rope_dim is None:
            object.__setattr__(self, "rope_dim", self.head_dim if self.variant == "3b" else self.head_dim // 2)
        if self.window_methods is None:
            object.__setattr__(self, "window_methods", tuple(WIN if i % 2 == 0 else SWIN for i in range(self.num_layers)))
        if len(self.window_methods) != self.num_layers:
            raise ValueError("window_methods must have one entry per block")

    # ---- derived sizes --------------------------------------------------------------------------
    @property
    def inner_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def mlp_hidden(self) -> int:
        if self.variant == "3b":
            # SwiGLU: int(2*dim*expand/3), rounded up to a multiple of 256 (6912 for dim 2560)
            hidden = int(2 * self.dim * self.expand_ratio / 3)
            return 256 * ((hidden + 255) // 256)
        return self.dim * self.expand_ratio

    @property
    def mlp_type(self) -> str:
        return "swiglu" if self.variant == "3b" else "gelu"

    @property
    def has_out_norm(self) -> bool:
        return self.variant == "3b"

    @property
    def rope_freqs_count(self) -> int:
        # rotary-embedding-torch on one axis of dim d = rope_dim // 3 keeps d // 2 frequencies
        return (self.rope_dim // 3) // 2

    def shared(self, i: int) -> bool:
        """3B blocks >= mm_layers share one weight set between video and text."""
        return self.variant == "3b" and i >= self.mm_layers

    def last_text_skip(self, i: int) -> bool:
        """3B: the text stream of the last block skips ada and MLP (its modules are video-only)."""
        return self.variant == "3b" and i == self.num_layers - 1


# The released models (SeedVR: configs_3b/main.yaml, configs_7b/main.yaml)
SEEDVR2_3B = DiTConfig(variant="3b", dim=2560, heads=20, head_dim=128, num_layers=32, mm_layers=10, rope_dim=128)
SEEDVR2_7B = DiTConfig(variant="7b", dim=3072, heads=24, head_dim=128, num_layers=36)
CONFIGS = {"3b": SEEDVR2_3B, "7b": SEEDVR2_7B}


def config_from_reference_kwargs(kwargs: Dict[str, Any]) -> DiTConfig:
    """Build a config from the official NaDiT constructor kwargs (as recorded in the golden manifest)."""
    variant = "3b" if kwargs.get("rope_type") == "mmrope3d" or kwargs.get("mlp_type") == "swiglu" else "7b"
    if kwargs.get("vid_dim") != kwargs.get("txt_dim", kwargs.get("vid_dim")):
        raise ValueError("only vid_dim == txt_dim is supported (as in both released models)")
    window = kwargs.get("window", (4, 3, 3))
    if isinstance(window[0], (list, tuple)):
        if any(tuple(w) != tuple(window[0]) for w in window):
            raise ValueError("per-block windows differ; only one window count is supported")
        window = window[0]
    methods = kwargs.get("window_method")
    if isinstance(methods, str):
        methods = [methods] * kwargs["num_layers"]
    return DiTConfig(
        variant=variant,
        dim=kwargs["vid_dim"],
        heads=kwargs["heads"],
        head_dim=kwargs["head_dim"],
        num_layers=kwargs["num_layers"],
        txt_in_dim=kwargs["txt_in_dim"],
        vid_in_channels=kwargs["vid_in_channels"],
        vid_out_channels=kwargs["vid_out_channels"],
        emb_dim=kwargs["emb_dim"],
        expand_ratio=kwargs["expand_ratio"],
        mm_layers=kwargs.get("mm_layers") if variant == "3b" else None,
        rope_dim=kwargs.get("rope_dim") if variant == "3b" else None,
        norm_eps=kwargs.get("norm_eps", 1e-5),
        patch_size=tuple(kwargs.get("patch_size", (1, 2, 2))),
        window=tuple(window),
        window_methods=tuple(methods) if methods is not None else None,
    )
