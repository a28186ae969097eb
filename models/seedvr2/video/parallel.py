"""Chunk-parallel streaming upscale on torch.distributed: every process (one per GPU, or CPU processes over gloo)
runs its own model copy and takes the next chunk from a counter in the process group's store as soon as it is
free, so a faster GPU takes more chunks. Each chunk's units go into the shared work folder (``stream.Job``); a
seam is written once, by whichever process claims it first once both of its chunks are done; rank 0 writes the
output when all ranks are through. The output equals the single-process one: every unit depends on its chunk
alone.

Rank 0 probes and plans and hands the plan to the others through the store (no tensors travel: frames are decoded
by each process from the input file, forward only, seeking to the keyframe before its next chunk with the frame
times the planning pass recorded).
"""
from __future__ import annotations

import logging
import pickle
import time
from collections import Counter
from typing import Callable, Optional

import numpy as np
import torch.distributed as dist

from .stream import FrameCursor, Job, StreamResult, StreamSettings

log = logging.getLogger(__name__)


def upscale_video_distributed(store: dist.Store, in_path: str, out_path: str,
                              upscale_chunk: Callable[[np.ndarray], np.ndarray],
                              out_size: Callable[[int, int], tuple[int, int]],
                              settings: Optional[StreamSettings] = None, model_key: str = "",
                              progress: Optional[Callable[[int, int, float, float], None]] = None,
                              run_id: str = "job", timings: Optional[Counter] = None) -> Optional[StreamResult]:
    """Call on every rank of an initialised default process group; ``store``: a store every rank shares (the one
    the group was made with, or one of its own). Returns the result on rank 0, None elsewhere. ``run_id`` separates
    the store keys of successive jobs. ``progress(frames_done, total, fps, seconds_left)`` is called on a rank after
    each chunk it ran, with the frames done by all ranks (pass it on one rank for one bar). ``timings``, if given,
    gets this rank's seconds per part (plan: probing and planning, or waiting for rank 0's plan; read: decoding input
    frames; chunks: the model and the units' floats; seams; encoder: waiting for the encoder thread; others: waiting
    for the other ranks at the end; finish: rank 0's output file); the same figures go to the log, one line per
    rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    s = settings or StreamSettings()
    t0 = time.perf_counter()
    key = f"seedvr2bw/{run_id}"
    t = timings if timings is not None else Counter()
    if rank == 0:
        try:
            job = Job(in_path, out_path, out_size, s, model_key)
            todo = [c.index for c in job.chunks if not job.chunk_done(c)]
            store.set(f"{key}/plan", pickle.dumps((job.info, job.chunks, job.stamps, todo, None)))
        except BaseException as exc:   # the others must not wait for a plan that never comes
            store.set(f"{key}/plan", pickle.dumps((None, None, None, None, f"{type(exc).__name__}: {exc}")))
            raise
    else:
        info, chunks, stamps, todo, err = pickle.loads(store.get(f"{key}/plan"))
        if err is not None:
            raise RuntimeError(f"rank 0 could not start the job: {err}")
        job = Job(in_path, out_path, out_size, s, model_key, info=info, chunks=chunks, open_work=False,
                  stamps=stamps)
    info = job.info
    resumed = len(job.chunks) - len(todo)
    cursor = FrameCursor(in_path, s.overlap, job.stamps)   # a rank seeks past the chunks others took
    t["plan"] += time.perf_counter() - t0
    mine = 0
    # as in the single-process path, units are encoded on a thread while the next chunk runs on the model
    with job.encoding_in_background():
        while True:
            i = store.add(f"{key}/next", 1) - 1
            if i >= len(todo):
                break
            c = job.chunks[todo[i]]
            t_read, w_read = time.perf_counter(), job.waited
            frames = cursor.take(c.start, c.end)
            t_run = time.perf_counter()
            job.run_chunk(c, frames, upscale_chunk)
            t_seams, w_run = time.perf_counter(), job.waited
            mine += 1
            done = store.add(f"{key}/frames", c.end - c.start - c.tail)
            for k in job.seams_ready():
                if store.add(f"{key}/seam/{k}", 1) == 1:
                    job.write_seam(k)
            t_end = time.perf_counter()
            t["read"] += t_run - t_read
            t["chunks"] += t_seams - t_run - (w_run - w_read)
            t["seams"] += t_end - t_seams - (job.waited - w_run)
            t["encoder"] += job.waited - w_read
            if progress is not None:   # any rank that ran a chunk: a rank may take none
                el = time.perf_counter() - t0
                rate = done / el if el > 0 else 0.0
                progress(done, info.frames, rate, (info.frames - done) / rate if rate > 0 else float("nan"))
        t_drain = time.perf_counter()
        job.drain()
    t_wait = time.perf_counter()
    t["encoder"] += t_wait - t_drain
    dist.barrier()
    t_finish = time.perf_counter()
    t["others"] += t_finish - t_wait
    if rank == 0:
        for k in job.seams_ready():
            job.write_seam(k)
        job.finish()
        t["finish"] += time.perf_counter() - t_finish
    log.info("[SeedVR2-BW] rank %d of %d: %d chunk(s); %s", rank, world, mine,
             ", ".join(f"{k} {v:.2f} s" for k, v in t.items()))
    if rank != 0:
        return None
    frames = sum(c.end - c.start - c.tail for c in job.chunks)
    return StreamResult(out_path, frames, len(job.chunks), resumed, time.perf_counter() - t0)
