"""The streaming upscale (models/seedvr2/video) with an injected upscaler: frame count, fps, audio, rotation and
colour tags carried over; blending as the in-memory plan; scene cuts; resume; errors before any work."""
from __future__ import annotations

import fractions
import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from video_clips import audio_seconds, clip_frames, write_clip  # noqa: E402

av = pytest.importorskip("av", reason="PyAV (ComfyUI's video library) is not installed")

from seedvr2bw.models.seedvr2.video import container as C  # noqa: E402
from seedvr2bw.models.seedvr2.video.stream import FrameCursor, StreamSettings, ramp, upscale_video  # noqa: E402
from seedvr2bw.models.seedvr2.video.workdir import work_dir_for  # noqa: E402

H, W = 24, 32


def double(frames: np.ndarray) -> np.ndarray:
    """A deterministic 2x 'upscaler' whose output depends on the whole chunk (as the model's temporal context does):
    nearest-neighbour 2x plus 0.05 x the chunk's mean frame, so chunk boundaries show in the result."""
    up = frames.repeat(2, axis=1).repeat(2, axis=2)
    return up * 0.95 + 0.05 * up.mean(axis=0, keepdims=True)


def size2(h, w):
    return 2 * h, 2 * w


def reference(frames: list[np.ndarray], shots: list[int], batch: int, overlap: int) -> np.ndarray:
    """The in-memory plan: inside each shot, chunks of ``batch`` with ``overlap`` shared frames, cross-faded."""
    out, s0 = [], 0
    for n in shots:
        shot = np.stack(frames[s0:s0 + n])
        acc = np.zeros((n, 2 * H, 2 * W, 3), np.float32)
        start, first = 0, True
        while True:
            end = min(start + batch, n)
            up = double(shot[start:end]).astype(np.float32)
            w = np.ones((end - start, 1, 1, 1), np.float32)
            if not first and overlap:
                w[:overlap] = ramp(overlap)
            if end < n and overlap:
                w[end - start - overlap:] *= 1.0 - ramp(overlap)
            acc[start:end] += up * w
            if end >= n:
                break
            start, first = start + batch - overlap, False
        out.append(np.clip(acc, 0, 1))
        s0 += n
    return np.concatenate(out)


def _decode(path) -> np.ndarray:
    return np.stack(list(C.read_frames(str(path))))


def test_frames_fps_audio_rotation_and_colour_carried_over(tmp_path):
    src = write_clip(str(tmp_path / "in.mp4"), clip_frames([30], H, W), fps=fractions.Fraction(30000, 1001),
                     codec="h264", rotation=90)
    out = tmp_path / "out.mp4"
    res = upscale_video(src, str(out), double, size2, StreamSettings(batch_size=9, overlap=2))
    info = C.probe(str(out))
    assert (res.frames, info.frames) == (30, 30)
    assert info.fps == fractions.Fraction(30000, 1001) and (info.width, info.height) == (2 * W, 2 * H)
    assert info.rotation == C.probe(src).rotation == 90
    assert info.color_primaries == 1 and info.colorspace == 1   # BT.709 (the source says nothing)
    assert info.has_audio and abs(audio_seconds(str(out)) - audio_seconds(src)) < 1e-6
    assert not os.path.exists(work_dir_for(str(out)))   # work folder removed after success


@pytest.mark.parametrize("batch,overlap", [(9, 2), (5, 0), (13, 4), (1, 0)])
def test_blending_equals_the_in_memory_plan(tmp_path, batch, overlap):
    frames = clip_frames([23], H, W)
    src = write_clip(str(tmp_path / "in.mkv"), frames, audio=False)
    out = tmp_path / "out.mkv"
    upscale_video(src, str(out), double, size2, StreamSettings(batch_size=batch, overlap=overlap, codec="ffv1"))
    got = _decode(out)
    decoded_in = list(C.read_frames(src))
    want = reference(decoded_in, [23], batch, overlap)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1.0 / 65535 + 1e-7   # 16-bit FFV1: rounding only


def test_no_chunk_spans_a_scene_cut_and_shots_equal_alone(tmp_path):
    shots = [14, 9, 17]
    frames = clip_frames(shots, H, W)
    src = write_clip(str(tmp_path / "in.mkv"), frames, audio=False)
    seen = []

    def spy(chunk):
        seen.append(len(chunk))
        return double(chunk)
    out = tmp_path / "out.mkv"
    s = StreamSettings(batch_size=9, overlap=2, codec="ffv1")
    upscale_video(src, str(out), spy, size2, s)
    # chunk starts/ends from the lengths: every shot boundary (14, 23) is a chunk boundary
    decoded = list(C.read_frames(src))
    want = reference(decoded, shots, 9, 2)
    got = _decode(out)
    assert np.abs(got - want).max() <= 1.0 / 65535 + 1e-7
    # each shot upscaled alone gives the same frames
    s0 = 0
    for k, n in enumerate(shots):
        alone_src = write_clip(str(tmp_path / f"shot{k}.mkv"), frames[s0:s0 + n], audio=False)
        alone = _decode(upscale_video(alone_src, str(tmp_path / f"shot{k}_out.mkv"), double, size2, s).out_path)
        assert np.array_equal(alone, got[s0:s0 + n]), k
        s0 += n
    assert sum(seen) == 40 + 2 * (len(seen) - 3)   # overlaps only inside shots


def test_resume_after_a_stop_equals_an_uninterrupted_run(tmp_path):
    src = write_clip(str(tmp_path / "in.mp4"), clip_frames([20, 25], H, W), codec="h264")
    full = tmp_path / "full.mp4"
    upscale_video(src, str(full), double, size2, StreamSettings(batch_size=9, overlap=2))
    calls = {"n": 0}

    def dies_at_third(chunk):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt("stopped")
        return double(chunk)
    out = tmp_path / "out.mp4"
    with pytest.raises(KeyboardInterrupt):
        upscale_video(src, str(out), dies_at_third, size2, StreamSettings(batch_size=9, overlap=2))
    assert not out.exists() and not list(tmp_path.glob("out.mp4.partial*"))
    assert os.path.isdir(work_dir_for(str(out)))
    again = {"n": 0}

    def counting(chunk):
        again["n"] += 1
        return double(chunk)
    res = upscale_video(src, str(out), counting, size2, StreamSettings(batch_size=9, overlap=2))
    assert res.resumed_chunks == 2 and again["n"] == res.chunks - 2
    assert np.array_equal(_decode(out), _decode(full))
    assert audio_seconds(str(out)) == audio_seconds(str(full))


def test_changed_settings_do_not_resume(tmp_path):
    src = write_clip(str(tmp_path / "in.mkv"), clip_frames([20], H, W), audio=False)
    out = tmp_path / "out.mkv"
    s = StreamSettings(batch_size=9, overlap=2, codec="ffv1", keep_work=True)
    upscale_video(src, str(out), double, size2, s)
    os.remove(out)
    res = upscale_video(src, str(out), double, size2, StreamSettings(batch_size=5, overlap=2, codec="ffv1"))
    assert res.resumed_chunks == 0


def test_png16_sequence_with_audio(tmp_path):
    src = write_clip(str(tmp_path / "in.mp4"), clip_frames([11], H, W), codec="h264")
    out = tmp_path / "frames"
    upscale_video(src, str(out), double, size2, StreamSettings(batch_size=5, overlap=1, codec="png16"))
    names = sorted(p.name for p in out.iterdir())
    assert names == ["audio.m4a"] + [f"frame_{i:08d}.png" for i in range(11)]
    with av.open(str(out / "frame_00000000.png")) as c:
        cc = c.streams.video[0].codec_context
        assert (cc.width, cc.height, cc.pix_fmt) == (2 * W, 2 * H, "rgb48be")   # 16 bits a component
    assert abs(audio_seconds(str(out / "audio.m4a")) - audio_seconds(src)) < 1e-6


def test_errors_before_any_work(tmp_path, monkeypatch):
    called = []

    def never(chunk):
        called.append(1)
        return double(chunk)
    s = StreamSettings()
    with pytest.raises(C.VideoFileError, match="does not exist"):
        upscale_video(str(tmp_path / "nope.mp4"), str(tmp_path / "o.mp4"), never, size2, s)
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(os.urandom(4096))
    with pytest.raises(C.VideoFileError, match="cannot be read"):
        upscale_video(str(junk), str(tmp_path / "o.mp4"), never, size2, s)
    audio_only = tmp_path / "a.mka"
    with av.open(str(audio_only), "w") as c:
        st = c.add_stream("flac", rate=8000)
        st.layout = "mono"
        f = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        f.sample_rate, f.pts = 8000, 0
        for p in st.encode(f):
            c.mux(p)
        for p in st.encode():
            c.mux(p)
    with pytest.raises(C.VideoFileError, match="no video stream"):
        upscale_video(str(audio_only), str(tmp_path / "o.mp4"), never, size2, s)
    src = write_clip(str(tmp_path / "in.mp4"), clip_frames([5], H, W), codec="h264")
    with pytest.raises(C.VideoFileError, match="is the input file"):
        upscale_video(src, src, never, size2, s)
    with pytest.raises(C.VideoFileError, match="unknown output codec"):
        upscale_video(src, str(tmp_path / "o.mp4"), never, size2, StreamSettings(codec="divx"))
    with pytest.raises(C.VideoFileError, match="FFV1 goes into a .mkv"):
        upscale_video(src, str(tmp_path / "o.mp4"), never, size2, StreamSettings(codec="ffv1"))
    with pytest.raises(C.VideoFileError, match="batch_size must be 4n\\+1"):
        upscale_video(src, str(tmp_path / "o.mp4"), never, size2, StreamSettings(batch_size=8))
    import shutil
    from collections import namedtuple
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10**6, 10**6, 10))
    with pytest.raises(C.VideoFileError, match="not enough disk space"):
        upscale_video(src, str(tmp_path / "o.mp4"), never, size2, s)
    assert not called


@pytest.mark.parametrize("bits", [8, 16])
def test_to_pixels_of_a_tensor_equals_the_host_conversion(bits):
    import torch
    top = 255 if bits <= 8 else 65535
    g = np.random.default_rng(3)
    x = g.random((9, 5, 7, 3), dtype=np.float32) * 1.2 - 0.1              # outside [0, 1] too: clipped
    ties = (np.arange(2 * 5 * 7 * 3, dtype=np.float32).reshape(2, 5, 7, 3) % top + 0.5) / top   # halves: to even
    x = np.concatenate([x, ties]).astype(np.float32)
    want = C.to_pixels(x, bits)
    for t in (torch.from_numpy(x), torch.from_numpy(x).to(torch.float64)):
        got = C.to_pixels(t, bits)
        assert got.dtype == want.dtype and np.array_equal(got, want)


@pytest.mark.parametrize("codec", ["ffv1", "h264"])
def test_an_upscaler_returning_tensors_writes_the_same_file(tmp_path, codec):
    """The CLI's and the node's upscalers hand back torch tensors on their device: same frames as numpy output."""
    import torch
    frames = clip_frames([8, 13], H, W)
    src = write_clip(str(tmp_path / "in.mkv"), frames, audio=False)
    outs = []
    for name, up in (("np", double), ("torch", lambda f: torch.from_numpy(double(f).astype(np.float32)))):
        out = tmp_path / f"out_{name}.mkv"
        upscale_video(src, str(out), up, size2, StreamSettings(batch_size=5, overlap=2, codec=codec))
        outs.append(_decode(out))
    assert np.array_equal(outs[0], outs[1])


@pytest.mark.parametrize("codec", ["ffv1", "h264"])
def test_frame_cursor_seeks_to_the_keyframe_before_a_far_range_and_reads_the_same_frames(tmp_path, codec):
    src = write_clip(str(tmp_path / f"in.{'mkv' if codec == 'ffv1' else 'mp4'}"), clip_frames([60, 60, 30], H, W),
                     codec=codec, audio=False)
    stamps = C.FrameStamps()
    assert len(list(C.read_frames(src, size=(16, 12), stamps=stamps))) == 150 and stamps.seekable()
    every = np.stack(list(C.read_frames(src)))
    ranges = [(0, 9), (70, 79), (77, 86), (140, 149)]   # as a rank takes them: forward, the next may overlap
    cursor = FrameCursor(src, 2, stamps)
    for a, b in ranges:
        assert np.array_equal(cursor.take(a, b), every[a:b])
    assert cursor.seeks >= 1   # the skip from frame 9 to 70 went to the keyframe at 60 (or later)
    # stamps that do not match the file: the seek is noticed and the frames come from a decode from the start
    wrong = C.FrameStamps([p + 1 for p in stamps.pts], list(stamps.keys))
    cursor = FrameCursor(src, 2, wrong)
    for a, b in ranges:
        assert np.array_equal(cursor.take(a, b), every[a:b])
    assert cursor.seeks == 0
