"""Video files through PyAV (which ComfyUI already depends on): what an input holds, its frames in order, and the
encoders the upscaled frames are written with.

Frames travel as float32 arrays (T, H, W, 3) in [0, 1]. Output formats keep the model's float output as far as
they can: 8-bit H.264, 10-bit H.265 and ProRes, 16-bit FFV1 and 16-bit PNG sequences.
"""
from __future__ import annotations

import dataclasses
import fractions
import functools
import os
from typing import Iterator, Optional

import numpy as np
import torch


class VideoFileError(ValueError):
    """A video file that cannot be used, with what to do about it."""


def _av():
    try:
        import av
    except ImportError as exc:   # ComfyUI ships PyAV; a bare Python may not
        raise VideoFileError("reading and writing video files needs PyAV. Fix: pip install av") from exc
    return av


@dataclasses.dataclass(frozen=True)
class VideoInfo:
    path: str
    frames: int
    fps: fractions.Fraction
    width: int                  # as stored (before rotation)
    height: int
    rotation: int               # degrees the player turns the picture (display matrix), 0 if none
    codec: str
    color_primaries: Optional[int]
    color_trc: Optional[int]
    colorspace: Optional[int]
    color_range: Optional[int]
    has_audio: bool
    audio_codec: Optional[str]
    duration_s: float

    def fingerprint(self) -> dict:
        """What identifies the input for resume (with the file's size and mtime)."""
        st = os.stat(self.path)
        return {"path": os.path.abspath(self.path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                "frames": self.frames, "fps": str(self.fps), "width": self.width, "height": self.height}


def _count_frames(container, stream) -> int:
    n = 0
    for packet in container.demux(stream):
        if packet.size:   # the flush packet has none
            n += 1
    return n


def probe(path: str) -> VideoInfo:
    """Reads the container's header and counts the video packets (no decoding). Raises ``VideoFileError`` for a
    missing or unreadable file, no video stream, or zero frames."""
    av = _av()
    if not os.path.isfile(path):
        raise VideoFileError(f"video file {path!r} does not exist. Fix: give the path of an existing video file.")
    try:
        container = av.open(path)
    except Exception as exc:  # noqa: BLE001 - PyAV raises several error types for a bad file
        raise VideoFileError(f"video file {path!r} cannot be read ({type(exc).__name__}: {exc}). Fix: check that it "
                             "is a complete video file (re-download or re-export it).") from exc
    with container:
        if not container.streams.video:
            raise VideoFileError(f"{path!r} has no video stream. Fix: give a video file (an audio-only or image "
                                 "file cannot be upscaled here).")
        vs = container.streams.video[0]
        cc = vs.codec_context
        audio = container.streams.audio[0] if container.streams.audio else None
        fps = vs.average_rate or vs.guessed_rate or vs.base_rate
        if not fps:
            raise VideoFileError(f"{path!r}: the video stream has no frame rate. Fix: re-export it with a constant "
                                 "frame rate.")
        rotation = 0
        try:
            for frame in container.decode(vs):
                rotation = int(round(getattr(frame, "rotation", 0) or 0)) % 360
                break
        except Exception as exc:  # noqa: BLE001
            raise VideoFileError(f"{path!r}: its first video frame cannot be decoded ({exc}). Fix: re-export the "
                                 "file with a common codec (H.264, H.265, ProRes, VP9).") from exc
        container.seek(0)
        frames = _count_frames(container, vs)
        dur = float(container.duration / 1e6) if container.duration else frames / float(fps)
        info = VideoInfo(path=path, frames=frames, fps=fractions.Fraction(fps), width=cc.width, height=cc.height,
                         rotation=rotation, codec=cc.name, color_primaries=_enum(cc, "color_primaries"),
                         color_trc=_enum(cc, "color_trc"), colorspace=_enum(cc, "colorspace"),
                         color_range=_enum(cc, "color_range"), has_audio=audio is not None,
                         audio_codec=audio.codec_context.name if audio is not None else None, duration_s=dur)
    if info.frames == 0:
        raise VideoFileError(f"{path!r} has a video stream with 0 frames. Fix: give a video with frames.")
    return info


def _enum(cc, name) -> Optional[int]:
    v = getattr(cc, name, None)
    if v is None:
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


@dataclasses.dataclass
class FrameStamps:
    """Each decoded frame's presentation time (in the stream's time base, None where the container has none) and
    whether it is a keyframe, in decode-output order: what a later reader needs to seek to a frame exactly."""
    pts: list = dataclasses.field(default_factory=list)
    keys: list = dataclasses.field(default_factory=list)

    def seekable(self) -> bool:
        return bool(self.pts) and None not in self.pts and all(a < b for a, b in zip(self.pts, self.pts[1:]))

    def key_before(self, index: int) -> int:
        """The last keyframe at or before frame ``index`` (0 when none)."""
        return next((k for k in range(min(index, len(self.keys) - 1), -1, -1) if self.keys[k]), 0)


# FFmpeg's "auto" is a thread per core for each decoder and (PyAV 17 and later) for each pixel conversion: 4 ranks
# on a 64-core host would each start 64
DECODER_THREADS_MAX = 8


def decoder_threads() -> int:
    """Threads a decoder of ``read_frames``, and each frame's conversion there, get: the cores, at most
    ``DECODER_THREADS_MAX``."""
    return max(1, min(DECODER_THREADS_MAX, os.cpu_count() or 1))


@functools.lru_cache(maxsize=None)
def _conversions_take_threads() -> bool:
    try:
        _av().VideoFrame(2, 2, "rgb24").reformat(format="gray", threads=1)
    except TypeError:   # PyAV before 17, whose conversions run on the calling thread
        return False
    return True


class Converter:
    """One pixel converter for a stream's frames, at most ``threads`` threads. ``frame.reformat`` makes a new
    scaler (and starts its threads) on every call; one kept for the stream reuses them: 0.2 ms a 360p frame
    against 1.4 ms with 8 threads started per frame, measured on a 2-core machine. The pixels are the same."""

    def __init__(self, threads: int):
        self.scaler = _av().video.reformatter.VideoReformatter()
        self.options = {"threads": threads} if _conversions_take_threads() else {}

    def __call__(self, frame, **kwargs):
        return self.scaler.reformat(frame, **kwargs, **self.options)


class SeekMismatch(RuntimeError):
    """After a seek the decoder gave a frame whose time is not the expected one (an open GOP's leading frames, a
    timestamp the container rewrote): the reader must decode from the start instead."""


def read_frames(path: str, start: int = 0, size: Optional[tuple[int, int]] = None,
                stamps: Optional[FrameStamps] = None, seek: Optional[tuple[int, FrameStamps]] = None
                ) -> Iterator[np.ndarray]:
    """Decoded frames in order from frame ``start`` on, each (H, W, 3) float32 in [0, 1] as stored (rotation is
    metadata, carried to the output). One frame in memory at a time. ``size`` (w, h): scaled down by the decoder's
    scaler instead (what the scene detector looks at: much cheaper than full frames). ``stamps``: filled with every
    frame's time and keyframe flag. ``seek`` (k, stamps of a full pass): start decoding at keyframe k (frames
    before ``start`` from k on are decoded and dropped); every frame's time must match the stamps, else
    SeekMismatch (raised before the first wrong frame is given)."""
    av = _av()
    with av.open(path) as container:
        vs = container.streams.video[0]
        vs.thread_type = "AUTO"
        vs.codec_context.thread_count = decoder_threads()
        convert = Converter(decoder_threads())
        first = 0
        if seek is not None:
            first, known = seek
            container.seek(known.pts[first], stream=vs, backward=True, any_frame=False)
        for i, frame in enumerate(container.decode(vs), start=first):
            if seek is not None and (i >= len(known.pts) or frame.pts != known.pts[i]):
                raise SeekMismatch(f"{path}: frame {i} after a seek has time {frame.pts}, expected "
                                   f"{known.pts[i] if i < len(known.pts) else 'none'}")
            if stamps is not None:
                stamps.pts.append(frame.pts)
                stamps.keys.append(bool(frame.key_frame))
            if i < start:
                continue
            if size is not None:
                rgb = convert(frame, width=size[0], height=size[1], format="rgb24").to_ndarray()
            else:
                rgb = convert(frame, format="rgb48le" if _deep(frame) else "rgb24").to_ndarray()
            yield rgb.astype(np.float32) / (65535.0 if rgb.dtype == np.uint16 else 255.0)


def _deep(frame) -> bool:
    """More than 8 bits per component in the source (keep them)."""
    name = frame.format.name
    return any(t in name for t in ("10", "12", "14", "16"))


# ----------------------------------------------------------------------------------------------- writing
@dataclasses.dataclass(frozen=True)
class Codec:
    name: str            # what the user picks
    encoder: str         # FFmpeg encoder
    pix_fmt: str
    bits: int            # bits per component the encoder is fed with
    container: str       # default file extension
    options: tuple = ()  # (key, value) encoder options
    segment_format: str = "nut"   # a chunk's file: NUT keeps a 1/fps time base; ProRes needs MOV

    def sequence(self) -> bool:
        return self.encoder == "png"


CODECS = {
    # no B-frames: every packet's decode time is its presentation time, so segments concatenate by frame index
    "h264": Codec("h264", "libx264", "yuv420p", 8, ".mp4", (("crf", "16"), ("preset", "medium"), ("bf", "0"))),
    "h265": Codec("h265", "libx265", "yuv420p10le", 16, ".mp4", (("crf", "18"), ("preset", "medium"),
                                                                 ("x265-params", "log-level=error:bframes=0"))),
    "prores": Codec("prores", "prores_ks", "yuv422p10le", 16, ".mov", (("profile", "3"),), "mov"),
    "ffv1": Codec("ffv1", "ffv1", "gbrp16le", 16, ".mkv", (("level", "3"),)),
    "png16": Codec("png16", "png", "rgb48be", 16, "", ()),
}
DEFAULT_CODEC = "h264"


def available_codecs() -> dict[str, bool]:
    av = _av()
    out = {}
    for name, c in CODECS.items():
        try:
            av.codec.Codec(c.encoder, "w")
            out[name] = True
        except Exception:  # noqa: BLE001 - UnknownCodecError and friends
            out[name] = False
    return out


def get_codec(name: str) -> Codec:
    c = CODECS.get(str(name).lower())
    if c is None:
        raise VideoFileError(f"unknown output codec {name!r}. Fix: use one of {', '.join(CODECS)}.")
    if not available_codecs()[c.name]:
        ok = [k for k, v in available_codecs().items() if v]
        raise VideoFileError(f"the installed PyAV cannot encode {c.name} (FFmpeg encoder {c.encoder} missing). "
                             f"Fix: choose one of {', '.join(ok)}, or install a PyAV build with {c.encoder}.")
    return c


PIXEL_SLICE_FRAMES = 4   # frames converted at a time: the float32 temporary stays at 4 frames, not a whole chunk's


def to_pixels(frames, bits: int) -> np.ndarray:
    """(T, H, W, 3) float in [0, 1] -> uint8 or uint16 on the host, rounded to nearest (ties to even) and clipped, a
    float32 temporary of ``PIXEL_SLICE_FRAMES`` frames at a time; integer arrays are pixels already and pass
    through. A torch tensor is converted where it lies (a GPU output crosses to the host as integers, a quarter of
    its floats' bytes) with the same float32 steps, so the pixels equal the host conversion's."""
    top = 255.0 if bits <= 8 else 65535.0
    dtype = np.uint8 if bits <= 8 else np.uint16
    if isinstance(frames, torch.Tensor):
        if not frames.is_floating_point():
            return frames.cpu().numpy()
        out = np.empty(tuple(frames.shape), dtype=dtype)
        wide = torch.uint8 if bits <= 8 else torch.int32    # int32 on the device: uint16 casts are not everywhere
        for i in range(0, len(frames), PIXEL_SLICE_FRAMES):
            x = frames[i:i + PIXEL_SLICE_FRAMES].to(torch.float32) * top
            out[i:i + PIXEL_SLICE_FRAMES] = torch.round(x).clamp_(0, top).to(wide).cpu().numpy()
        return out
    if not np.issubdtype(frames.dtype, np.floating):
        return frames
    out = np.empty(frames.shape, dtype=dtype)
    for i in range(0, len(frames), PIXEL_SLICE_FRAMES):
        x = np.multiply(frames[i:i + PIXEL_SLICE_FRAMES], np.float32(top), dtype=np.float32)
        np.rint(x, out=x)
        np.clip(x, 0, top, out=x)
        out[i:i + PIXEL_SLICE_FRAMES] = x
    return out


def host_floats(frames) -> np.ndarray:
    """float32 frames on the host, from a numpy array or a torch tensor on any device."""
    if isinstance(frames, torch.Tensor):
        return frames.detach().to(device="cpu", dtype=torch.float32).numpy()
    return np.asarray(frames, dtype=np.float32)


BT709 = 1   # AVCOL_PRI_BT709 / AVCOL_TRC_BT709 / AVCOL_SPC_BT709
# Each x264 frame thread holds its own frames: at 720p a 17-frame segment peaked 206 MB above the frames with 4
# threads and 445 MB with the 24 that "auto" gives a 16-core host, while 4 threads encode far faster than the model
# upscales; a fixed count also makes a segment's bits the same on every machine.
ENCODER_THREADS = 4


class SegmentWriter:
    """Encodes frames into one file (a chunk's segment, in the output codec). ``close()`` flushes; the file is
    complete only after it, so callers write to a temporary name and rename."""

    def __init__(self, path: str, codec: Codec, width: int, height: int, fps: fractions.Fraction,
                 color: Optional[dict] = None):
        av = _av()
        self.codec, self.path, self.count = codec, path, 0
        self.container = av.open(path, "w", format=codec.segment_format)
        st = self.container.add_stream(codec.encoder, rate=fps)
        st.width, st.height, st.pix_fmt = width, height, codec.pix_fmt
        st.time_base = fractions.Fraction(1, 1) / fps
        st.codec_context.time_base = st.time_base
        st.options = dict(codec.options)
        st.codec_context.thread_count = ENCODER_THREADS
        st.codec_context.thread_type = "AUTO"
        color = color or {}
        cc = st.codec_context
        for k in ("color_primaries", "color_trc", "colorspace"):
            if color.get(k) is not None:
                setattr(cc, k, color[k])
        self.stream = st
        self.convert = Converter(ENCODER_THREADS)
        self.src_format = "rgb24" if codec.bits <= 8 else "rgb48le"
        self.colorspace = color.get("colorspace")

    def write(self, frames: np.ndarray) -> None:
        av = _av()
        px = to_pixels(frames, self.codec.bits)
        for img in px:
            f = av.VideoFrame.from_ndarray(img, format=self.src_format)
            if self.codec.pix_fmt.startswith("yuv"):
                f = self.convert(f, format=self.codec.pix_fmt, dst_colorspace=self.colorspace or BT709)
            f.pts = self.count
            for packet in self.stream.encode(f):
                self.container.mux(packet)
            self.count += 1

    def close(self) -> None:
        for packet in self.stream.encode():
            self.container.mux(packet)
        self.container.close()


def write_png_frames(folder: str, first_index: int, frames: np.ndarray) -> None:
    """16-bit PNGs ``frame_%08d.png`` (each written to a temporary name, then renamed)."""
    os.makedirs(folder, exist_ok=True)
    px = to_pixels(frames, 16)
    for i, img in enumerate(px):
        p = os.path.join(folder, f"frame_{first_index + i:08d}.png")
        tmp = p + ".tmp.png"
        _png16(img, tmp)
        os.replace(tmp, p)


def _png16(img: np.ndarray, path: str) -> None:
    av = _av()
    with av.open(path, "w", format="image2", options={"update": "1"}) as c:
        st = c.add_stream("png", rate=1)
        st.width, st.height, st.pix_fmt = img.shape[1], img.shape[0], "rgb48be"
        f = av.VideoFrame.from_ndarray(img, format="rgb48le").reformat(format="rgb48be")
        for packet in st.encode(f):
            c.mux(packet)
        for packet in st.encode():
            c.mux(packet)


# Our own segments need no probing (one stream, parameters in the header): FFmpeg's default probe decodes frames
# and took 0.3 s per segment, about a third of a long video's time outside the GPU; with this, 0.05 s
SEGMENT_OPEN = {"probesize": "32", "analyzeduration": "0"}


class ConcatWriter:
    """Remuxes segments' packets (no re-encoding) one after another into ``out_path`` as they are appended, so a
    caller can write each segment as soon as it and every one before it exist; ``close`` adds the audio stream of
    ``audio_from`` (copied unchanged) and renames the temporary file to ``out_path``: the final name never holds a
    partial file. ``abort`` removes the temporary file."""

    def __init__(self, out_path: str, codec: Codec, fps: fractions.Fraction, rotation: int = 0,
                 audio_from: Optional[str] = None, color: Optional[dict] = None):
        self.out_path, self.codec, self.fps, self.rotation = out_path, codec, fps, rotation
        self.audio_from, self.color = audio_from, color
        ext = os.path.splitext(out_path)[1].lower() or codec.container
        self.tmp = f"{out_path}.partial{ext}"
        self.out = self.vout = self.src = self.ain = self.aout = None
        self.offset = 0   # frames before the next segment

    def _open(self, vin) -> None:
        """The output's streams: video from the first segment's, audio from the source's."""
        av = _av()
        self.out = av.open(self.tmp, "w")
        self.vout = self.out.add_stream_from_template(vin)
        self.vout.time_base = fractions.Fraction(1, 1) / self.fps
        for k, v in (self.color or {}).items():
            if v is not None:
                setattr(self.vout.codec_context, k, v)
        if self.rotation:
            self.vout.set_display_rotation(self.rotation)
        if self.audio_from is not None:
            # kept open until close: the audio packets go in after the last segment's, as one stream
            self.src = av.open(self.audio_from)
            if self.src.streams.audio:
                self.ain = self.src.streams.audio[0]
                self.aout = self.out.add_stream_from_template(self.ain)

    def append(self, segment: str) -> None:
        av = _av()
        frame_tb = fractions.Fraction(1, 1) / self.fps
        with av.open(segment, options=SEGMENT_OPEN) as c:
            s = c.streams.video[0]
            if self.out is None:
                self._open(s)
            to_frames = s.time_base * self.fps   # segment ticks -> frames (1 when the muxer kept 1/fps)
            packets = [p for p in c.demux(s) if p.size]
            # muxers may shift a file's timestamps to start above 0: frame 0 is the earliest one
            first = min(int(round(p.pts * to_frames)) for p in packets)
            for packet in packets:
                idx = int(round(packet.pts * to_frames)) - first + self.offset
                packet.pts = packet.dts = idx
                packet.duration = 1
                packet.time_base = frame_tb
                packet.stream = self.vout
                self.out.mux(packet)
            self.offset += len(packets)

    def close(self) -> None:
        if self.out is None:
            raise RuntimeError(f"cannot write {self.out_path}: no segment was appended")
        try:
            if self.ain is not None:
                for packet in self.src.demux(self.ain):
                    if packet.dts is None:
                        continue
                    packet.stream = self.aout
                    self.out.mux(packet)
            self._close_files()
            os.replace(self.tmp, self.out_path)
        finally:
            self.abort()

    def abort(self) -> None:
        try:
            self._close_files()
        finally:
            if os.path.exists(self.tmp):
                os.remove(self.tmp)

    def _close_files(self) -> None:
        src, out, self.src, self.out = self.src, self.out, None, None
        for c in (src, out):
            if c is not None:
                c.close()


def copy_audio(src_path: str, out_path: str) -> None:
    """The first audio stream of ``src_path``, unchanged, into a file of its own (e.g. audio.mka beside a PNG
    sequence); temporary name, then renamed."""
    av = _av()
    tmp = out_path + ".partial" + os.path.splitext(out_path)[1]
    try:
        with av.open(src_path) as src, av.open(tmp, "w") as out:
            ain = src.streams.audio[0]
            aout = out.add_stream_from_template(ain)
            for packet in src.demux(ain):
                if packet.dts is None:
                    continue
                packet.stream = aout
                out.mux(packet)
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
