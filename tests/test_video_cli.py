"""scripts/upscale_video.py end to end with the tiny SeedVR2 models on the CPU: a 1,000-frame clip with audio in
bounded memory, and a resume after SIGKILL that gives the same frames as an uninterrupted run."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from video_clips import audio_seconds, clip_frames, write_clip  # noqa: E402

pytest.importorskip("av", reason="PyAV (ComfyUI's video library) is not installed")
from seedvr2bw.models.seedvr2.video import container as C  # noqa: E402
from seedvr2bw.models.seedvr2.video.workdir import work_dir_for  # noqa: E402

REPO = HERE.parent
SCRIPT = REPO / "scripts" / "upscale_video.py"
# runs the CLI and reports the process's own peak RSS (kB on Linux) on its last line
WRAP = ("import os, resource, runpy, sys; sys.argv = sys.argv[1:]; code = 0\n"
        "sys.path.insert(0, os.path.dirname(sys.argv[0]))\n"
        "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "except SystemExit as e:\n    code = e.code or 0\n"
        "print('MAXRSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True); sys.exit(code)")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from make_tiny_models import make_tiny_models
    paths = make_tiny_models(tmp_path_factory.mktemp("models"))
    return paths


# glibc makes a malloc arena per thread that allocates concurrently (decoder, encoder, torch): how many, hence the
# peak RSS, varies by about +-10 % between identical runs; two arenas make the length's effect measurable
ENV = {**os.environ, "MALLOC_ARENA_MAX": "2"}


def _cli(tiny, src, out, *extra, wrap=True, **kw):
    args = [str(SCRIPT), str(src), str(out), "--dit", str(tiny["dit_3b"]), "--vae", str(tiny["vae"]),
            "--resolution", "48", "--batch-size", "9", "--overlap", "2", "--device", "cpu", *extra]
    cmd = [sys.executable, "-c", WRAP, *args] if wrap else [sys.executable, *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(REPO),
                            env=ENV, **kw)


def _run(tiny, src, out, *extra):
    p = _cli(tiny, src, out, *extra)
    text, _ = p.communicate(timeout=1200)
    assert p.returncode == 0, text[-4000:]
    rss = int([line for line in text.splitlines() if line.startswith("MAXRSS")][-1].split()[1])
    return text, rss


def test_thousand_frames_with_audio_in_bounded_memory(tiny, tmp_path):
    small = write_clip(str(tmp_path / "c100.mp4"), clip_frames([60, 40], 24, 40), codec="h264")
    big = write_clip(str(tmp_path / "c1000.mp4"), clip_frames([400, 350, 250], 24, 40), codec="h264")
    # each length runs twice and the smaller peak counts: growth with the length is what must not show
    rss_small = min(_run(tiny, small, tmp_path / f"o100_{i}.mp4")[1] for i in range(2))
    runs = [_run(tiny, big, tmp_path / f"o1000_{i}.mp4") for i in range(2)]
    text, rss_big = runs[0][0], min(r[1] for r in runs)
    info_in, info_out = C.probe(big), C.probe(str(tmp_path / "o1000_0.mp4"))
    assert info_out.frames == info_in.frames == 1000, text[-2000:]
    assert info_out.fps == info_in.fps and (info_out.width, info_out.height) == (80, 48)
    assert abs(audio_seconds(str(tmp_path / "o1000_0.mp4")) - audio_seconds(big)) < 1e-6
    assert rss_big <= 1.10 * rss_small, f"peak RSS {rss_big} kB for 1,000 frames vs {rss_small} kB for 100"
    assert "frames/s" in text


def test_resume_after_sigkill_equals_an_uninterrupted_run(tiny, tmp_path):
    src = write_clip(str(tmp_path / "in.mp4"), clip_frames([50, 40], 24, 40), codec="h264")
    full = tmp_path / "full.mp4"
    _run(tiny, src, full)
    out = tmp_path / "out.mp4"
    work = Path(work_dir_for(str(out)))
    kill_after = random.Random(os.getpid()).randint(2, 8)   # chunks finished before the kill
    p = _cli(tiny, src, out, wrap=False)
    t0, killed = time.time(), False
    while p.poll() is None and time.time() - t0 < 600:
        try:
            done = len([n for n in os.listdir(work) if n.startswith("body_") and not n.endswith(".partial")])
        except OSError:
            done = 0
        if done >= kill_after:
            p.send_signal(signal.SIGKILL)
            killed = True
            break
        time.sleep(0.02)
    p.wait(timeout=60)
    assert killed, "the run finished before it could be killed"
    assert not out.exists(), "the final path holds a file after the kill"
    text, _ = _run(tiny, src, out, "--resume")
    import re
    m = re.search(r"\((\d+) resumed\)", text)
    assert m and int(m.group(1)) >= kill_after, text[-2000:]   # the finished chunks were not run again
    assert np.array_equal(np.stack(list(C.read_frames(str(out)))), np.stack(list(C.read_frames(str(full)))))
    assert not os.path.exists(work_dir_for(str(out)))


def test_cli_errors_before_loading_anything(tiny, tmp_path):
    src = write_clip(str(tmp_path / "in.mp4"), clip_frames([5], 24, 40), codec="h264")
    p = _cli(tiny, src, src, wrap=False)
    text, _ = p.communicate(timeout=120)
    assert p.returncode == 2 and "is the input file" in text, text
    p = _cli(tiny, tmp_path / "missing.mp4", tmp_path / "o.mp4", wrap=False)
    text, _ = p.communicate(timeout=120)
    assert p.returncode == 2 and "does not exist" in text, text


def test_two_cpu_workers_equal_one_process(tiny, tmp_path):
    src = write_clip(str(tmp_path / "in.mp4"), clip_frames([30, 20], 24, 40), codec="h264")
    one, two = tmp_path / "one.mp4", tmp_path / "two.mp4"
    _run(tiny, src, one)
    text, _ = _run(tiny, src, two, "--workers", "2")
    assert "wrote" in text
    assert np.array_equal(np.stack(list(C.read_frames(str(two)))), np.stack(list(C.read_frames(str(one)))))


def test_two_cpu_workers_sequence_parallel_equal_one_process(tiny, tmp_path):
    """--parallel sequence: both processes work on every chunk (rank 0 reads and writes); 16-bit lossless output
    within one level of the single process's (the split sums in another order)."""
    src = write_clip(str(tmp_path / "in.mp4"), clip_frames([30, 20], 24, 40), codec="h264")
    one, two = tmp_path / "one.mkv", tmp_path / "two.mkv"
    _run(tiny, src, one, "--codec", "ffv1")
    text, _ = _run(tiny, src, two, "--codec", "ffv1", "--workers", "2", "--parallel", "sequence")
    assert "wrote" in text
    a = np.stack(list(C.read_frames(str(two)))).astype(np.float64) * 65535     # float in [0, 1] -> 16-bit levels
    b = np.stack(list(C.read_frames(str(one)))).astype(np.float64) * 65535
    assert a.shape == b.shape and len(a) == 50
    diff = np.abs(a - b)
    print("largest / mean difference in 16-bit levels", diff.max(), diff.mean())
    assert diff.max() <= 1.01 and diff.mean() < 0.05, (diff.max(), diff.mean())
