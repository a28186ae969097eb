"""Chunk-parallel streaming (models/seedvr2/video/parallel.py) on CPU processes over gloo: the output equals the
single-process output exactly, every chunk runs once, and a slow worker takes fewer chunks."""
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

H, W = 24, 32


def _worker(rank, world, store_path, src, out, batch, overlap, codec, slow_rank, counts_path):
    import time
    import torch.distributed as dist
    sys.path.insert(0, str(HERE.parent))
    from pack_import import import_pack
    import_pack()
    from seedvr2bw.models.seedvr2.video.parallel import upscale_video_distributed
    from seedvr2bw.models.seedvr2.video.stream import StreamSettings
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=world)
    seen = []

    def double(frames):
        if rank == slow_rank:
            time.sleep(0.3)
        seen.append(len(frames))
        up = frames.repeat(2, axis=1).repeat(2, axis=2)
        return up * 0.95 + 0.05 * up.mean(axis=0, keepdims=True)
    upscale_video_distributed(dist.PrefixStore("job", store), src, out, double, lambda h, w: (2 * h, 2 * w),
                              StreamSettings(batch_size=batch, overlap=overlap, codec=codec))
    with open(f"{counts_path}.{rank}", "w") as f:
        f.write(str(len(seen)))
    dist.destroy_process_group()


def _spawn(world, tmp_path, src, out, batch=9, overlap=2, codec="ffv1", slow_rank=-1):
    import torch.multiprocessing as mp
    store = str(tmp_path / f"store_{os.path.basename(out)}")
    counts = str(tmp_path / f"counts_{os.path.basename(out)}")
    mp.spawn(_worker, args=(world, store, src, out, batch, overlap, codec, slow_rank, counts), nprocs=world,
             join=True)
    return [int(open(f"{counts}.{r}").read()) for r in range(world)]


def _decode(path):
    from seedvr2bw.models.seedvr2.video import container as C
    return np.stack(list(C.read_frames(str(path))))


@pytest.mark.parametrize("world", [2, 3])
def test_chunk_parallel_equals_single_process(tmp_path, world):
    from seedvr2bw.models.seedvr2.video.stream import StreamSettings, upscale_video
    frames = clip_frames([30, 17, 25], H, W)
    src = write_clip(str(tmp_path / "in.mkv"), frames, audio=True)
    single = tmp_path / "single.mkv"

    def double(f):
        up = f.repeat(2, axis=1).repeat(2, axis=2)
        return up * 0.95 + 0.05 * up.mean(axis=0, keepdims=True)
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
