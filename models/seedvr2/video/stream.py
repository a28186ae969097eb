"""Streaming upscale of a video file: decode -> chunks (scene-aware, overlapped) -> upscale -> blend -> encode, with
host memory bounded by one chunk whatever the video's length, a resumable work folder, and the final file written
only when every frame is there.

Chunks follow the in-memory pipeline's plan inside each shot: ``batch_size`` frames, consecutive chunks sharing
``overlap`` frames, the later chunk's weight rising as (j + 1) / (overlap + 1) over the shared frames and the earlier
one's falling so that they sum to 1. A scene cut ends a chunk early; no chunk and no cross-fade spans it, so the
frames of each shot are those of the shot upscaled alone.

The model is injected: ``upscale_chunk(frames)`` maps (n, H, W, 3) float32 in [0, 1] to (n, oh, ow, 3).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from typing import Callable, Optional

import numpy as np

from .container import (BT709, CODECS, SegmentWriter, VideoFileError, concat_segments, copy_audio, get_codec, probe,
                        read_frames, write_png_frames)
from .scenes import DEFAULT_THRESHOLD, CutDetector
from .workdir import WorkDir, work_dir_for

log = logging.getLogger(__name__)

# bytes per output pixel a finished segment takes on disk, generously (for the free-space check before any work)
_DISK_BYTES_PER_PIXEL = {"h264": 0.5, "h265": 0.5, "prores": 2.5, "ffv1": 5.0, "png16": 6.0}


@dataclasses.dataclass
class StreamSettings:
    batch_size: int = 21          # frames per chunk (the model takes 4n+1)
    overlap: int = 4              # frames shared by consecutive chunks of one shot, cross-faded
    codec: str = "h264"
    scene_threshold: float = DEFAULT_THRESHOLD   # 0 turns scene detection off
    resume: bool = True
    keep_work: bool = False       # keep the work folder after success

    def validate(self) -> None:
        if self.batch_size < 1 or (self.batch_size - 1) % 4:
            raise VideoFileError(f"batch_size must be 4n+1 (1, 5, 9, ..., 21, ...), got {self.batch_size}.")
        if self.overlap < 0 or (self.batch_size > 1 and self.overlap >= self.batch_size) or \
                (self.batch_size == 1 and self.overlap):
            raise VideoFileError(f"overlap must be between 0 and batch_size - 1 = {self.batch_size - 1}, got "
                                 f"{self.overlap}.")


@dataclasses.dataclass
class StreamResult:
    out_path: str
    frames: int
    chunks: int
    resumed_chunks: int
    seconds: float

    @property
    def fps(self) -> float:
        return self.frames / self.seconds if self.seconds > 0 else 0.0


def ramp(o: int) -> np.ndarray:
    """Weights of the later chunk over an overlap of ``o`` frames: (j + 1) / (o + 1)."""
    return (np.arange(1, o + 1, dtype=np.float32) / np.float32(o + 1)).reshape(-1, 1, 1, 1)


def output_color(info) -> dict:
    """The source's colour tags where it has them (2 = unspecified), else BT.709."""
    out = {}
    for k in ("color_primaries", "color_trc", "colorspace"):
        v = getattr(info, k)
        out[k] = v if v not in (None, 0, 2) else BT709
    return out


def check_paths(in_path: str, out_path: str, codec_name: str) -> None:
    """Errors a user can fix before any work: output = input, wrong extension for the codec."""
    codec = get_codec(codec_name)
    if os.path.realpath(in_path) == os.path.realpath(out_path):
        raise VideoFileError(f"the output {out_path!r} is the input file. Fix: choose another output path.")
    ext = os.path.splitext(out_path)[1].lower()
    if codec.sequence():
        if ext:
            raise VideoFileError(f"{codec.name} writes a folder of PNG frames: the output {out_path!r} must be a "
                                 "folder name without an extension. Fix: drop the extension or pick a video codec.")
    elif ext not in (".mp4", ".mkv", ".mov"):
        raise VideoFileError(f"output {out_path!r}: use a .mp4, .mkv or .mov file name (for {codec.name}: "
                             f"{codec.container}).")
    elif codec.name in ("ffv1",) and ext != ".mkv":
        raise VideoFileError(f"FFV1 goes into a .mkv file, not {ext}. Fix: name the output *.mkv.")
    elif codec.name == "prores" and ext not in (".mov", ".mkv"):
        raise VideoFileError(f"ProRes goes into a .mov (or .mkv) file, not {ext}. Fix: name the output *.mov.")


def check_disk(out_path: str, frames: int, width: int, height: int, codec_name: str) -> None:
    need = int(frames * width * height * _DISK_BYTES_PER_PIXEL[codec_name] * 2)   # segments + the final file
    folder = os.path.dirname(work_dir_for(out_path)) or "."
    free = shutil.disk_usage(folder).free
    if free < need:
        raise VideoFileError(f"not enough disk space in {folder!r} for the work folder and the output: about "
                             f"{need / 2**30:.1f} GiB needed, {free / 2**30:.1f} GiB free. Fix: free space, write "
                             "the output to another disk, or choose h264/h265 (smaller files).")


def upscale_video(in_path: str, out_path: str, upscale_chunk: Callable[[np.ndarray], np.ndarray],
                  out_size: Callable[[int, int], tuple[int, int]], settings: Optional[StreamSettings] = None,
                  model_key: str = "", progress: Optional[Callable[[int, int, float, float], None]] = None,
                  should_stop: Optional[Callable[[], None]] = None) -> StreamResult:
    """Upscales ``in_path`` into ``out_path``. ``out_size(h, w) -> (oh, ow)`` is the output size for the input's
    stored size; ``model_key`` names the model and its settings (a different one does not resume old chunks).
    ``progress(frames_done, frames_total, fps, seconds_left)`` after each chunk; ``should_stop()`` raises to stop
    (the work folder keeps the finished chunks; the output is not touched)."""
    s = settings or StreamSettings()
    s.validate()
    info = probe(in_path)
    check_paths(in_path, out_path, s.codec)
    codec = get_codec(s.codec)
    oh, ow = out_size(info.height, info.width)
    check_disk(out_path, info.frames, ow, oh, codec.name)
    key = {"input": info.fingerprint(), "batch_size": s.batch_size, "overlap": s.overlap, "codec": codec.name,
           "scene_threshold": s.scene_threshold, "size": [oh, ow], "model": model_key}
    work = WorkDir(out_path, key).open(s.resume)
    color = output_color(info)
    ext = "" if codec.sequence() else (".mov" if codec.segment_format == "mov" else ".nut")
    t0, done_frames, resumed = time.perf_counter(), 0, len(work.chunks)
    if resumed:
        log.info("[SeedVR2-BW] resuming %s: %d chunk(s) done (%s)", out_path, resumed, work.path)
    detector = CutDetector(s.scene_threshold)
    o = s.overlap

    buf: list[np.ndarray] = []      # frames of the chunk being collected
    start = 0                       # its first frame index
    has_prev = False                # a chunk of the same shot came before (its tail is in ``tail``)
    tail: Optional[np.ndarray] = None
    index = 0
    pending: Optional[np.ndarray] = None   # a decoded frame that starts the next chunk (after a cut)
    pending_cut = False

    def run_chunk(frames: list[np.ndarray], has_next: bool) -> None:
        nonlocal tail, has_prev, index, done_frames, start
        n = len(frames)
        o_head = o if has_prev else 0
        o_tail = o if has_next else 0
        seg_name = work.segment_name(index, ext)
        entry = work.done(index)
        if entry is not None:   # finished before a restart: its tail is on disk
            if (entry["start"], entry["end"]) != (start, start + n):
                raise RuntimeError(f"the work folder's chunk {index} was {entry['start']}-{entry['end']}, this run "
                                   f"planned {start}-{start + n}: delete {work.path} and run again")
            # only the last finished chunk's overlap is kept (and needed: the next chunk is the first to run)
            tail = work.tail(index) if o_tail and index == len(work.chunks) - 1 else None
        else:
            if should_stop is not None:
                should_stop()
            up = np.asarray(upscale_chunk(np.stack(frames)), dtype=np.float32)
            if up.shape != (n, oh, ow, 3):
                raise RuntimeError(f"the upscaler returned {up.shape} for {n} frames of {oh}x{ow}")
            if o_head:
                up[:o_head] = tail + up[:o_head] * ramp(o_head)
            new_tail = up[n - o_tail:] * (1.0 - ramp(o_tail)) if o_tail else None
            body = np.clip(up[:n - o_tail], 0.0, 1.0)
            final = os.path.join(work.path, seg_name)
            if codec.sequence():
                tmpdir = work.temp_path(seg_name)
                shutil.rmtree(tmpdir, ignore_errors=True)
                write_png_frames(tmpdir, start, body)
                os.replace(tmpdir, final)
            else:
                tmp = work.temp_path(seg_name) + ext
                w = SegmentWriter(tmp, codec, ow, oh, info.fps, color)
                w.write(body)
                w.close()
                os.replace(tmp, final)
            work.commit_chunk(index, start, start + n, start + n - o_tail, seg_name, new_tail)
            tail = new_tail
        done_frames = start + n - o_tail
        el = time.perf_counter() - t0
        fresh = done_frames - (work.chunks[resumed - 1]["written_end"] if resumed else 0)
        rate = fresh / el if el > 0 and fresh > 0 else 0.0
        left = (info.frames - done_frames) / rate if rate > 0 else float("nan")
        if progress is not None:
            progress(done_frames, info.frames, rate, left)
        index += 1
        has_prev = has_next
        start = start + n - o_tail

    frames_iter = read_frames(in_path)
    total = 0
    for frame in frames_iter:
        cut = detector.is_cut(frame)
        total += 1
        if buf and cut:
            run_chunk(buf, has_next=False)       # the shot ends here
            buf, has_prev, tail = [], False, None
        elif len(buf) == s.batch_size:
            run_chunk(buf, has_next=True)        # more frames of this shot follow
            buf = buf[len(buf) - o:] if o else []
        buf.append(frame)
    if buf:
        run_chunk(buf, has_next=False)
    if total != info.frames:
        log.warning("[SeedVR2-BW] %s: decoded %d frames, the container counted %d", in_path, total, info.frames)

    if codec.sequence():
        _finish_sequence(work, out_path, in_path if info.has_audio else None)
    else:
        concat_segments(work.segments(), out_path, codec, info.fps, info.rotation,
                        in_path if info.has_audio else None, color)
    if not s.keep_work:
        work.remove()
    res = StreamResult(out_path, total, index, resumed, time.perf_counter() - t0)
    log.info("[SeedVR2-BW] %s: %d frames in %d chunk(s) (%d resumed), %.2f frames/s", out_path, res.frames,
             res.chunks, resumed, res.fps)
    return res


def _finish_sequence(work: WorkDir, out_dir: str, audio_from: Optional[str]) -> None:
    """PNG frames of every segment folder into ``out_dir`` (built under a temporary name, then renamed); the audio
    stream, if any, beside them as audio.m4a / audio.mka."""
    tmp = out_dir.rstrip("/\\") + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for seg in work.segments():
        for name in sorted(os.listdir(seg)):
            os.replace(os.path.join(seg, name), os.path.join(tmp, name))
    if audio_from is not None:
        # the source's container family keeps its audio timing (MP4 edit lists trim AAC's priming samples)
        mp4 = os.path.splitext(audio_from)[1].lower() in (".mp4", ".m4v", ".mov")
        copy_audio(audio_from, os.path.join(tmp, "audio.m4a" if mp4 else "audio.mka"))
    if os.path.isdir(out_dir):
        raise VideoFileError(f"the output folder {out_dir!r} already exists. Fix: remove it or choose another name.")
    os.replace(tmp, out_dir)


__all__ = ["StreamSettings", "StreamResult", "upscale_video", "check_paths", "CODECS", "ramp"]
