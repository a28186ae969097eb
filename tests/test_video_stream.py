"""The streaming upscale (models/seedvr2/video) with an injected upscaler: frame count, fps, audio, rotation and
colour tags carried over; blending as the in-memory plan; scene cuts; resume; errors before any work; the next
chunk's frames decoded and the finished units remuxed while the model runs; capped decoder threads."""
from __future__ import annotations

import fractions
import os
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from video_clips import audio_seconds, clip_frames, write_clip  # noqa: E402

av = pytest.importorskip("av", reason="PyAV (ComfyUI's video library) is not installed")

from seedvr2bw.models.seedvr2.video import container as C  # noqa: E402
from seedvr2bw.models.seedvr2.video.stream import FrameCursor, StreamSettings, ramp, upscale_video  # noqa: E402
from seedvr2bw.models.seedvr2.video.workdir import work_dir_for  # noqa: E402

H, W = 48, 64   # x264 output of frames under 128x96 differed 1 run in 400 with other threads busy


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


def _spy_reads(monkeypatch) -> list:
    """Patches FrameCursor.take to note each range as its decoding starts (in whichever thread reads)."""
    started = []
    take = FrameCursor.take

    def spy(self, start, end):
        started.append((start, end))
        return take(self, start, end)
    monkeypatch.setattr(FrameCursor, "take", spy)
    return started


def test_the_next_chunks_frames_are_decoded_while_the_model_runs(tmp_path, monkeypatch):
    src = write_clip(str(tmp_path / "in.mkv"), clip_frames([40], H, W), audio=False)
    started = _spy_reads(monkeypatch)
    calls, ahead, most = [], [], []

    def model(frames):
        calls.append(len(frames))
        n = len(calls)
        # a synchronous reader would start the next range only after this returns: wait for it here instead
        for _ in range(400):
            if len(started) > n or n == 6:   # 40 frames, batch 9, overlap 2: 6 chunks
                break
            threading.Event().wait(0.01)
        ahead.append(len(started) > n)
        threading.Event().wait(0.05)   # time for a reader that would run further ahead than one chunk
        most.append(len(started) - n)
        return double(frames)
    out = tmp_path / "out.mkv"
    s = StreamSettings(batch_size=9, overlap=2, codec="ffv1")
    upscale_video(src, str(out), model, size2, s)
    assert len(calls) == 6 and ahead == [True] * 5 + [False], ahead
    assert max(most) <= 1, most   # one chunk decoded ahead at most
    assert started == sorted(started)   # forward only
    want = reference(list(C.read_frames(src)), [40], 9, 2)
    assert np.abs(_decode(out) - want).max() <= 1.0 / 65535 + 1e-7


def _threads() -> set:
    return {t.ident for t in threading.enumerate()}


def test_a_read_error_or_a_stop_ends_the_run_cleanly_and_it_resumes(tmp_path, monkeypatch):
    src = write_clip(str(tmp_path / "in.mp4"), clip_frames([45], H, W), codec="h264")
    s = StreamSettings(batch_size=9, overlap=2)
    full = tmp_path / "full.mp4"
    upscale_video(src, str(full), double, size2, s)
    before = _threads()
    take = FrameCursor.take

    def broken(self, start, end):
        if start >= 14:   # the third chunk's frames, decoded ahead while the second chunk runs
            raise OSError("disk gone")
        return take(self, start, end)
    monkeypatch.setattr(FrameCursor, "take", broken)
    ran = []

    def model(frames):
        ran.append(len(frames))
        return double(frames)
    out = tmp_path / "out.mp4"
    with pytest.raises(OSError, match="disk gone"):
        upscale_video(src, str(out), model, size2, s)
    assert len(ran) == 2   # the error is raised where the third chunk's frames are taken
    assert _threads() == before   # the reader and encoder threads are gone
    assert not out.exists() and not list(tmp_path.glob("out.mp4.partial*"))
    monkeypatch.setattr(FrameCursor, "take", take)
    stops = {"n": 0}

    def stop_at_fourth():
        stops["n"] += 1
        if stops["n"] == 2:   # this run's second chunk: the fourth of the video
            raise KeyboardInterrupt("cancel")
    with pytest.raises(KeyboardInterrupt):
        upscale_video(src, str(out), model, size2, s, should_stop=stop_at_fourth)
    assert len(ran) == 3 and _threads() == before
    assert not out.exists() and not list(tmp_path.glob("out.mp4.partial*"))
    res = upscale_video(src, str(out), model, size2, s)
    assert res.resumed_chunks == 3 and len(ran) == res.chunks
    assert out.read_bytes() == full.read_bytes()


def _within(seconds: float, ready) -> bool:
    for _ in range(int(seconds / 0.01)):
        if ready():
            return True
        threading.Event().wait(0.01)
    return ready()


@pytest.mark.parametrize("codec", ["h264", "png16"])
def test_units_go_into_the_output_while_the_chunks_run(tmp_path, monkeypatch, codec):
    src = write_clip(str(tmp_path / "in.mp4"), clip_frames([50], H, W), codec="h264")
    out = tmp_path / ("out" if codec == "png16" else "out.mp4")
    appended = []
    append = C.ConcatWriter.append

    def spy(self, segment):
        appended.append(segment)
        return append(self, segment)
    monkeypatch.setattr(C.ConcatWriter, "append", spy)
    partial = tmp_path / "out.partial"
    calls = []

    def model(frames):
        n = len(calls)   # 50 frames, batch 9, overlap 2: chunk n starts at frame 7n
        # when chunk n starts, the encoder (two units queued at most) has written every unit up to chunk n - 2's
        # body, frames 0 .. 7(n - 1) - 1: the writer puts them into the output without waiting for the end
        if codec == "png16":
            calls.append(_within(5, lambda: n < 2 or partial.exists() and len(os.listdir(partial)) >= 7 * (n - 1)))
        else:
            calls.append(_within(5, lambda: len(appended) >= 2 * n - 3))
        assert not out.exists()   # the final name never holds a partial output
        return double(frames)
    s = StreamSettings(batch_size=9, overlap=2, codec=codec)
    res = upscale_video(src, str(out), model, size2, s)
    assert res.chunks == 7 and calls == [True] * 7
    if codec == "png16":
        assert len(list(out.iterdir())) == 50 + 1   # and audio.m4a
    else:
        assert len(appended) == 2 * 7 - 1 and C.probe(str(out)).frames == 50


def test_decoders_use_at_most_the_capped_threads(tmp_path, monkeypatch):
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("counts threads with Linux's /proc")
    src = write_clip(str(tmp_path / "in.mp4"), clip_frames([40], H, W), codec="h264", audio=False)

    def extra_threads() -> int:
        base = most = len(os.listdir("/proc/self/task"))
        for _ in C.read_frames(src):
            most = max(most, len(os.listdir("/proc/self/task")))
        return most - base
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert C.decoder_threads() == 8
    monkeypatch.setattr(C, "DECODER_THREADS_MAX", 1)
    # FFmpeg's own choice is a decoder thread per core, and PyAV 17's a thread per core for each frame's conversion
    assert extra_threads() == 0
    monkeypatch.setattr(C, "DECODER_THREADS_MAX", 3)
    assert extra_threads() >= 2


@pytest.mark.parametrize("codec", ["h264", "h265"])
def test_one_converter_per_stream_gives_the_pixels_of_a_new_one_per_frame(tmp_path, codec):
    """Reading and writing keep one scaler per stream (its threads started once, not per frame); the pixels and
    the encoded bytes are those of PyAV's per-frame ``reformat``."""
    av = pytest.importorskip("av")
    src = write_clip(str(tmp_path / "in.mp4"), clip_frames([6], H, W), codec="h264", audio=False)
    with av.open(src) as c:
        fresh = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    read = list(C.read_frames(src))
    assert len(read) == len(fresh) and all(np.array_equal(r, f / np.float32(255.0)) for r, f in zip(read, fresh))

    frames = np.stack(read).repeat(2, axis=1).repeat(2, axis=2)   # x264 at the output size the other tests use
    cd = C.get_codec(codec)
    w = C.SegmentWriter(str(tmp_path / "kept.nut"), cd, 2 * W, 2 * H, fractions.Fraction(24))
    w.write(frames)
    w.close()

    class PerFrame(C.SegmentWriter):     # the conversion PyAV makes when asked per frame
        def write(self, frames):
            for img in C.to_pixels(frames, cd.bits):
                f = av.VideoFrame.from_ndarray(img, format=self.src_format)
                f = f.reformat(format=cd.pix_fmt, dst_colorspace=C.BT709)
                f.pts = self.count
                for packet in self.stream.encode(f):
                    self.container.mux(packet)
                self.count += 1
    w = PerFrame(str(tmp_path / "fresh.nut"), cd, 2 * W, 2 * H, fractions.Fraction(24))
    w.write(frames)
    w.close()
    assert (tmp_path / "kept.nut").read_bytes() == (tmp_path / "fresh.nut").read_bytes()


def test_two_units_encode_at_once_up_to_1080p(tmp_path, monkeypatch):
    """A body and a seam are encoded side by side where the frames are small enough; above the pixel limit one
    at a time. The output is the same file either way."""
    import seedvr2bw.models.seedvr2.video.stream as S
    src = write_clip(str(tmp_path / "in.mp4"), clip_frames([30], H, W), codec="h264", audio=False)
    active, most, lock = [0], [0], threading.Lock()
    write = C.SegmentWriter.write

    def slow(self, frames):
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        threading.Event().wait(0.2)   # long enough for the next unit to be queued beside it
        try:
            return write(self, frames)
        finally:
            with lock:
                active[0] -= 1
    monkeypatch.setattr(C.SegmentWriter, "write", slow)
    outputs = []
    for limit, together in ((S.TWO_ENCODERS_MAX_PIXELS, 2), (0, 1)):
        monkeypatch.setattr(S, "TWO_ENCODERS_MAX_PIXELS", limit)
        most[0] = 0
        outputs.append(tmp_path / f"out{limit}.mp4")
        upscale_video(src, str(outputs[-1]), double, size2, StreamSettings(batch_size=9, overlap=2))
        assert most[0] == together
    assert outputs[0].read_bytes() == outputs[1].read_bytes()
