"""One "mmdit_sr" transformer block (docs/SPEC.md §1.6), shared by both variants.

    a = ada_in(RMSNorm(x), attn); a = attention(a); x = x + ada_gate(a, attn)
    m = ada_in(RMSNorm(x), mlp);  m = MLP(m);       x = x + ada_gate(m, mlp)

on the video and the text stream (separate or shared weights). 3B last block: the text stream skips the
ada and the whole MLP half (its modules are "video-only"), so its q/k/v come from the un-modulated
normalised text; its output is discarded. The last block of either variant does not compute text
outputs at all, since nothing reads them.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import nn

from .attention import AttentionContext, NaSwinAttention
from .config import DiTConfig
from .mm import MMPair
from .mlp import make_mlp
from .modulation import AdaSingle, gated_residual_fused as gated_residual, gated_residual_norm_modulate, norm_modulate_in
from .norm import rms_norm


class MMSRBlock(nn.Module):
    def __init__(self, cfg: DiTConfig, index: int, device=None, dtype=None):
        super().__init__()
        self.index = index
        self.eps = cfg.norm_eps
        self.window_method = cfg.window_methods[index]
        self.is_last = index == cfg.num_layers - 1
        self.text_skip = cfg.last_text_skip(index)
        shared = cfg.shared(index)
        self.attn = NaSwinAttention(
            cfg.dim, cfg.heads, cfg.head_dim, cfg.norm_eps, shared,
            "mmrope3d" if cfg.variant == "3b" else "pixel", cfg.rope_dim, self.window_method,
            device=device, dtype=dtype,
        )
        self.mlp = MMPair(lambda: make_mlp(cfg.mlp_type, cfg.dim, cfg.mlp_hidden, device, dtype), shared, vid_only=self.text_skip)
        self.ada = MMPair(lambda: AdaSingle(cfg.dim, device, dtype), shared, vid_only=self.text_skip)

    def forward(self, vid: torch.Tensor, txt: torch.Tensor, emb: torch.Tensor, ctx: AttentionContext,
                vid_lens: List[int], txt_lens: List[int]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """emb: (B, dim, 2, 3) view of the interleaved time embedding."""
        e_attn, e_mlp = emb[:, :, 0], emb[:, :, 1]
        ada_v, ada_t = self.ada.for_vid(), self.ada.for_txt()

        a_v = norm_modulate_in(vid, e_attn, ada_v.attn_shift, ada_v.attn_scale, vid_lens, self.eps)
        if self.text_skip:
            a_t = rms_norm(txt, None, self.eps)
        else:
            a_t = norm_modulate_in(txt, e_attn, ada_t.attn_shift, ada_t.attn_scale, txt_lens, self.eps)
        o_v, o_t = self.attn(a_v, a_t, ctx, need_txt=not self.is_last)
        vid, m_v = gated_residual_norm_modulate(vid, o_v, e_attn, ada_v.attn_gate, e_mlp, ada_v.mlp_shift,
                                                ada_v.mlp_scale, vid_lens, self.eps)
        vid = gated_residual(vid, self.mlp.for_vid()(m_v), e_mlp, ada_v.mlp_gate, vid_lens)
        if self.is_last:
            return vid, None  # text output of the last block is never used

        txt, m_t = gated_residual_norm_modulate(txt, o_t, e_attn, ada_t.attn_gate, e_mlp, ada_t.mlp_shift,
                                                ada_t.mlp_scale, txt_lens, self.eps)
        txt = gated_residual(txt, self.mlp.for_txt()(m_t), e_mlp, ada_t.mlp_gate, txt_lens)
        return vid, txt
