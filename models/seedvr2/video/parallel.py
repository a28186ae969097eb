"""Chunk-parallel streaming upscale on torch.distributed: every process (one per GPU, or CPU processes over gloo)
runs its own model copy and takes the next chunk from a counter in the process group's store as soon as it is
free, so a faster GPU takes more chunks. While many chunks are unclaimed a process claims its next chunk as it
starts one, and decodes the next one's frames while the model runs (near the end it claims only when free, so the
fastest take the last ones). Each chunk's units go into the shared work folder (``stream.Job``); a seam is written
once, by whichever process claims it first once both of its chunks are done; rank 0 remuxes the units into the
output on a thread as they land and closes it when all ranks are through. The output equals the single-process
one: every unit depends on its chunk alone.

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

from .stream import ChunkReader, Job, StreamResult, StreamSettings

log = logging.getLogger(__name__)


class ChunkClaims:
    """Indices 0 .. total - 1 handed out from a counter in a store every rank shares: each goes to one rank, and
    the indices one rank gets only increase (its frames are read forward). ``claim_ahead`` lets a rank claim its
    next index while it starts the current one, but only while more than ``ahead_while`` are unclaimed; after that
    a rank claims when it is free, so the balance at the end is as if no rank claimed ahead."""

    def __init__(self, store: dist.Store, key: str, total: int, ahead_while: int):
        self.store, self.key, self.total, self.ahead_while = store, key, total, ahead_while

    def claim(self) -> Optional[int]:
        """The next unclaimed index, or None when all are claimed."""
        i = self.store.add(self.key, 1) - 1
        return i if i < self.total else None

    def claim_ahead(self) -> Optional[int]:
        """``claim()`` while more than ``ahead_while`` indices are unclaimed, else None (claim when free)."""
        if self.total - self.store.add(self.key, 0) <= self.ahead_while:
            return None
        return self.claim()


def _unfit(store: dist.Store, key: str, rank: int, world: int, fits, job: Job, todo: list[int]) -> Optional[str]:
    """Why this rank's device cannot run the job's longest chunk (``fits``), or None. Each rank posts its answer; a
    rank that cannot waits for the others' and raises when none can (a rank that can goes on at once)."""
    why = None
    if fits is not None and todo:
        longest = max(job.chunks[i].end - job.chunks[i].start for i in todo)
        why = fits(longest, job.info.height, job.info.width)
    store.set(f"{key}/fit/{rank}", why or "")
    if why:
        others = [store.get(f"{key}/fit/{r}").decode() for r in range(world)]
        if all(others):
            raise RuntimeError("no worker can run this job: " + "; ".join(others))
        log.warning("[SeedVR2-BW] rank %d of %d takes no chunk of this job: %s", rank, world, why)
    return why


def upscale_video_distributed(store: dist.Store, in_path: str, out_path: str,
                              upscale_chunk: Callable[[np.ndarray], np.ndarray],
                              out_size: Callable[[int, int], tuple[int, int]],
                              settings: Optional[StreamSettings] = None, model_key: str = "",
                              progress: Optional[Callable[[int, int, float, float], None]] = None,
                              run_id: str = "job", timings: Optional[Counter] = None,
                              fits: Optional[Callable[[int, int, int], Optional[str]]] = None
                              ) -> Optional[StreamResult]:
    """Call on every rank of an initialised default process group; ``store``: a store every rank shares (the one
    the group was made with, or one of its own). Returns the result on rank 0, None elsewhere. ``run_id`` separates
    the store keys of successive jobs. ``progress(frames_done, total, fps, seconds_left)`` is called on a rank after
    each chunk it ran, with the frames done by all ranks (pass it on one rank for one bar). ``timings``, if given,
    gets this rank's seconds per part (plan: probing and planning, or waiting for rank 0's plan; read: waiting for
    a chunk's input frames, which the reader thread decodes while the previous chunk runs when it was claimed ahead;
    chunks: the model and the units' floats; seams; encoder: waiting for the encoder thread; others: waiting for the
    other ranks at the end; finish: rank 0's output file, of which only the units not yet remuxed by its writer
    thread, the audio and the rename are left); the same figures go to the log, one line per rank. ``fits(frames,
    height, width)``, if given, says before any chunk whether this rank's device can run the job's longest chunk
    (None) or why not: such a rank takes no chunk (logged); if no rank can, every rank raises with the reasons."""
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
    # a rank claims ahead while more than two chunks per rank are unclaimed, enough for the last ones to balance (a
    # lone rank has nothing to balance)
    claims = ChunkClaims(store, f"{key}/next", len(todo), 2 * world if world > 1 else 0)
    unfit = _unfit(store, key, rank, world, fits, job, todo)
    t["plan"] += time.perf_counter() - t0
    mine = 0
    with job.writing_output():
        # as in the single-process path, frames are decoded on one thread and units encoded on another while the
        # model runs (a rank's reader seeks past the chunks others took)
        with ChunkReader(in_path, s.overlap, job.stamps) as reader, job.encoding_in_background():
            i = claims.claim() if not unfit else None
            while i is not None:
                c = job.chunks[todo[i]]
                t_read = time.perf_counter()
                frames = reader.take(c.start, c.end)
                t["read"] += time.perf_counter() - t_read
                nxt = claims.claim_ahead()
                if nxt is not None:
                    reader.prefetch(job.chunks[todo[nxt]].start, job.chunks[todo[nxt]].end)
                t_run, w_run0 = time.perf_counter(), job.waited
                job.run_chunk(c, frames, upscale_chunk)
                t_seams, w_run = time.perf_counter(), job.waited
                mine += 1
                done = store.add(f"{key}/frames", c.end - c.start - c.tail)
                for k in job.seams_ready():
                    if store.add(f"{key}/seam/{k}", 1) == 1:
                        job.write_seam(k)
                t_end = time.perf_counter()
                t["chunks"] += t_seams - t_run - (w_run - w_run0)
                t["seams"] += t_end - t_seams - (job.waited - w_run)
                t["encoder"] += job.waited - w_run0
                if progress is not None:   # any rank that ran a chunk: a rank may take none
                    el = time.perf_counter() - t0
                    rate = done / el if el > 0 else 0.0
                    progress(done, info.frames, rate, (info.frames - done) / rate if rate > 0 else float("nan"))
                i = nxt if nxt is not None else claims.claim()
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
