"""Streaming upscale of a video file: plan (scene-aware, overlapped chunks) -> upscale each chunk -> encode its
frames as they finish -> one output file, with host memory bounded by one chunk whatever the video's length, a
resumable work folder, and the final file written only when every frame is there.

Chunks follow the in-memory pipeline's plan inside each shot: ``batch_size`` frames, consecutive chunks sharing
``overlap`` frames, the later chunk's weight rising as (j + 1) / (overlap + 1) over the shared frames and the earlier
one's falling so that they sum to 1. A scene cut ends a chunk early; no chunk and no cross-fade spans it, so the
frames of each shot are those of the shot upscaled alone.

Besides the model, three threads: a reader decodes the next chunk's frames while the model runs the current one
(``ChunkReader``), an encoder encodes the finished units, and a writer remuxes into the output every unit whose
predecessors are all there as soon as it lands (``Job.writing_output``), so that at the end only the last units, the
audio and the rename remain.

A chunk writes three units into the work folder: its *body* (frames no other chunk has, encoded), and its weighted
*head* / *tail* overlap frames (float32 arrays). The *seam* between two chunks (the sum of one's tail and the next
one's head) is encoded once both exist. Every unit depends on its chunk alone, so chunks can run in any order and
on several workers (``parallel.py``); the output is the units remuxed in frame order, as they become available.

The model is injected: ``upscale_chunk(frames)`` maps (n, H, W, 3) float32 in [0, 1] to (n, oh, ow, 3).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Optional

import numpy as np
import torch

from ..pipeline import blend_ramp, plan_chunks
from .container import (BT709, ConcatWriter, FrameStamps, SeekMismatch, SegmentWriter, VideoFileError, VideoInfo,
                        copy_audio, get_codec, host_floats, probe, read_frames, to_pixels, write_png_frames)
from .scenes import DEFAULT_THRESHOLD, CutDetector
from .workdir import WorkDir, work_dir_for

log = logging.getLogger(__name__)

SEEK_MIN_FRAMES = 48   # frames a reader would skip before it seeks instead of decoding through
MAX_QUEUED_UNITS = 2   # units queued for the encoder threads: a chunk's body and the seam before it
# Two units are encoded at once (a body beside a seam: the wait for the last ones after a process's last chunk is
# the longer of them, not their sum) where frames are at most 1080p; larger ones keep one encoder (one x264 holds
# about 12 bytes an output pixel per thread: 200 MB at 720p, 1.8 GB at 4K)
TWO_ENCODERS_MAX_PIXELS = 1920 * 1088
REMUX_POLL_S = 0.1     # how often the writer looks for units other processes wrote (its own wake it at once)
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
        most = (self.batch_size - 1) // 2   # a frame is shared by at most two chunks
        if not 0 <= self.overlap <= most:
            raise VideoFileError(f"overlap must be between 0 and (batch_size - 1) / 2 = {most} for batch_size "
                                 f"{self.batch_size}, got {self.overlap}.")


@dataclasses.dataclass(frozen=True)
class Chunk:
    index: int
    start: int
    end: int
    head: int    # frames shared with the previous chunk (0: it starts a shot)
    tail: int    # frames shared with the next chunk (0: it ends a shot)

    @property
    def body(self) -> tuple[int, int]:
        return self.start + self.head, self.end - self.tail


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
    """The pipeline's cross-fade weights of the later chunk over an overlap of ``o`` frames, shaped for frames."""
    return blend_ramp(o).numpy().reshape(-1, 1, 1, 1)


def plan(frames: Iterable[np.ndarray], batch_size: int, overlap: int,
         scene_threshold: float = DEFAULT_THRESHOLD) -> list[Chunk]:
    """The chunks of a video, from one pass over its frames (only the scene detector looks at them): the
    pipeline's chunk plan inside each shot."""
    cuts = CutDetector(scene_threshold)
    shots, n = [], 0
    for frame in frames:
        if cuts.is_cut(frame):
            shots.append(n)
        n += 1
    bounds = [0] + shots + [n]
    chunks = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        ranges = plan_chunks(b - a, batch_size, overlap)
        for i, (s, e) in enumerate(ranges):
            chunks.append(Chunk(len(chunks), a + s, a + e, overlap if i else 0,
                                overlap if i + 1 < len(ranges) else 0))
    return chunks


def output_color(info: VideoInfo) -> dict:
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
    elif codec.name == "ffv1" and ext != ".mkv":
        raise VideoFileError(f"FFV1 goes into a .mkv file, not {ext}. Fix: name the output *.mkv.")
    elif codec.name == "prores" and ext not in (".mov", ".mkv"):
        raise VideoFileError(f"ProRes goes into a .mov (or .mkv) file, not {ext}. Fix: name the output *.mov.")


def check_disk(out_path: str, frames: int, width: int, height: int, codec_name: str) -> None:
    need = int(frames * width * height * _DISK_BYTES_PER_PIXEL[codec_name] * 2)   # units + the final file
    folder = os.path.dirname(work_dir_for(out_path)) or "."
    free = shutil.disk_usage(folder).free
    if free < need:
        raise VideoFileError(f"not enough disk space in {folder!r} for the work folder and the output: about "
                             f"{need / 2**30:.1f} GiB needed, {free / 2**30:.1f} GiB free. Fix: free space, write "
                             "the output to another disk, or choose h264/h265 (smaller files).")


def job_key(info: VideoInfo, settings: StreamSettings, size: tuple[int, int], model_key: str) -> dict:
    """Everything a job's output depends on: a work folder with another key is not resumed."""
    return {"input": info.fingerprint(), "batch_size": settings.batch_size, "overlap": settings.overlap,
            "codec": get_codec(settings.codec).name, "scene_threshold": settings.scene_threshold,
            "size": [int(size[0]), int(size[1])], "model": model_key}


class FrameCursor:
    """Frames of one file by index ranges that only move forward (a worker's chunks come in increasing order);
    keeps the frames the next range may share with the last one. With the file's ``stamps`` (from the planning
    pass) a range far ahead is reached by seeking to the keyframe before it, not by decoding every frame between;
    a seek whose frames do not match the stamps falls back to decoding from the start (``seeks`` counts those that
    held)."""

    def __init__(self, path: str, keep: int, stamps: Optional[FrameStamps] = None):
        self.path, self.keep = path, keep
        self.stamps = stamps if stamps is not None and stamps.seekable() else None
        self.it = iter(read_frames(path))
        self.pos = 0                  # index of the next frame the decoder gives
        self.cache: dict[int, np.ndarray] = {}
        self.seeks = 0

    def _skip_to(self, start: int) -> None:
        if self.stamps is None:
            return
        k = self.stamps.key_before(start)
        if k - self.pos >= SEEK_MIN_FRAMES:   # a shorter skip decodes through (a seek restarts the decoder)
            self.it = iter(read_frames(self.path, start=k, seek=(k, self.stamps)))
            self.pos = k
            self.seeks += 1

    def _next(self) -> np.ndarray:
        try:
            return next(self.it)
        except SeekMismatch as exc:
            log.info("[SeedVR2-BW] %s; decoding from the first frame instead", exc)
            self.stamps = None
            self.seeks -= 1
            self.it = iter(read_frames(self.path, start=self.pos))
            return next(self.it)

    def take(self, start: int, end: int) -> np.ndarray:
        for i in [i for i in self.cache if i < start]:
            del self.cache[i]
        if start > self.pos:
            self._skip_to(start)
        while self.pos < end:
            f = self._next()
            if self.pos >= start:
                self.cache[self.pos] = f
            self.pos += 1
        out = np.stack([self.cache[i] for i in range(start, end)])
        for i in [i for i in self.cache if i < end - self.keep]:
            del self.cache[i]
        return out


class ChunkReader:
    """A ``FrameCursor`` on a thread of its own, used as a context manager: ``prefetch(start, end)`` starts decoding a
    range while the caller runs the model on the previous one, ``take(start, end)`` returns the frames of a range
    (waiting for its prefetch, or decoding it now if none was asked). At most one range is prefetched, so the host
    holds the input frames of two chunks at most; ranges only move forward, as the cursor's do. An error of the
    decoding thread is raised by the ``take`` of its range."""

    def __init__(self, path: str, keep: int, stamps: Optional[FrameStamps] = None):
        self.cursor = FrameCursor(path, keep, stamps)
        self.thread: Optional[ThreadPoolExecutor] = None
        self.ahead: Optional[tuple[int, int, Future]] = None

    def __enter__(self) -> "ChunkReader":
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="seedvr2bw-read")
        return self

    def __exit__(self, *exc) -> None:
        # a range being decoded when a stop or an error came is finished first: no thread touches the file after
        self.thread.shutdown(wait=True, cancel_futures=True)
        self.thread, self.ahead = None, None

    def prefetch(self, start: int, end: int) -> None:
        if self.ahead is not None:
            raise RuntimeError(f"frames {self.ahead[0]}-{self.ahead[1]} are prefetched and not taken yet")
        self.ahead = (start, end, self.thread.submit(self.cursor.take, start, end))

    def take(self, start: int, end: int) -> np.ndarray:
        if self.ahead is None:
            self.prefetch(start, end)
        a, b, frames = self.ahead
        if (a, b) != (start, end):
            raise RuntimeError(f"frames {start}-{end} asked for while {a}-{b} are prefetched")
        self.ahead = None
        return frames.result()


class Job:
    """One streaming upscale: its input, plan, codec and work folder. ``run_chunk`` and ``write_seam`` are the
    units of work a worker (this process or another) does. The process that opens the work folder (the only one, or
    rank 0) writes the output: inside ``writing_output`` every unit goes in as soon as it and those before it exist,
    and ``finish`` adds the rest."""

    def __init__(self, in_path: str, out_path: str, out_size: Callable[[int, int], tuple[int, int]],
                 settings: StreamSettings, model_key: str = "", info: Optional[VideoInfo] = None,
                 chunks: Optional[list[Chunk]] = None, open_work: bool = True,
                 stamps: Optional[FrameStamps] = None):
        settings.validate()
        self.s = settings
        self.info = info or probe(in_path)
        check_paths(in_path, out_path, settings.codec)
        self.codec = get_codec(settings.codec)
        self.in_path, self.out_path = in_path, out_path
        self.oh, self.ow = out_size(self.info.height, self.info.width)
        check_disk(out_path, self.info.frames, self.ow, self.oh, self.codec.name)
        self.key = job_key(self.info, settings, (self.oh, self.ow), model_key)
        self.work = WorkDir(out_path, self.key)
        if open_work:
            self.work.open(settings.resume)
        self.color = output_color(self.info)
        self.ext = "" if self.codec.sequence() else (".mov" if self.codec.segment_format == "mov" else ".nut")
        small = (128, max(2, 2 * round(64 * self.info.height / max(1, self.info.width))))   # enough for 8 x 8 cells
        # the planning pass also records each frame's time and keyframe flag, so readers can seek (FrameCursor)
        self.stamps = stamps if stamps is not None else FrameStamps()
        self.chunks = chunks if chunks is not None else plan(read_frames(in_path, size=small, stamps=self.stamps),
                                                              settings.batch_size, settings.overlap,
                                                              settings.scene_threshold)
        self.encoder: Optional[ThreadPoolExecutor] = None   # while encoding_in_background
        self.encoders = 2 if self.ow * self.oh <= TWO_ENCODERS_MAX_PIXELS else 1   # units encoded at once
        self.pending: deque[Future] = deque()
        self.waited = 0.0   # seconds the caller waited for a free place in the encoder's queue
        self.seams_started: set[int] = set()   # seams queued in this process (their files may not exist yet)
        self.writes_output = open_work   # the other ranks of a chunk-parallel job only write units
        self.order = self.units_in_order()
        self.output = None   # a ConcatWriter or _SequenceWriter, from the first unit remuxed until finish
        self.remuxed = 0     # units of ``order`` in the output so far
        self.landed = threading.Event()   # set when this process has written a unit
        self.writer: Optional[tuple[threading.Event, ThreadPoolExecutor, Future]] = None   # while writing_output

    @contextlib.contextmanager
    def encoding_in_background(self):
        """Units are encoded on threads (``encoders``) while the caller runs the next chunk; on leaving, the threads
        finish what they hold (a unit being encoded when a stop or an error came still lands whole)."""
        self.encoder = ThreadPoolExecutor(max_workers=self.encoders, thread_name_prefix="seedvr2bw-encode")
        try:
            yield
        finally:
            self.encoder.shutdown(wait=True)
            self.encoder = None

    @contextlib.contextmanager
    def writing_output(self, poll_s: float = REMUX_POLL_S):
        """Around a run and its ``finish``, in the process that writes the output: a writer thread remuxes the units
        into it as they land (woken by each unit this process writes, looking every ``poll_s`` for those of the
        other ranks). Leaving without ``finish`` (a stop, an error) removes the partial output, so the final name
        never holds one and a rerun writes the output again from the first unit."""
        if self.writes_output:
            stop = threading.Event()
            thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="seedvr2bw-write")
            self.writer = (stop, thread, thread.submit(self._write_landed, stop, poll_s))
        try:
            yield
        finally:
            self._stop_writer()
            if self.output is not None:
                out, self.output, self.remuxed = self.output, None, 0
                out.abort()

    def _write_landed(self, stop: threading.Event, poll_s: float) -> None:
        while not stop.is_set():
            self.landed.clear()   # before looking: a unit landing meanwhile wakes the next round
            self.remux_ready()
            self.landed.wait(poll_s)

    def _stop_writer(self) -> Optional[Future]:
        """Stops the writer thread, if one runs, once it is through its current unit; returns its future."""
        if self.writer is None:
            return None
        stop, thread, done = self.writer
        self.writer = None
        stop.set()
        self.landed.set()
        thread.shutdown(wait=True)
        return done

    # ------------------------------------------------------------------ units
    def chunk_done(self, c: Chunk) -> bool:
        w = self.work
        return w.has(self.body_name(c)) and (not c.head or w.has(f"head_{c.index:06d}.npy")
                                             or w.has(self.seam_name(c.index - 1))) \
            and (not c.tail or w.has(f"tail_{c.index:06d}.npy") or w.has(self.seam_name(c.index)))

    def body_name(self, c: Chunk) -> str:
        return f"body_{c.index:06d}{self.ext}"

    def seam_name(self, index: int) -> str:
        return f"seam_{index:06d}{self.ext}"

    def _encode(self, name: str, first: int, frames: np.ndarray, then_delete: tuple = ()) -> None:
        """Encodes a unit; in the background when the job has an encoder thread (the next chunk's GPU work then
        overlaps it; at most ``MAX_QUEUED_UNITS`` queued, so host memory stays bounded by a few chunks)."""
        # pixels here, in the caller's thread: the queue then holds integers (a quarter of the floats' bytes) and
        # the encoder thread allocates little (its own malloc arena would otherwise grow the process's RSS)
        self._queue(name, first, self._pixels(frames), then_delete)

    def _pixels(self, frames: np.ndarray) -> np.ndarray:
        return to_pixels(frames, 16 if self.codec.sequence() else self.codec.bits)

    def _queue(self, name: str, first: int, frames: np.ndarray, then_delete: tuple = ()) -> None:
        if self.encoder is None:
            self._encode_now(name, first, frames, then_delete)
            return
        t0 = time.perf_counter()
        while len(self.pending) >= MAX_QUEUED_UNITS:   # bounded: a chunk's body and the seam before it
            self.pending.popleft().result()
        self.waited += time.perf_counter() - t0
        self.pending.append(self.encoder.submit(self._encode_now, name, first, frames, then_delete))

    def drain(self) -> None:
        """Waits for the units being encoded in the background (and raises the first error, if any)."""
        while self.pending:
            self.pending.popleft().result()

    def _encode_now(self, name: str, first: int, frames: np.ndarray, then_delete: tuple = ()) -> None:
        """Writes the unit under a temporary name and renames it; only then are ``then_delete`` (the arrays it was
        made from) removed, so a killed process never loses both."""
        final = self.work.file(name)
        tmp = self.work.temp_path(name)
        if self.codec.sequence():
            shutil.rmtree(tmp, ignore_errors=True)
            write_png_frames(tmp, first, frames)
        else:   # the container format is given explicitly, so the temporary name can end in .partial
            w = SegmentWriter(tmp, self.codec, self.ow, self.oh, self.info.fps, self.color)
            w.write(frames)
            w.close()
        os.replace(tmp, final)
        self.work.delete(*then_delete)
        self.landed.set()

    def run_chunk(self, c: Chunk, frames: np.ndarray, upscale_chunk: Callable[[np.ndarray], np.ndarray]) -> None:
        """Upscales one chunk and writes its units (body, weighted head and tail). ``upscale_chunk`` may return a
        torch tensor on its device (a GPU output then reaches the host as the body's pixels and the overlaps'
        floats only)."""
        n = c.end - c.start
        up = upscale_chunk(frames)
        if not isinstance(up, torch.Tensor):
            up = np.asarray(up, dtype=np.float32)
        if tuple(up.shape) != (n, self.oh, self.ow, 3):
            raise RuntimeError(f"the upscaler returned {tuple(up.shape)} for {n} frames of {self.oh}x{self.ow}")
        if c.head:
            self.work.save_array(f"head_{c.index:06d}.npy", host_floats(up[:c.head]) * ramp(c.head))
        if c.tail:
            self.work.save_array(f"tail_{c.index:06d}.npy", host_floats(up[n - c.tail:]) * (1.0 - ramp(c.tail)))
        b0, b1 = c.body
        body = self._pixels(up[b0 - c.start:b1 - c.start])
        del up   # the chunk's floats go before its encoder starts: x264's frames then never sit beside them
        self._queue(self.body_name(c), b0, body)

    def seams_ready(self) -> list[int]:
        """Chunks k whose tail and the next chunk's head are written but their seam is not."""
        w = self.work
        return [c.index for c in self.chunks[:-1] if c.tail and c.index not in self.seams_started
                and not w.has(self.seam_name(c.index))
                and w.has(f"tail_{c.index:06d}.npy") and w.has(f"head_{c.index + 1:06d}.npy")]

    def write_seam(self, k: int) -> None:
        """Frames shared by chunks k and k + 1: the earlier one's weighted tail plus the later one's weighted head
        (the in-memory pipeline's sum, in the same order)."""
        self.seams_started.add(k)
        c = self.chunks[k]
        tail, head = self.work.load_array(f"tail_{k:06d}.npy"), self.work.load_array(f"head_{k + 1:06d}.npy")
        self._encode(self.seam_name(k), c.end - c.tail, np.add(tail, head, out=tail),
                     then_delete=(f"tail_{k:06d}.npy", f"head_{k + 1:06d}.npy"))

    def units_in_order(self) -> list[str]:
        names = []
        for c in self.chunks:
            names.append(self.body_name(c))
            if c.tail:
                names.append(self.seam_name(c.index))
        return names

    def remux_ready(self) -> None:
        """Appends to the output, in frame order, every unit whose predecessors are all in it (units another rank
        wrote included: a unit's file exists only once whole). Runs on the writer thread, or in ``finish`` once
        that has stopped."""
        while self.remuxed < len(self.order) and self.work.has(self.order[self.remuxed]):
            if self.output is None:
                audio = self.in_path if self.info.has_audio else None
                self.output = _SequenceWriter(self.out_path, audio) if self.codec.sequence() else \
                    ConcatWriter(self.out_path, self.codec, self.info.fps, self.info.rotation, audio, self.color)
            self.output.append(self.work.file(self.order[self.remuxed]))
            self.remuxed += 1

    def finish(self) -> None:
        """Remuxes the units not in the output yet (with the source's audio) and renames it to its final name, then
        drops the work folder unless asked to keep it."""
        self.drain()
        writer = self._stop_writer()
        if writer is not None:
            writer.result()   # its error, if it had one
        missing = [n for n in self.order if not self.work.has(n)]
        if missing:
            raise RuntimeError(f"cannot write {self.out_path}: {len(missing)} part(s) missing, e.g. {missing[0]}")
        self.remux_ready()
        out, self.output = self.output, None
        out.close()
        if not self.s.keep_work:
            self.work.remove()


def upscale_video(in_path: str, out_path: str, upscale_chunk: Callable[[np.ndarray], np.ndarray],
                  out_size: Callable[[int, int], tuple[int, int]], settings: Optional[StreamSettings] = None,
                  model_key: str = "", progress: Optional[Callable[[int, int, float, float], None]] = None,
                  should_stop: Optional[Callable[[], None]] = None) -> StreamResult:
    """Upscales ``in_path`` into ``out_path`` in this process. ``out_size(h, w) -> (oh, ow)`` is the output size for
    the input's stored size; ``model_key`` names the model and its settings (a different one does not resume old
    chunks). ``progress(frames_done, frames_total, fps, seconds_left)`` after each chunk; ``should_stop()`` raises
    to stop (the work folder keeps the finished chunks; the output is not touched)."""
    t0 = time.perf_counter()
    job = Job(in_path, out_path, out_size, settings or StreamSettings(), model_key)
    todo = [c for c in job.chunks if not job.chunk_done(c)]
    resumed = len(job.chunks) - len(todo)
    if resumed:
        log.info("[SeedVR2-BW] resuming %s: %d of %d chunk(s) done (%s)", out_path, resumed, len(job.chunks),
                 job.work.path)
    total = job.info.frames
    done = sum(c.end - c.start - c.tail for c in job.chunks if c not in todo)
    t_run, fresh = time.perf_counter(), 0
    with job.writing_output():
        with ChunkReader(in_path, job.s.overlap, job.stamps) as reader, job.encoding_in_background():
            for n, c in enumerate(todo):
                if should_stop is not None:
                    should_stop()
                frames = reader.take(c.start, c.end)
                if n + 1 < len(todo):   # the next chunk's frames are decoded while this one runs on the model
                    reader.prefetch(todo[n + 1].start, todo[n + 1].end)
                job.run_chunk(c, frames, upscale_chunk)
                for k in job.seams_ready():
                    job.write_seam(k)
                fresh += c.end - c.start - c.tail
                done += c.end - c.start - c.tail
                if progress is not None:
                    el = time.perf_counter() - t_run
                    rate = fresh / el if el > 0 else 0.0
                    progress(done, total, rate, (total - done) / rate if rate > 0 else float("nan"))
            job.drain()
        for k in job.seams_ready():
            job.write_seam(k)
        job.finish()
    res = StreamResult(out_path, sum(c.end - c.start - c.tail for c in job.chunks), len(job.chunks), resumed,
                       time.perf_counter() - t0)
    log.info("[SeedVR2-BW] %s: %d frames in %d chunk(s) (%d resumed), %.2f frames/s", out_path, res.frames,
             res.chunks, resumed, res.fps)
    return res


class _SequenceWriter:
    """The PNG frames of each appended unit folder copied into ``out_dir``, built under a temporary name that
    ``close`` renames (with the audio stream, if any, beside the frames as audio.m4a / audio.mka)."""

    def __init__(self, out_dir: str, audio_from: Optional[str]):
        self.out_dir, self.audio_from = out_dir, audio_from
        self.tmp = out_dir.rstrip("/\\") + ".partial"
        shutil.rmtree(self.tmp, ignore_errors=True)
        os.makedirs(self.tmp)

    def append(self, folder: str) -> None:
        for name in sorted(os.listdir(folder)):
            shutil.copy2(os.path.join(folder, name), os.path.join(self.tmp, name))

    def close(self) -> None:
        try:
            if os.path.isdir(self.out_dir):
                raise VideoFileError(f"the output folder {self.out_dir!r} already exists. Fix: remove it or choose "
                                     "another name.")
            if self.audio_from is not None:
                # the source's container family keeps its audio timing (MP4 edit lists trim AAC's priming samples)
                mp4 = os.path.splitext(self.audio_from)[1].lower() in (".mp4", ".m4v", ".mov")
                copy_audio(self.audio_from, os.path.join(self.tmp, "audio.m4a" if mp4 else "audio.mka"))
            os.replace(self.tmp, self.out_dir)
        finally:
            self.abort()

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
