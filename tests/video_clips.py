"""Synthetic video clips for the streaming tests: shots of moving gradients with hard cuts between them, an AAC
(or PCM) audio track, optional rotation, written with PyAV."""
from __future__ import annotations

import fractions

import numpy as np


def shot_frame(shot: int, t: int, h: int, w: int) -> np.ndarray:
    """Frame ``t`` of shot ``shot``: a slowly moving gradient whose colours differ strongly between shots."""
    y = np.linspace(0, 1, h, dtype=np.float32)[:, None]
    x = np.linspace(0, 1, w, dtype=np.float32)[None, :]
    base = np.array([(0.15, 0.25, 0.8), (0.85, 0.3, 0.1), (0.2, 0.8, 0.3), (0.6, 0.6, 0.6)][shot % 4], np.float32)
    phase = 0.02 * t
    img = np.stack([base[c] * (0.6 + 0.4 * np.sin(6 * x + 3 * y + phase + c)) for c in range(3)], axis=-1)
    return np.clip(img, 0, 1)


def clip_frames(shots: list[int], h: int, w: int) -> list[np.ndarray]:
    """Frames of consecutive shots with the given lengths."""
    out = []
    for s, n in enumerate(shots):
        out += [shot_frame(s, t, h, w) for t in range(n)]
    return out


def write_clip(path: str, frames: list[np.ndarray], fps=fractions.Fraction(24), codec: str = "ffv1",
               audio: bool = True, rotation: int = 0, sample_rate: int = 48000) -> str:
    """Writes ``frames`` (float [0, 1]) losslessly (FFV1, for exact comparisons) or as H.264, plus a sine tone of
    the same duration."""
    import av
    with av.open(path, "w") as c:
        vs = c.add_stream("ffv1" if codec == "ffv1" else "libx264", rate=fps)
        vs.height, vs.width = frames[0].shape[:2]
        vs.pix_fmt = "bgr0" if codec == "ffv1" else "yuv420p"
        if rotation:
            vs.set_display_rotation(rotation)
        a = None
        if audio:
            a = c.add_stream("aac" if not path.endswith(".mkv") else "flac", rate=sample_rate)
            a.layout = "mono"
        for i, f in enumerate(frames):
            vf = av.VideoFrame.from_ndarray(np.clip(np.rint(f * 255), 0, 255).astype(np.uint8), format="rgb24")
            vf = vf.reformat(format=vs.pix_fmt)
            vf.pts = i
            for p in vs.encode(vf):
                c.mux(p)
        for p in vs.encode():
            c.mux(p)
        if a is not None:
            n = int(round(len(frames) / float(fps) * sample_rate))
            tone = (0.2 * np.sin(2 * np.pi * 440 * np.arange(n) / sample_rate)).astype(np.float32)
            fmt = a.codec_context.format.name
            step = 1024
            for k in range(0, n, step):
                chunk = tone[k:k + step]
                if fmt == "s16" or fmt == "s16p":
                    arr = (chunk * 32767).astype(np.int16)[None]
                elif fmt == "s32" or fmt == "s32p":
                    arr = (chunk * 2**31 * 0.99).astype(np.int32)[None]
                else:
                    arr = chunk[None]
                af = av.AudioFrame.from_ndarray(arr, format=fmt if fmt.endswith("p") else fmt, layout="mono")
                af.sample_rate = sample_rate
                af.pts = k
                for p in a.encode(af):
                    c.mux(p)
            for p in a.encode():
                c.mux(p)
    return path


def audio_seconds(path: str) -> float:
    import av
    with av.open(path) as c:
        if not c.streams.audio:
            return 0.0
        s = c.streams.audio[0]
        n = 0
        for frame in c.decode(s):
            n += frame.samples
        return n / s.codec_context.sample_rate
