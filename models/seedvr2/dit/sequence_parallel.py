"""Sequence parallelism for one DiT forward (issue #30): the attention windows of one input are split over the ranks
of a torch.distributed process group, whole windows per rank, and the result equals the single-process forward up
to fp32 rounding.

Why whole windows are enough (docs/SPEC.md §1.6, §1.7, §3):

* everything but the attention is per token (norms, modulation, MLP, projections, patch in/out), so a rank runs it
  on whatever video tokens it holds;
* a window's attention sees its own video tokens and the text of its sample, never another window's tokens, so a
  rank holding whole windows needs no video token of another rank inside a block;
* the unshifted and the shifted blocks cut the clip differently, so between them the video tokens are re-sharded:
  one ``all_to_all_single`` moves each token from its rank under one partition to its rank under the other;
* the text stream is small and every rank computes all of it; its attention output is the mean of its copies over
  all windows of its sample, so each rank sums the copies of its own windows and an ``all_reduce`` completes the
  sum before the division (``AttentionContext.txt_combine``).

Windows are dealt out as contiguous runs in the model's window order (w outermost), with the largest run as small
as possible (``balanced_runs``): neighbouring windows stay together, so few tokens change rank at a re-shard.

Every rank calls :class:`SequenceParallelDiT` with the same full input and gets the full output (one ``all_gather``
at the end). Inference only: the collectives are not differentiable.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ....optimization.attention import make_varlen_plan
from .attention import AttentionContext
from .modulation import modulate_in, split_embedding
from .nadit import DiTInterrupted, NaDiT
from .rope import make_rope_table, text_angles, video_angles
from .window import JointLayout, Window, build_joint_layout


def stop_together(should_stop: Optional[Callable[[], bool]], group, device) -> bool:
    """Asks ``should_stop`` (it may return True, or raise as ComfyUI's interrupt check does) at the same point on
    every rank of ``group``: True on every rank when any rank asked to stop. The rank whose check raised re-raises
    its exception once the others know, so no rank is left waiting in a collective for one that stopped."""
    error, stop = None, False
    if should_stop is not None:
        try:
            stop = bool(should_stop())
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the all-reduce
            error, stop = exc, True
    flag = torch.tensor([int(stop)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if error is not None:
        raise error
    return bool(flag.item())


STOP_EVERY = 4   # blocks between two agreed stop checks (a 7B block at 1080p x 21 on one GPU: about 20 ms)


class TooFewWindows(ValueError):
    """The input has fewer attention windows than there are ranks (every rank needs whole windows); raised before
    any collective, on every rank alike."""


def balanced_runs(sizes: Sequence[int], parts: int) -> List[range]:
    """Cut ``sizes`` (in order) into ``parts`` non-empty contiguous runs whose largest sum is as small as possible."""
    n = len(sizes)
    if not 1 <= parts <= n:
        raise TooFewWindows(f"cannot split {n} windows over {parts} ranks: every rank needs at least one window")

    def runs_needed(cap: int) -> int:
        count, acc = 1, 0
        for s in sizes:
            count, acc = (count + 1, s) if acc + s > cap else (count, acc + s)
        return count

    lo, hi = max(sizes), sum(sizes)
    while lo < hi:  # the smallest cap that `parts` greedy runs can keep
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if runs_needed(mid) <= parts else (mid + 1, hi)
    runs, start, acc = [], 0, 0
    for i, s in enumerate(sizes):
        # close the run when the item does not fit, or when each later rank needs one of the items left
        if i > start and (acc + s > lo or n - i <= parts - len(runs) - 1):
            runs.append(range(start, i))
            start, acc = i, 0
        acc += s
    runs.append(range(start, n))
    return runs


@dataclass
class RankShare:
    """One rank's share of one window partition of the packed input."""

    segments: List[int]  # indices of its attention segments (windows) in the global layout, ascending
    windows: List[List[Window]]  # per sample, the windows it holds
    ids: torch.Tensor  # (n,) global video token indices it holds, window by window (its local order)
    vid_lens: List[int]  # per sample, how many of its tokens belong to that sample


def split_layout(lay: JointLayout, txt_lens: Sequence[int], world: int) -> List[RankShare]:
    """Deal the windows of a (CPU) global layout out to ``world`` ranks, balanced by video token count."""
    cu = lay.plan.cu_seqlens_q.tolist()
    sample = [b for b, wins in enumerate(lay.windows) for _ in wins]
    flat = [w for wins in lay.windows for w in wins]
    n_vid = [cu[k + 1] - cu[k] - txt_lens[b] for k, b in enumerate(sample)]
    shares = []
    for run in balanced_runs(n_vid, world):
        segs = list(run)
        ids = torch.cat([lay.gather[cu[k]:cu[k] + n_vid[k]] for k in segs])
        lens = [sum(n_vid[k] for k in segs if sample[k] == b) for b in range(len(lay.windows))]
        wins = [[flat[k] for k in segs if sample[k] == b] for b in range(len(lay.windows))]
        shares.append(RankShare(segs, wins, ids, lens))
    return shares


def local_layout(lay: JointLayout, share: RankShare, txt_lens: Sequence[int], device) -> JointLayout:
    """The joint layout of the rank's windows alone, over its tokens in their local order (as ``build_joint_layout``
    would make it for an input holding only those windows, RoPE coordinates kept window-local)."""
    n_vid = lay.vid_pos.numel()
    cu = lay.plan.cu_seqlens_q.tolist()
    seg_lens = [cu[k + 1] - cu[k] for k in share.segments]
    sel = torch.cat([torch.arange(cu[k], cu[k + 1]) for k in share.segments])
    g = lay.gather[sel]
    is_vid = g < n_vid
    vid_pos, txt_slots = is_vid.nonzero().squeeze(1), (~is_vid).nonzero().squeeze(1)
    n_local = vid_pos.numel()
    gather = torch.empty_like(g)
    gather[vid_pos] = torch.arange(n_local)
    gather[txt_slots] = g[txt_slots] - n_vid + n_local
    local_cu = [0]
    for s in seg_lens:
        local_cu.append(local_cu[-1] + s)
    sample = [b for b, wins in enumerate(lay.windows) for _ in wins]
    txt_pos = []
    for b, L in enumerate(txt_lens):
        mine = [i for i, k in enumerate(share.segments) if sample[k] == b]
        starts = [local_cu[i + 1] - L for i in mine]  # the text copy ends each segment
        txt_pos.append((torch.tensor(starts, dtype=torch.int64)[None, :] + torch.arange(L)[:, None]).to(device))
    return JointLayout(
        gather=gather.to(device), vid_pos=vid_pos.to(device), txt_pos=txt_pos,
        coords=lay.coords[share.ids], sizes=lay.sizes[share.ids], txt_offset=lay.txt_offset[share.ids],
        plan=make_varlen_plan(local_cu, local_cu, device=device), windows=share.windows,
        txt_slots=txt_slots.to(device), txt_src=(g[txt_slots] - n_vid).to(device), total=local_cu[-1],
    )


@dataclass
class _Part:
    """This rank's view of one window method: its attention context (the text mean joined by the wrapper, which
    knows the group), how many windows hold a copy of each text token, and every rank's token ids."""

    ctx: AttentionContext
    copies: torch.Tensor
    ids: torch.Tensor  # its own token ids, on the device
    vid_lens: List[int]
    all_ids: List[torch.Tensor]  # every rank's ids, CPU


@dataclass
class _Move:
    """One re-shard between two partitions, as this rank sees it."""

    send_idx: torch.Tensor  # local rows to send, grouped by destination rank
    recv_idx: torch.Tensor  # where each received row goes in the new local order
    send_splits: List[int]
    recv_splits: List[int]


@dataclass
class SequencePlan:
    """Everything one input shape needs on this rank (built once per shape, like the model's contexts)."""

    parts: Dict[str, _Part]
    moves: Dict[Tuple[str, str], _Move]
    n_vid: int


class SequenceParallelDiT:
    """Runs ``model`` (a NaDiT, the same weights on every rank of ``group``) on one input split over the ranks.

    Call it on every rank with the same arguments as ``NaDiT.forward``; every rank returns the full output.
    ``model.should_stop`` or the ``should_stop`` argument is asked before every ``STOP_EVERY``-th block on every rank,
    and all ranks stop together if any rank asks to."""

    def __init__(self, model: NaDiT, group: Optional[dist.ProcessGroup] = None):
        self.model, self.group = model, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self._joined: Dict[Tuple[int, str], Tuple[SequencePlan, AttentionContext]] = {}

    # ---- per-shape plan ---------------------------------------------------------------------------
    def plan(self, grids: List[Tuple[int, int, int]], txt_lens: List[int], device) -> SequencePlan:
        """The shards of every window method on this rank, for patched ``grids`` and text lengths; kept in the
        model's per-shape cache, so a wrapper made per run (one per ``pipeline.upscale`` call) builds it once."""
        m = self.model
        key = ("sequence_parallel", self.rank, self.world, tuple(grids), tuple(txt_lens), str(device),
               m.attention_backend)
        return m.cached(key, lambda: self._build_plan(grids, txt_lens, device))

    def _build_plan(self, grids, txt_lens, device) -> SequencePlan:
        m = self.model
        kind = "mmrope3d" if m.config.variant == "3b" else "pixel"
        freqs, backend = m.rope_freqs(), m.backend_for(device)
        txt_rope = None
        if kind == "mmrope3d":
            txt_rope = make_rope_table(torch.cat([text_angles(freqs, L) for L in txt_lens]), device)
        parts = {}
        for method in dict.fromkeys(m.config.window_methods):
            lay = build_joint_layout(grids, txt_lens, method, m.config.window, "cpu")
            shares = split_layout(lay, txt_lens, self.world)
            mine = local_layout(lay, shares[self.rank], txt_lens, device)
            copies = torch.cat([torch.full((L,), float(len(w))) for L, w in zip(txt_lens, lay.windows)]).to(device)
            vid_rope = make_rope_table(video_angles(kind, freqs, mine.coords, mine.sizes, mine.txt_offset), device)
            parts[method] = _Part(AttentionContext(mine, vid_rope, txt_rope, backend), copies,
                                  shares[self.rank].ids.to(device), shares[self.rank].vid_lens,
                                  [s.ids for s in shares])
        plan = SequencePlan(parts, {}, sum(t * h * w for t, h, w in grids))
        for a in parts:
            for b in parts:
                if a != b:
                    plan.moves[(a, b)] = self._move_plan(parts[a].all_ids, parts[b].all_ids, plan.n_vid, device)
        return plan

    def _context(self, plan: SequencePlan, method: str) -> AttentionContext:
        """The cached context of ``method`` with its text mean joined over this wrapper's group."""
        key = (id(plan), method)
        if key not in self._joined:
            part = plan.parts[method]
            # the plan is kept beside its context, so its id is not reused while this wrapper lives
            self._joined[key] = plan, dataclasses.replace(part.ctx, txt_combine=self._text_mean(part.ctx.layout,
                                                                                                part.copies))
        return self._joined[key][1]

    def _move_plan(self, src: List[torch.Tensor], dst: List[torch.Tensor], n_vid: int, device) -> _Move:
        owner, local = torch.empty(n_vid, dtype=torch.int64), torch.empty(n_vid, dtype=torch.int64)
        for r, ids in enumerate(src):
            owner[ids], local[ids] = r, torch.arange(ids.numel())
        # both sides list a pair's tokens in the receiver's local order, so no index travels
        from_rank = owner[dst[self.rank]]
        send = [local[ids[owner[ids] == self.rank]] for ids in dst]
        return _Move(torch.cat(send).to(device), torch.argsort(from_rank, stable=True).to(device),
                     [s.numel() for s in send], torch.bincount(from_rank, minlength=self.world).tolist())

    def _text_mean(self, lay: JointLayout, copies: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        def combine(out: torch.Tensor) -> torch.Tensor:
            # fp32 partial sums, so a 16-bit all_reduce does not round once per rank
            total = torch.cat([out[p].float().sum(1) if p.shape[1] else out.new_zeros((p.shape[0], out.shape[1]),
                              dtype=torch.float32) for p in lay.txt_pos])
            dist.all_reduce(total, group=self.group)
            return (total / copies[:, None]).to(out.dtype)
        return combine

    # ---- collectives ------------------------------------------------------------------------------
    def _reshard(self, x: torch.Tensor, mv: _Move) -> torch.Tensor:
        recv = x.new_empty((mv.recv_idx.numel(), x.shape[1]))
        dist.all_to_all_single(recv, x.index_select(0, mv.send_idx), mv.recv_splits, mv.send_splits,
                               group=self.group)
        return torch.empty_like(recv).index_copy_(0, mv.recv_idx, recv)

    def _gather(self, y: torch.Tensor, part: _Part, n_vid: int) -> torch.Tensor:
        # all_gather needs equal sizes on gloo: pad every rank's rows to the largest share
        n_max = max(ids.numel() for ids in part.all_ids)
        buf = y.new_zeros((n_max, y.shape[1]))
        buf[:y.shape[0]] = y
        chunks = [torch.empty_like(buf) for _ in range(self.world)]
        dist.all_gather(chunks, buf, group=self.group)
        order = torch.cat(part.all_ids).to(y.device)
        rows = torch.cat([c[:ids.numel()] for c, ids in zip(chunks, part.all_ids)])
        return y.new_empty((n_vid, y.shape[1])).index_copy_(0, order, rows)

    # ---- forward ----------------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(self, vid: torch.Tensor, txt: torch.Tensor, vid_shape: torch.Tensor, txt_shape: torch.Tensor,
                 timestep, should_stop: Optional[Callable[[], bool]] = None) -> torch.Tensor:
        m = self.model
        should_stop = should_stop if should_stop is not None else m.should_stop
        device, dtype = vid.device, m.run_dtype()
        shapes = [tuple(int(v) for v in s) for s in vid_shape.tolist()]
        txt_lens = [int(s[0]) for s in txt_shape.tolist()]
        pt, ph, pw = m.config.patch_size
        grids = [(t // pt, h // ph, w // pw) for t, h, w in shapes]
        plan = self.plan(grids, txt_lens, device)
        method = m.blocks[0].window_method
        part = plan.parts[method]

        txt = m.txt_in(txt.to(dtype))
        vid = m.vid_in.proj(m.vid_in.patchify(vid.to(dtype), shapes).index_select(0, part.ids))
        if not torch.is_tensor(timestep):
            timestep = torch.tensor([float(timestep)], device=device)
        timestep = timestep.to(device).reshape(-1)
        if timestep.numel() == 1 and len(shapes) > 1:
            timestep = timestep.expand(len(shapes))
        e = split_embedding(m.emb_in(timestep, dtype))

        for i, block in enumerate(m.block_runner.iterate(m.blocks)):
            # the ranks agree every STOP_EVERY blocks: each agreement waits for the GPU, which then idles while
            # the host queues the next block
            if i % STOP_EVERY == 0 and stop_together(should_stop, self.group, device):
                raise DiTInterrupted("DiT forward interrupted between blocks (on some rank)")
            if block.window_method != method:
                vid = self._reshard(vid, plan.moves[(method, block.window_method)])
                method = block.window_method
                part = plan.parts[method]
            vid, txt = block(vid, txt, e, self._context(plan, method), part.vid_lens, txt_lens)

        if m.config.has_out_norm:
            # the 3B output modulation takes the attention slot of the embedding (docs/SPEC.md §4.1)
            vid = modulate_in(m.vid_out_norm(vid), e[:, :, 0], m.vid_out_ada.out_shift, m.vid_out_ada.out_scale,
                              part.vid_lens)
        return m.vid_out.unpatchify(self._gather(m.vid_out.proj(vid), part, plan.n_vid), grids)
