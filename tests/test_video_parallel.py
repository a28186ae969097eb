"""Chunk-parallel streaming (models/seedvr2/video/parallel.py) on CPU processes over gloo: the output equals the
single-process output exactly, every chunk runs once, and a slow worker takes fewer chunks; a rank decodes its next
chunk's frames while the model runs (claimed ahead only while many chunks are unclaimed), and rank 0 remuxes units
into the output while chunks still run."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from video_clips import clip_frames, write_clip  # noqa: E402

pytest.importorskip("av", reason="PyAV (ComfyUI's video library) is not installed")

H, W = 48, 64   # x264 output of frames under 128x96 differed 1 run in 400 with other threads busy


def _worker(rank, world, store_path, src, out, batch, overlap, codec, slow_rank, counts_path, probe=False,
            unfit=()):
    import time
    import torch.distributed as dist
    sys.path.insert(0, str(HERE.parent))
    from pack_import import import_pack
    import_pack()
    from seedvr2bw.models.seedvr2.video import container as C
    from seedvr2bw.models.seedvr2.video.parallel import upscale_video_distributed
    from seedvr2bw.models.seedvr2.video.stream import FrameCursor, StreamSettings
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=world)
    seen, reads, appended, ahead, remuxed = [], [], [], [], []
    if probe:   # note each range as its decoding starts, and each unit rank 0 remuxes
        take, append = FrameCursor.take, C.ConcatWriter.append
        FrameCursor.take = lambda self, a, b: reads.append((a, b)) or take(self, a, b)
        C.ConcatWriter.append = lambda self, seg: appended.append(seg) or append(self, seg)

    def double(frames):
        if rank == slow_rank:
            time.sleep(0.3)
        seen.append(len(frames))
        if probe:   # a rank that claimed its next chunk ahead starts decoding it now: wait a little for that
            for _ in range(50):
                if len(reads) > len(seen):
                    break
                time.sleep(0.01)
            ahead.append(len(reads) > len(seen))
            remuxed.append(len(appended))
        up = frames.repeat(2, axis=1).repeat(2, axis=2)
        return up * 0.95 + 0.05 * up.mean(axis=0, keepdims=True)
    def fits(frames, height, width):   # as a GPU too small for the job's chunks under any memory plan says
        return f"rank {rank}: {frames} frames of {width}x{height} need more memory" if rank in unfit else None
    upscale_video_distributed(dist.PrefixStore("job", store), src, out, double, lambda h, w: (2 * h, 2 * w),
                              StreamSettings(batch_size=batch, overlap=overlap, codec=codec), fits=fits)
    with open(f"{counts_path}.{rank}", "w") as f:
        f.write(f"{len(seen)} {sum(ahead)} {remuxed[-1] if remuxed else 0} {int(reads == sorted(reads))}")
    dist.destroy_process_group()


def _spawn(world, tmp_path, src, out, batch=9, overlap=2, codec="ffv1", slow_rank=-1, probe=False, unfit=()):
    """Each rank's chunk count; with ``probe``, rows of (chunks, chunks whose successor's frames were being decoded
    while they ran, units in the output when the rank's last chunk started, reads in increasing order)."""
    import torch.multiprocessing as mp
    store = str(tmp_path / f"store_{os.path.basename(out)}")
    counts = str(tmp_path / f"counts_{os.path.basename(out)}")
    mp.spawn(_worker, args=(world, store, src, out, batch, overlap, codec, slow_rank, counts, probe, unfit),
             nprocs=world, join=True)
    rows = [tuple(map(int, open(f"{counts}.{r}").read().split())) for r in range(world)]
    return rows if probe else [r[0] for r in rows]


def _decode(path):
    from seedvr2bw.models.seedvr2.video import container as C
    return np.stack(list(C.read_frames(str(path))))


def double(f):
    """A 2x 'upscaler' whose output depends on the whole chunk, as the model's does."""
    up = f.repeat(2, axis=1).repeat(2, axis=2)
    return up * 0.95 + 0.05 * up.mean(axis=0, keepdims=True)


@pytest.mark.parametrize("world", [2, 3])
def test_chunk_parallel_equals_single_process(tmp_path, world):
    from seedvr2bw.models.seedvr2.video.stream import StreamSettings, upscale_video
    frames = clip_frames([30, 17, 25], H, W)
    src = write_clip(str(tmp_path / "in.mkv"), frames, audio=True)
    single = tmp_path / "single.mkv"

    res = upscale_video(src, str(single), double, lambda h, w: (2 * h, 2 * w),
                        StreamSettings(batch_size=9, overlap=2, codec="ffv1"))
    par = tmp_path / "par.mkv"
    counts = _spawn(world, tmp_path, src, str(par))
    assert sum(counts) == res.chunks and all(c > 0 for c in counts), counts
    assert np.array_equal(_decode(par), _decode(single))


def test_a_slow_worker_takes_fewer_chunks(tmp_path):
    src = write_clip(str(tmp_path / "in.mp4"), clip_frames([80], H, W), codec="h264")
    counts = _spawn(2, tmp_path, src, str(tmp_path / "out.mp4"), batch=5, overlap=1, codec="h264", slow_rank=1)
    assert counts[0] > counts[1] > 0, counts


def test_claims_go_ahead_only_while_many_are_unclaimed():
    import torch.distributed as dist
    from seedvr2bw.models.seedvr2.video.parallel import ChunkClaims
    store = dist.HashStore()
    a, b = (ChunkClaims(store, "next", 12, 4) for _ in range(2))   # two ranks, ahead while more than 4 unclaimed
    got = {"a": [], "b": []}
    assert a.claim() == 0 and b.claim() == 1
    # while more than 4 are unclaimed each rank claims its next index as it starts one
    for name, r in (("a", a), ("b", b), ("a", a), ("b", b), ("a", a), ("b", b)):
        got[name].append(r.claim_ahead())
    assert got == {"a": [2, 4, 6], "b": [3, 5, 7]}
    assert a.claim_ahead() is None and b.claim_ahead() is None   # 8 claimed, 4 left: each claims when free
    assert b.claim() == 8 and a.claim() == 9
    assert [b.claim(), b.claim(), a.claim(), b.claim()] == [10, 11, None, None]


def test_ranks_read_ahead_and_rank_0_remuxes_while_chunks_run(tmp_path):
    from seedvr2bw.models.seedvr2.video.stream import StreamSettings, upscale_video
    src = write_clip(str(tmp_path / "in.mp4"), clip_frames([60, 40], H, W), codec="h264")
    single = tmp_path / "single.mp4"

    res = upscale_video(src, str(single), double, lambda h, w: (2 * h, 2 * w),
                        StreamSettings(batch_size=5, overlap=1, codec="h264"))
    par = tmp_path / "par.mp4"
    rows = _spawn(2, tmp_path, src, str(par), batch=5, overlap=1, codec="h264", probe=True)
    assert sum(r[0] for r in rows) == res.chunks == 25
    # ahead while more than 4 of 25 are unclaimed: all but the chunk then prefetched and those claimed when free
    assert all(r[0] - 5 <= r[1] < r[0] for r in rows), rows
    assert rows[0][2] > 0, rows          # rank 0 had remuxed units before its last chunk
    assert all(r[3] for r in rows), rows  # each rank read forward only
    assert par.read_bytes() == single.read_bytes()


def test_a_worker_that_cannot_run_the_job_takes_no_chunk(tmp_path):
    """A rank whose device cannot hold the job's chunks under any memory plan sits the job out; the others write
    the same file. When no rank can, every rank says why."""
    import torch.multiprocessing as mp
    from seedvr2bw.models.seedvr2.video.stream import StreamSettings, upscale_video
    src = write_clip(str(tmp_path / "in.mkv"), clip_frames([30], H, W), audio=False)
    single = tmp_path / "single.mkv"
    res = upscale_video(src, str(single), double, lambda h, w: (2 * h, 2 * w),
                        StreamSettings(batch_size=9, overlap=2, codec="ffv1"))
    par = tmp_path / "par.mkv"
    counts = _spawn(3, tmp_path, src, str(par), unfit=(1,))
    assert counts[1] == 0 and counts[0] + counts[2] == res.chunks, counts
    assert np.array_equal(_decode(par), _decode(single))
    with pytest.raises(mp.ProcessRaisedException, match="no worker can run this job: rank 0: 9 frames of 64x48"):
        _spawn(2, tmp_path, src, str(tmp_path / "none.mkv"), unfit=(0, 1))
