"""3-D window partition of the video tokens and the joint (window + text) attention layout (docs/SPEC.md §1.7, §3).

The window methods take the patched grid (t, h, w) and the window *counts* at the 720p reference grid
(4, 3, 3) and return half-open (t, h, w) ranges, listed w outermost, then h, then t (the official order).

:func:`build_joint_layout` turns them, once per input shape, into index tensors for the hot path:
each attention segment is "the video tokens of one window, then all text tokens of that sample". The
text tokens are copied into every window; their outputs are averaged over the copies.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

import torch

from ....optimization.attention import VarlenPlan, make_varlen_plan

Range = Tuple[int, int]
Window = Tuple[Range, Range, Range]  # (t, h, w) half-open ranges


def _window_sizes(size: Sequence[int], num_windows: Sequence[int]) -> Tuple[int, int, int]:
    """Window sizes from counts at 720p: scale the grid to ~45x80 tokens (Python round, halves to
    even), split that into the counts, cap the temporal extent at 30 latent frames."""
    t, h, w = size
    nt, nh, nw = num_windows
    scale = math.sqrt((45 * 80) / (h * w))
    resized_h, resized_w = round(h * scale), round(w * scale)
    return math.ceil(min(t, 30) / nt), math.ceil(resized_h / nh), math.ceil(resized_w / nw)


def _unshifted_ranges(n: int, k: int) -> List[Range]:
    return [(i * k, min((i + 1) * k, n)) for i in range(math.ceil(n / k)) if min((i + 1) * k, n) > i * k]


def _shifted_ranges(n: int, k: int) -> List[Range]:
    if k >= n:  # no shift on an axis that one window covers
        return [(0, n)]
    # windows offset by half a window; int() truncates toward zero as in the reference
    count = math.ceil((n - 0.5) / k) + 1
    out = []
    for i in range(count):
        a, b = max(int((i - 0.5) * k), 0), min(int((i - 0.5 + 1) * k), n)
        if b > a:
            out.append((a, b))
    return out


def _combine(rt: List[Range], rh: List[Range], rw: List[Range]) -> List[Window]:
    return [(t, h, w) for w in rw for h in rh for t in rt]  # w outermost, t innermost


def windows_720p(size: Sequence[int], num_windows: Sequence[int]) -> List[Window]:
    """``720pwin_by_size_bysize``: windows from 0, the last one on each axis truncated."""
    t, h, w = size
    wt, wh, ww = _window_sizes(size, num_windows)
    return _combine(_unshifted_ranges(t, wt), _unshifted_ranges(h, wh), _unshifted_ranges(w, ww))


def shifted_windows_720p(size: Sequence[int], num_windows: Sequence[int]) -> List[Window]:
    """``720pswin_by_size_bysize``: the same sizes, shifted by half a window where an axis has >1 window."""
    t, h, w = size
    wt, wh, ww = _window_sizes(size, num_windows)
    return _combine(_shifted_ranges(t, wt), _shifted_ranges(h, wh), _shifted_ranges(w, ww))


WINDOW_METHODS: Dict[str, Callable[[Sequence[int], Sequence[int]], List[Window]]] = {
    "720pwin_by_size_bysize": windows_720p,
    "720pswin_by_size_bysize": shifted_windows_720p,
}


def get_window_method(name: str):
    try:
        return WINDOW_METHODS[name]
    except KeyError:
        raise ValueError(f"unknown window method {name!r}; known: {sorted(WINDOW_METHODS)}") from None


@dataclass
class JointLayout:
    """Index tensors of one (window method, input shape) on one device.

    ``gather``   (N_all,) indices into ``cat([vid_tokens, txt_tokens])`` giving the packed segments.
    ``vid_pos``  (N_vid,) position in the packed layout of each video token (original token order).
    ``txt_pos``  per sample, (L_b, n_windows_b) positions of the copies of each text token.
    ``coords``   (N_vid, 3) window-local (t, h, w) coordinate of each video token; ``sizes`` (N_vid, 3)
                 the size of its window (for the 7B's normalised positions). Kept on CPU.
    ``plan``     the attention plan (cu_seqlens, groups of equal-size segments).
    """

    gather: torch.Tensor
    vid_pos: torch.Tensor
    txt_pos: List[torch.Tensor]
    coords: torch.Tensor
    sizes: torch.Tensor
    txt_offset: torch.Tensor  # (N_vid,) text length of each video token's sample (3B RoPE offset)
    plan: VarlenPlan
    windows: List[List[Window]]
    txt_slots: torch.Tensor = None  # (sum L_b * n_b,) packed positions of all text copies
    txt_src: torch.Tensor = None  # (sum L_b * n_b,) the text token each copy comes from
    total: int = 0  # packed length

    def pack(self, vid: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
        """Packed segments from per-stream tensors: one scatter for the video tokens (each appears once)
        and one for the text copies. Equals ``cat([vid, txt])[gather]``."""
        out = vid.new_empty((self.total,) + tuple(vid.shape[1:]))
        out.index_copy_(0, self.vid_pos, vid)
        out.index_copy_(0, self.txt_slots, txt.index_select(0, self.txt_src))
        return out


def build_joint_layout(
    grids: Sequence[Tuple[int, int, int]],
    txt_lens: Sequence[int],
    method: str,
    num_windows: Sequence[int],
    device,
) -> JointLayout:
    fn = get_window_method(method)
    n_vid = sum(t * h * w for t, h, w in grids)
    gather, seg_lens, coords, sizes, txt_off, all_windows, vid_order = [], [], [], [], [], [], []
    vid_pos = torch.empty(n_vid, dtype=torch.int64)
    txt_pos = []
    pos = 0  # running position in the packed layout
    vid_base = 0
    txt_base = n_vid  # text tokens follow the video tokens in cat([vid, txt])
    for (t, h, w), L in zip(grids, txt_lens):
        ids = torch.arange(t * h * w).view(t, h, w) + vid_base
        wins = fn((t, h, w), num_windows)
        all_windows.append(wins)
        copies = []
        for (ta, tb), (ha, hb), (wa, wb) in wins:
            win_ids = ids[ta:tb, ha:hb, wa:wb].reshape(-1)
            n = win_ids.numel()
            gather.append(win_ids)
            vid_order.append(win_ids)
            vid_pos[win_ids] = torch.arange(pos, pos + n)
            gt, gh, gw = torch.meshgrid(
                torch.arange(tb - ta), torch.arange(hb - ha), torch.arange(wb - wa), indexing="ij"
            )
            coords.append(torch.stack([gt, gh, gw], -1).reshape(-1, 3))
            sizes.append(torch.tensor([tb - ta, hb - ha, wb - wa]).expand(n, 3))
            txt_off.append(torch.full((n,), L, dtype=torch.int64))
            gather.append(torch.arange(txt_base, txt_base + L))
            copies.append(torch.arange(pos + n, pos + n + L))
            seg_lens.append(n + L)
            pos += n + L
        txt_pos.append(torch.stack(copies, 1).to(device))  # (L, n_windows)
        vid_base += t * h * w
        txt_base += L
    cu = [0]
    for s in seg_lens:
        cu.append(cu[-1] + s)
    # reorder coords/sizes/txt_off from window order to original token order
    order = torch.cat(vid_order)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel())
    slots = torch.cat([p.flatten() for p in txt_pos]) if txt_pos else torch.empty(0, dtype=torch.int64)
    src, base = [], 0
    for p in txt_pos:
        L, n = p.shape
        src.append((base + torch.arange(L))[:, None].expand(L, n).flatten())
        base += L
    return JointLayout(
        txt_slots=slots.to(device),
        txt_src=(torch.cat(src) if src else torch.empty(0, dtype=torch.int64)).to(device),
        total=cu[-1],
        gather=torch.cat(gather).to(device),
        vid_pos=vid_pos.to(device),
        txt_pos=txt_pos,
        coords=torch.cat(coords)[inv],
        sizes=torch.cat(sizes)[inv],
        txt_offset=torch.cat(txt_off)[inv],
        plan=make_varlen_plan(cu, cu, device=device),
        windows=all_windows,
    )
