"""NaDiT, the SeedVR2 diffusion transformer (3B = official dit_v2 path, 7B = official dit path).

Forward follows the official call: ``forward(vid, txt, vid_shape, txt_shape, timestep)`` with packed
tokens (docs/SPEC.md §1): vid (sum T*H*W, 33) latent tokens, txt (sum L, 5120), vid_shape (B, 3) = [T, H, W] in
latent units, txt_shape (B, 1), timestep (B,) on the 0..1000 scale. Returns the velocity
(sum T*H*W, 16) in the same token order (the official ``.vid_sample``), in the compute dtype.

Structure kept for the other parts of the pack:
* ``self.blocks`` (nn.ModuleList) is run as ``for block in self.block_runner.iterate(self.blocks)``;
  embeddings, patch in/out and the output head are outside ``self.blocks``.
* attention goes through ``optimization.attention.varlen_attention``; the backend is the attribute
  ``attention_backend`` ("auto" is resolved once per device).
* window indices, cu_seqlens and RoPE tables are built once per input shape and cached.
* ``should_stop`` (attribute or forward argument) is called between blocks; it may raise (ComfyUI's
  interrupt check does) or return True, which raises :class:`DiTInterrupted`.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ....optimization.attention import resolve_backend
from ....optimization.blockswap import ResidentRunner
from .attention import AttentionContext
from .block import MMSRBlock
from .config import DiTConfig
from .embedding import PatchIn, PatchOut, TimeEmbedding
from .modulation import OutAda, modulate_in, split_embedding
from .norm import RMSNorm
from .rope import lang_freqs, make_rope_table, pixel_freqs, text_angles, video_angles
from .window import build_joint_layout



class DiTInterrupted(RuntimeError):
    """Raised between blocks when ``should_stop()`` returns True."""


class NaDiT(nn.Module):
    def __init__(self, config: DiTConfig, attention_backend: str = "auto", block_runner=None,
                 device=None, dtype=None):
        super().__init__()
        c = self.config = config
        self.vid_in = PatchIn(c.vid_in_channels, c.patch_size, c.dim, device=device, dtype=dtype)
        self.txt_in = nn.Linear(c.txt_in_dim, c.dim, device=device, dtype=dtype)
        self.emb_in = TimeEmbedding(c.sinusoidal_dim, c.dim, c.emb_dim, device=device, dtype=dtype)
        self.blocks = nn.ModuleList([MMSRBlock(c, i, device=device, dtype=dtype) for i in range(c.num_layers)])
        if c.has_out_norm:
            self.vid_out_norm = RMSNorm(c.dim, c.norm_eps, device=device, dtype=dtype)
            self.vid_out_ada = OutAda(c.dim, device=device, dtype=dtype)
        self.vid_out = PatchOut(c.vid_out_channels, c.patch_size, c.dim, device=device, dtype=dtype)

        self.block_runner = block_runner if block_runner is not None else ResidentRunner()
        self.attention_backend = attention_backend
        self.compute_dtype: Optional[torch.dtype] = None  # None: the dtype of vid_in.proj.weight
        self.should_stop: Optional[Callable[[], bool]] = None
        self._resolved_backend: Dict[str, str] = {}
        self._contexts: "OrderedDict[tuple, dict]" = OrderedDict()
        self.max_cached_shapes = 4

    # ---- attributes ---------------------------------------------------------------------------
    @property
    def variant(self) -> str:
        return self.config.variant

    @property
    def attention_backend(self) -> str:
        return self._attention_backend

    @attention_backend.setter
    def attention_backend(self, name: str) -> None:
        self._attention_backend = name
        self._resolved_backend = {}

    def backend_for(self, device: torch.device) -> str:
        key = str(device)
        if key not in self._resolved_backend:
            self._resolved_backend[key] = resolve_backend(self._attention_backend, device)
        return self._resolved_backend[key]

    def clear_cache(self) -> None:
        """Drop the per-shape layouts/RoPE tables (also done on load_state_dict)."""
        self._contexts.clear()

    def load_state_dict(self, *args, **kwargs):
        self.clear_cache()
        return super().load_state_dict(*args, **kwargs)

    def run_dtype(self) -> torch.dtype:
        """The dtype the forward computes in: ``compute_dtype``, else the float dtype of the weights (bf16 for
        quantized ones)."""
        if self.compute_dtype is not None:
            return self.compute_dtype
        dt = self.vid_in.proj.weight.dtype
        return dt if dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64) else torch.bfloat16

    # ---- per-shape precomputation ---------------------------------------------------------------
    def rope_freqs(self) -> torch.Tensor:
        """The RoPE frequencies, computed from the config in fp32. The per-block ``rope.rope.freqs``
        buffers hold the same constants (kept for the checkpoint keys; the loader checks them). Reading
        the constants here, not a block buffer, keeps the tables valid while a block runner has the
        blocks' tensors elsewhere (BlockSwap)."""
        axis = self.config.rope_dim // 3
        return lang_freqs(axis) if self.config.variant == "3b" else pixel_freqs(axis)

    def cached(self, key: tuple, build: Callable[[], object]):
        """The per-shape value under ``key`` (layouts and RoPE tables, a sequence-parallel plan), built by ``build()``
        on first use; the ``max_cached_shapes`` most recently used are kept, all dropped by ``clear_cache``."""
        value = self._contexts.get(key)
        if value is not None:
            self._contexts.move_to_end(key)
            return value
        value = self._contexts[key] = build()
        while len(self._contexts) > self.max_cached_shapes:
            self._contexts.popitem(last=False)
        return value

    def _context(self, grids: List[Tuple[int, int, int]], txt_lens: List[int], device) -> Dict[str, AttentionContext]:
        key = (tuple(grids), tuple(txt_lens), str(device), self._attention_backend)
        return self.cached(key, lambda: self._build_context(grids, txt_lens, device))

    def _build_context(self, grids, txt_lens, device) -> Dict[str, AttentionContext]:
        backend = self.backend_for(device)
        kind = "mmrope3d" if self.config.variant == "3b" else "pixel"
        ctx = {}
        for method in dict.fromkeys(self.config.window_methods):
            lay = build_joint_layout(grids, txt_lens, method, self.config.window, device)
            freqs = self.rope_freqs()
            vid_rope = make_rope_table(video_angles(kind, freqs, lay.coords, lay.sizes, lay.txt_offset), device)
            txt_rope = None
            if kind == "mmrope3d":
                txt_rope = make_rope_table(torch.cat([text_angles(freqs, L) for L in txt_lens]), device)
            ctx[method] = AttentionContext(lay, vid_rope, txt_rope, backend)
        return ctx

    # ---- forward ----------------------------------------------------------------------------
    def forward(self, vid: torch.Tensor, txt: torch.Tensor, vid_shape: torch.Tensor, txt_shape: torch.Tensor,
                timestep, should_stop: Optional[Callable[[], bool]] = None,
                debug: Optional[dict] = None) -> torch.Tensor:
        """``debug``: a dict that receives the intermediates (``vid_in``, ``txt_in``, ``emb_in``,
        ``block{i}.vid``, ``block{i}.txt``, ``vid_out_in``) without changing the computation."""
        should_stop = should_stop if should_stop is not None else self.should_stop
        device = vid.device
        dtype = self.run_dtype()
        shapes = [tuple(int(v) for v in s) for s in vid_shape.tolist()]
        txt_lens = [int(s[0]) for s in txt_shape.tolist()]
        pt, ph, pw = self.config.patch_size
        grids = [(t // pt, h // ph, w // pw) for t, h, w in shapes]
        vid_lens = [t * h * w for t, h, w in grids]
        B = len(shapes)

        txt = self.txt_in(txt.to(dtype))
        vid = self.vid_in(vid.to(dtype), shapes)
        if not torch.is_tensor(timestep):
            timestep = torch.tensor([float(timestep)], device=device)
        timestep = timestep.to(device).reshape(-1)
        if timestep.numel() == 1 and B > 1:
            timestep = timestep.expand(B)
        emb = self.emb_in(timestep, dtype)  # (B, 6*dim)
        if debug is not None:
            debug["vid_in"], debug["txt_in"], debug["emb_in"] = vid, txt, emb

        ctx = self._context(grids, txt_lens, device)
        e = split_embedding(emb)  # (B, dim, 2, 3)
        for block in self.block_runner.iterate(self.blocks):
            if should_stop is not None and should_stop():
                raise DiTInterrupted("DiT forward interrupted between blocks")
            vid, txt = block(vid, txt, e, ctx[block.window_method], vid_lens, txt_lens)
            if debug is not None:
                debug[f"block{block.index}.vid"] = vid
                if txt is not None:
                    debug[f"block{block.index}.txt"] = txt

        if self.config.has_out_norm:
            # Quirk of the official 3B (docs/SPEC.md §4.1): the output modulation takes its time-embedding part
            # from the cached per-token *attn* slot, i.e. x*(e[6d+1] + out_scale) + (e[6d+0] + out_shift).
            vid = self.vid_out_norm(vid)
            vid = modulate_in(vid, e[:, :, 0], self.vid_out_ada.out_shift, self.vid_out_ada.out_scale, vid_lens)
        if debug is not None:
            debug["vid_out_in"] = vid
        return self.vid_out(vid, grids)
