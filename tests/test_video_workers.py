"""The persistent worker pool (models/seedvr2/video/workers.py) with CPU processes over gloo: jobs run one after
another on workers started once, each output equals the single-process one (chunk parallel, and sequence parallel
with every worker on every chunk), a cancel stops the workers and a new pool resumes the job, and a failing worker's
message reaches the caller."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from pool_worker import double  # noqa: E402
from video_clips import clip_frames, write_clip  # noqa: E402

pytest.importorskip("av", reason="PyAV (ComfyUI's video library) is not installed")
from seedvr2bw.models.seedvr2.video import container as C  # noqa: E402
from seedvr2bw.models.seedvr2.video.stream import StreamSettings, upscale_video  # noqa: E402
from seedvr2bw.models.seedvr2.video.workers import PoolJob, WorkerError, WorkerPool  # noqa: E402

H, W = 48, 64   # x264 output of frames under 128x96 differed 1 run in 400 with other threads busy
STREAM = StreamSettings(batch_size=9, overlap=2, codec="ffv1")


def _decode(path):
    return np.stack(list(C.read_frames(str(path))))


def _pool(tmp_path, n=2, *extra):
    loads = tmp_path / "loads.txt"
    return WorkerPool(["cpu"] * n, [sys.executable, str(HERE / "pool_worker.py"), "--loads", str(loads), *extra]), \
        loads


def _single(tmp_path, src, name):
    out = tmp_path / name
    upscale_video(str(src), str(out), double, lambda h, w: (2 * h, 2 * w), STREAM)
    return _decode(out)


def test_jobs_share_workers_started_once_and_equal_one_process(tmp_path):
    a, b = tmp_path / "a.mkv", tmp_path / "b.mkv"
    write_clip(str(a), clip_frames([25, 15], H, W))
    write_clip(str(b), clip_frames([23], H, W))
    pool, loads = _pool(tmp_path)
    try:
        seen = []
        for src, name in ((a, "pa.mkv"), (b, "pb.mkv")):
            res = pool.run(PoolJob(str(src), str(tmp_path / name), (2 * H, 2 * W), STREAM),
                           progress=lambda *p: seen.append(p))
            assert res.out_path == str(tmp_path / name)
        assert pool.ready() == 2 and pool.alive
    finally:
        pool.close()
    assert not pool.alive and all(p.returncode is not None for p in pool.procs)
    lines = sorted(tuple(map(int, line.split())) for line in loads.read_text().splitlines())
    assert [r for r, _ in lines] == [0, 1]                           # one model load per worker for both jobs
    # each worker gets its share of the cores for torch's CPU ops, not one thread per core
    assert all(t == int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // 2)) for _, t in lines)
    assert np.array_equal(_decode(tmp_path / "pa.mkv"), _single(tmp_path, a, "sa.mkv"))
    assert np.array_equal(_decode(tmp_path / "pb.mkv"), _single(tmp_path, b, "sb.mkv"))
    assert seen and seen[-1][0] <= seen[-1][1]


def test_cancel_stops_the_workers_and_a_new_pool_resumes(tmp_path):
    src = tmp_path / "c.mkv"
    write_clip(str(src), clip_frames([60], H, W))
    out = tmp_path / "pc.mkv"
    job = PoolJob(str(src), str(out), (2 * H, 2 * W), STREAM, params={"slow_s": 0.3})
    pool, _ = _pool(tmp_path)
    progress = []

    def stop():
        if progress:
            raise KeyboardInterrupt("cancelled")
    with pytest.raises(KeyboardInterrupt):
        pool.run(job, progress=lambda *p: progress.append(p), should_stop=stop)
    assert not pool.alive and all(p.returncode is not None for p in pool.procs)
    assert not out.exists()
    pool, _ = _pool(tmp_path)
    try:
        res = pool.run(PoolJob(str(src), str(out), (2 * H, 2 * W), STREAM))
    finally:
        pool.close()
    assert res.resumed_chunks >= 1
    assert np.array_equal(_decode(out), _single(tmp_path, src, "sc.mkv"))


def test_a_failing_worker_names_itself_and_closes_the_pool(tmp_path):
    src = tmp_path / "d.mkv"
    write_clip(str(src), clip_frames([30], H, W))
    pool, _ = _pool(tmp_path)
    with pytest.raises(WorkerError, match="worker 1 on cpu: ValueError: this worker was told to fail"):
        pool.run(PoolJob(str(src), str(tmp_path / "pd.mkv"), (2 * H, 2 * W), STREAM, params={"fail_rank": 1, "slow_s": 0.2}))
    assert not pool.alive
    with pytest.raises(WorkerError, match="closed"):
        pool.run(PoolJob(str(src), str(tmp_path / "pd.mkv"), (2 * H, 2 * W), STREAM))


def _calls_when_all_ranks_are_through(calls, world, timeout_s=10.0):
    """The calls file once every rank logged as many chunks (the followers' fake model has no collective to wait on,
    so the last one may still be logging when rank 0 reports the result)."""
    import time
    deadline = time.monotonic() + timeout_s
    while True:
        text = calls.read_text()
        counts = [sum(line.split()[0] == str(r) for line in text.splitlines()) for r in range(world)]
        if len(set(counts)) == 1 or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def test_sequence_pool_puts_every_worker_on_every_chunk(tmp_path):
    """``--parallel sequence``: rank 0 streams, each chunk reaches all three workers with the model group set, two
    jobs run on the same workers, the file equals the single-process one, and a follower's failure is reported."""
    a = tmp_path / "a.mkv"
    write_clip(str(a), clip_frames([25, 15], H, W))
    calls = tmp_path / "calls.txt"
    pool, loads = _pool(tmp_path, 3, "--parallel", "sequence", "--calls", str(calls))
    try:
        for name in ("p1.mkv", "p2.mkv"):
            res = pool.run(PoolJob(str(a), str(tmp_path / name), (2 * H, 2 * W), STREAM))
            assert res.frames == 40
        two_jobs = _calls_when_all_ranks_are_through(calls, 3)
        with pytest.raises(WorkerError, match="worker 2 on cpu: ValueError: this worker was told to fail"):
            pool.run(PoolJob(str(a), str(tmp_path / "p3.mkv"), (2 * H, 2 * W), STREAM, params={"fail_rank": 2}))
    finally:
        pool.close()
    assert sorted(line.split()[0] for line in loads.read_text().splitlines()) == ["0", "1", "2"]
    seen = [line.split() for line in two_jobs.splitlines()]
    assert seen and all(g == "True" for _, _, g in seen)
    per_rank = {r: [n for rr, n, _ in seen if rr == r] for r in "012"}
    assert per_rank["0"] == per_rank["1"] == per_rank["2"]
    assert sum(int(n) for n in per_rank["1"]) >= 2 * 40          # both jobs, every chunk (overlaps counted twice)
    single = _single(tmp_path, a, "s.mkv")
    assert np.array_equal(_decode(tmp_path / "p1.mkv"), single) and np.array_equal(_decode(tmp_path / "p2.mkv"), single)


def test_a_worker_whose_device_cannot_run_the_job_sits_it_out(tmp_path):
    """The job goes to the workers whose ``fits`` says yes; the file is the one a single process writes."""
    a = tmp_path / "a.mkv"
    write_clip(str(a), clip_frames([40], H, W))
    calls = tmp_path / "calls.txt"
    pool, _ = _pool(tmp_path, 3, "--calls", str(calls))
    try:
        pool.run(PoolJob(str(a), str(tmp_path / "p.mkv"), (2 * H, 2 * W), STREAM,
                         params={"unfit_rank": 1, "slow_s": 0.05}))
    finally:
        pool.close()
    ranks = {line.split()[0] for line in calls.read_text().splitlines()}
    assert ranks == {"0", "2"}, ranks
    assert np.array_equal(_decode(tmp_path / "p.mkv"), _single(tmp_path, a, "s.mkv"))
