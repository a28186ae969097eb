"""Joint windowed attention, "NaSwinAttention" (docs/SPEC.md §1.7).

qkv = Linear(dim -> 3*heads*head_dim, no bias), viewed as (3, heads, head_dim); per-head RMS qk-norm;
RoPE; every window attends over [its video tokens, all text tokens of the sample]; text outputs are
averaged over the windows; out = Linear(heads*head_dim -> dim, bias).

Norm and RoPE are per token, so they run on the tokens in their original order; ``layout.pack``
scatters them into the packed segments (one pass) and ``layout.vid_pos`` reads the video outputs back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
from torch import nn

from ....optimization import fused
from ....optimization.attention import varlen_attention
from .mm import MMPair
from .norm import RMSNorm
from .rope import RoPE3d, RopeTable, apply_rope
from .window import JointLayout


@dataclass
class AttentionContext:
    """What one block needs about the current input shape (built once per shape by the model)."""

    layout: JointLayout
    vid_rope: Optional[RopeTable]
    txt_rope: Optional[RopeTable]  # 3B only (text is rotated too)
    backend: str
    # Sequence parallel (dit/sequence_parallel.py): this rank holds only some windows, so the text copies of the
    # others join through this function (packed attention output -> text output), not through the local mean.
    txt_combine: Optional[Callable[[torch.Tensor], torch.Tensor]] = None


class NaSwinAttention(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int, eps: float, shared: bool, rope_kind: str,
                 rope_dim: int, window_method: str, device=None, dtype=None):
        super().__init__()
        inner = heads * head_dim
        self.heads, self.head_dim = heads, head_dim
        self.window_method = window_method
        self.proj_qkv = MMPair(lambda: nn.Linear(dim, 3 * inner, bias=False, device=device, dtype=dtype), shared)
        self.proj_out = MMPair(lambda: nn.Linear(inner, dim, device=device, dtype=dtype), shared)
        self.norm_q = MMPair(lambda: RMSNorm(head_dim, eps, device=device, dtype=dtype), shared)
        self.norm_k = MMPair(lambda: RMSNorm(head_dim, eps, device=device, dtype=dtype), shared)
        self.rope = RoPE3d(rope_kind, rope_dim, device=device)

    def _qkv(self, x: torch.Tensor, stream: str, rope: Optional[RopeTable]) -> torch.Tensor:
        """(N, 3, H, D) with q and k normalised and rotated in place (no stacking copies)."""
        pick = (lambda p: p.for_vid()) if stream == "vid" else (lambda p: p.for_txt())
        qkv = pick(self.proj_qkv)(x).view(x.shape[0], 3, self.heads, self.head_dim)
        for slot, norm in ((0, self.norm_q), (1, self.norm_k)):
            y = pick(norm)(qkv[:, slot])
            if rope is not None:
                apply_rope(y, rope, out=qkv[:, slot])
            else:
                qkv[:, slot] = y
        return qkv

    def _qkv_packed_fused(self, vid: torch.Tensor, txt: torch.Tensor, ctx: AttentionContext):
        """One Triton pass per stream: qkv projection output -> q/k norm -> RoPE -> packed, contiguous
        q, k, v (N_all, H, D) (the layout every attention backend takes without copies)."""
        lay = ctx.layout
        out = vid.new_empty((3, lay.total, self.heads, self.head_dim))
        for stream, x, rope, dst, src in (("vid", vid, ctx.vid_rope, lay.vid_pos, None),
                                          ("txt", txt, ctx.txt_rope, lay.txt_slots, lay.txt_src)):
            pick = (lambda p: p.for_vid()) if stream == "vid" else (lambda p: p.for_txt())
            nq, nk = pick(self.norm_q), pick(self.norm_k)
            fused.qkv_norm_rope_pack(pick(self.proj_qkv)(x), self.heads, self.head_dim, nq.weight, nk.weight, nq.eps,
                                     rope.cos_pair if rope is not None else None,
                                     rope.sin_pair if rope is not None else None, dst, out, src=src)
        return out.unbind(0)

    def _fused_ok(self, vid: torch.Tensor, ctx: AttentionContext) -> bool:
        ropes = [r for r in (ctx.vid_rope, ctx.txt_rope) if r is not None]
        return (fused.enabled(vid) and self.head_dim % 2 == 0 and all(r.cos_pair is not None for r in ropes)
                and self.norm_q.for_vid().weight.dtype == vid.dtype)

    def forward(self, vid: torch.Tensor, txt: torch.Tensor, ctx: AttentionContext,
                need_txt: bool = True) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        lay = ctx.layout
        if self._fused_ok(vid, ctx):
            q, k, v = self._qkv_packed_fused(vid, txt, ctx)
        else:
            packed = lay.pack(self._qkv(vid, "vid", ctx.vid_rope), self._qkv(txt, "txt", ctx.txt_rope))
            q, k, v = packed.unbind(1)  # packed: [window video, text] per segment
        plan = lay.plan
        out = varlen_attention(q, k, v, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.max_seqlen_q,
                               plan.max_seqlen_k, backend=ctx.backend, plan=plan)
        out = out.flatten(1)  # (N_all, H*D)
        vid_out = self.proj_out.for_vid()(out[lay.vid_pos])
        if not need_txt:
            return vid_out, None
        if ctx.txt_combine is not None:
            return vid_out, self.proj_out.for_txt()(ctx.txt_combine(out))
        # text: mean over its copies in the windows of its sample
        txt_out = torch.cat([out[p].mean(1) for p in lay.txt_pos]) if len(lay.txt_pos) > 1 else out[lay.txt_pos[0]].mean(1)
        return vid_out, self.proj_out.for_txt()(txt_out)
