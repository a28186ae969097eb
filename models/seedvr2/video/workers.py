"""Persistent multi-GPU workers: one process per device, started once, its models loaded once, serving one
long-video job after another until the pool is closed: chunk parallel (``parallel.upscale_video_distributed``) or,
for a pool started with ``--parallel sequence``, every worker on every chunk (``sequence.py``).

Why: a node run inside ComfyUI cannot pay a process start and a model load per GPU on every run, and must not
re-import ComfyUI's main module in children (``multiprocessing``'s spawn does): each worker is a fresh interpreter
running ``worker_argv`` (a script that loads its models and calls ``serve``). The pool and the workers talk through
one torch.distributed ``FileStore`` in JSON (never pickles: ComfyUI imports the pack under its folder's name, the
workers under another); the workers also form a gloo process group among themselves (the pool's process is not a
rank and holds no model):

* ``job/<n>``: the n-th job (a ``PoolJob``), taken by every worker in order;
* ``<jid>/progress`` (the rank that last finished a chunk), ``<jid>/result`` (rank 0), ``<jid>/error`` (any rank), ``<jid>/stop`` (the pool,
  on cancel), ``shutdown`` (the pool, on close), ``ready/<rank>`` (a worker whose models are loaded).

A failed or cancelled job ends the pool (a rank may be waiting in a collective the others never reach); the next
run starts a new one and resumes the job from its work folder.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ....optimization.runtime import knobs
from .container import VideoFileError
from .parallel import upscale_video_distributed
from .sequence import compute_group, upscale_video_sequence
from .stream import StreamResult, StreamSettings

log = logging.getLogger(__name__)


def _dump(v) -> bytes:
    return json.dumps(v).encode()


def _load(b: bytes):
    return json.loads(b.decode())


class WorkerError(RuntimeError):
    """A worker failed (its message says which rank and why) or exited; the pool is closed."""


class JobCancelled(Exception):
    """Raised in a worker whose job the pool stopped."""


@dataclass(frozen=True)
class PoolJob:
    """One file-to-file job: ``target`` the output (height, width); ``params`` what the workers' ``make_upscaler``
    needs for this job (plain JSON values)."""
    in_path: str
    out_path: str
    target: tuple
    stream: StreamSettings
    model_key: str = ""
    params: dict = field(default_factory=dict)


PARALLEL_MODES = ("chunks", "sequence")   # whole chunks per worker, or every worker on every chunk


def devices_from_spec(spec: str) -> list[str]:
    """A ``gpus`` setting (the video nodes', the CLI's ``--gpus``) as devices: "" -> none (this process), "all" ->
    every CUDA GPU, "0,2" -> cuda:0, cuda:2 ("cpu" entries: CPU workers)."""
    spec = (spec or "").strip().lower()
    if not spec:
        return []
    n = torch.cuda.device_count()
    if spec == "all":
        if n == 0:
            raise VideoFileError("gpus 'all': this machine has no CUDA GPU. Fix: leave gpus empty.")
        return [f"cuda:{i}" for i in range(n)]
    out = []
    for tok in (t.strip() for t in spec.split(",")):
        if tok == "cpu":
            out.append("cpu")
        elif tok.isdigit() and int(tok) < n:
            out.append(f"cuda:{int(tok)}")
        else:
            raise VideoFileError(f"gpus {spec!r}: {tok!r} is not a GPU of this machine ({n} CUDA GPU(s): "
                                 f"{', '.join(map(str, range(n))) or 'none'}). Fix: list existing GPUs, 'all', or "
                                 "leave it empty.")
    return out


def _shutdown(store_path: str, procs: list, folder: str, grace_s: float) -> None:
    try:
        dist.FileStore(store_path, -1).set("shutdown", b"1")
    except Exception:  # noqa: BLE001  (the store file may be gone at interpreter exit)
        pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    shutil.rmtree(folder, ignore_errors=True)


def worker_env(env: Optional[dict], workers: int) -> dict:
    """The environment of each of ``workers`` processes: ``env`` (default: this process's) with OpenMP's threads
    (torch's CPU ops) shared out, ``OMP_NUM_THREADS`` = cores // workers, unless it is set. Each torch process
    otherwise starts one thread per core, and N of them on one machine spin against each other in every
    parallel CPU op."""
    return knobs.child_environment({"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // max(1, workers)))}, env)


class WorkerPool:
    """``devices``: one worker per entry ("cuda:0", "cpu", ...); ``worker_argv``: the command that starts one (the
    pool appends ``--pool-store PATH --rank R --world N --device D``); ``env``: theirs (``worker_env`` of it)."""

    def __init__(self, devices: Sequence[str], worker_argv: Sequence[str], env: Optional[dict] = None,
                 grace_s: float = 10.0):
        if not devices:
            raise ValueError("a worker pool needs at least one device")
        self.devices = list(devices)
        self.folder = tempfile.mkdtemp(prefix="seedvr2bw-pool-")
        self.store_path = os.path.join(self.folder, "store")
        self.store = dist.FileStore(self.store_path, -1)
        self.jobs = 0
        n = len(self.devices)
        self.procs = [subprocess.Popen([*worker_argv, "--pool-store", self.store_path, "--rank", str(r),
                                        "--world", str(n), "--device", d], env=worker_env(env, n))
                      for r, d in enumerate(self.devices)]
        self._finalizer = weakref.finalize(self, _shutdown, self.store_path, self.procs, self.folder, grace_s)
        log.info("[SeedVR2-BW] worker pool: %d process(es) on %s", n, ", ".join(self.devices))

    @property
    def alive(self) -> bool:
        return self._finalizer.alive and all(p.poll() is None for p in self.procs)

    def ready(self) -> int:
        """Workers whose models are loaded."""
        return sum(self.store.check([f"ready/{r}"]) for r in range(len(self.procs)))

    def run(self, job: PoolJob, progress: Optional[Callable[[int, int, float, float], None]] = None,
            should_stop: Optional[Callable[[], None]] = None, poll_s: float = 0.05) -> StreamResult:
        """Run ``job`` on every worker; returns rank 0's result. ``should_stop()`` raises to cancel: the workers
        are told, the pool is closed and the exception goes on."""
        if not self.alive:
            raise WorkerError("the worker pool is closed; start a new one")
        jid = f"j{self.jobs}"
        self.store.set(f"job/{self.jobs}", _dump(dataclasses.asdict(job)))
        self.jobs += 1
        seen = None
        while True:
            # progress first: a job that ends between two polls still reports its last state
            if progress is not None and self.store.check([f"{jid}/progress"]):
                now = _load(self.store.get(f"{jid}/progress"))
                if seen is None or now[0] > seen:    # ranks report in any order: only forward
                    seen = now[0]
                    progress(*now)
            if self.store.check([f"{jid}/result"]):
                return StreamResult(**_load(self.store.get(f"{jid}/result")))
            if self.store.check([f"{jid}/error"]):
                msg = _load(self.store.get(f"{jid}/error"))
                self.close()
                raise WorkerError(msg)
            dead = [(d, p.returncode) for d, p in zip(self.devices, self.procs) if p.poll() is not None]
            if dead:
                self.close()
                raise WorkerError(f"the worker on {dead[0][0]} exited (code {dead[0][1]}) during the job")
            if should_stop is not None:
                try:
                    should_stop()
                except BaseException:
                    self.store.set(f"{jid}/stop", b"1")
                    self.close()
                    raise
            time.sleep(poll_s)

    def close(self) -> None:
        """Stop the workers (they finish nothing more) and remove the store."""
        self._finalizer()


def serve(store_path: str, rank: int, world: int, device: str,
          make_upscaler: Callable[[dict, object], Callable[[np.ndarray], np.ndarray]], poll_s: float = 0.05,
          parallel: str = "chunks") -> None:
    """A worker's loop: join the workers' process group, then run each job as it comes until ``shutdown``.
    ``make_upscaler(params, group)`` gives the job's chunk upscaler (the worker's models are loaded before this is
    called); ``group`` is None for chunk parallel, the model work's process group for ``parallel="sequence"``
    (every worker on every chunk: rank 0 streams the file and sends each chunk to the others, ``sequence.py``).
    An upscaler with a ``fits(frames, height, width)`` method (``upscaler.ChunkUpscaler``) lets a chunk-parallel
    worker whose device cannot run the job under any memory plan sit the job out."""
    if parallel not in PARALLEL_MODES:
        raise ValueError(f"parallel {parallel!r}: one of {', '.join(PARALLEL_MODES)}")
    store = dist.FileStore(store_path, -1)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=world)
    group = compute_group(torch.device(device)) if parallel == "sequence" else None
    store.set(f"ready/{rank}", device.encode())
    n = 0
    while True:
        key = f"job/{n}"
        while not store.check([key]):
            if store.check(["shutdown"]):
                dist.destroy_process_group()
                return
            time.sleep(poll_s)
        d = _load(store.get(key))
        job = PoolJob(**dict(d, target=tuple(d["target"]), stream=StreamSettings(**d["stream"])))
        jid = f"j{n}"
        n += 1
        try:
            up = make_upscaler(job.params, group)

            def chunk(frames: np.ndarray) -> np.ndarray:
                if store.check([f"{jid}/stop"]):
                    raise JobCancelled(f"job {jid} cancelled")
                return up(frames)

            def progress(done, total, fps, left):
                store.set(f"{jid}/progress", _dump([done, total, fps, left]))

            if parallel == "sequence":
                res = upscale_video_sequence(job.in_path, job.out_path, chunk, lambda h, w: tuple(job.target),
                                             job.stream, job.model_key, progress=progress)
            else:
                res = upscale_video_distributed(dist.PrefixStore(jid, store), job.in_path, job.out_path, chunk,
                                                lambda h, w: tuple(job.target), job.stream, job.model_key,
                                                progress=progress, run_id=jid, fits=getattr(up, "fits", None))
            if rank == 0:
                store.set(f"{jid}/result", _dump(dataclasses.asdict(res)))
        except BaseException as exc:   # the pool closes; a rank left in a collective is killed with it
            store.set(f"{jid}/error", _dump(f"worker {rank} on {device}: {type(exc).__name__}: {exc}"))
            raise
