"""The device-specific half of BlockSwap: streams, events, async copies, pinning.

The runner talks only to a backend object, so its scheduling, pool accounting and fallbacks run on the CPU in
tests with `FakeBackend`. `CudaBackend` is the real one: one dedicated copy stream, CUDA events between streams,
`cudaHostRegister` in place through torch's cudart bindings (no second host copy).
"""
from __future__ import annotations

import abc
import ctypes
import ctypes.util
import itertools
import logging
import os
import sys
from contextlib import nullcontext
from typing import Optional

import torch

_log = logging.getLogger(__name__)

CUDA_HOST_REGISTER_PORTABLE = 1


class Backend(abc.ABC):
    """What the runner needs from a device; `CudaBackend` and `FakeBackend` implement every method."""

    device: torch.device
    is_fake: bool = False

    @abc.abstractmethod
    def new_stream(self): ...
    @abc.abstractmethod
    def current_stream(self): ...
    @abc.abstractmethod
    def stream(self, stream): ...          # context manager
    @abc.abstractmethod
    def new_event(self, timing: bool = False): ...
    @abc.abstractmethod
    def record(self, event, stream): ...
    @abc.abstractmethod
    def wait(self, stream, event): ...     # device-side: `stream` waits for `event`
    @abc.abstractmethod
    def copy_async(self, dst, src, stream, tag=None): ...
    @abc.abstractmethod
    def alloc(self, nbytes: int) -> torch.Tensor: ...
    @abc.abstractmethod
    def pin(self, t: torch.Tensor) -> bool: ...
    @abc.abstractmethod
    def unpin(self, t: torch.Tensor) -> None: ...
    @abc.abstractmethod
    def is_pinned(self, t: torch.Tensor) -> bool: ...
    @abc.abstractmethod
    def synchronize(self, stream=None) -> None: ...
    @abc.abstractmethod
    def elapsed_ms(self, start, end) -> float: ...
    @abc.abstractmethod
    def mem_get_info(self) -> tuple[int, int]: ...
    def in_backward(self) -> bool:
        try:
            return torch._C._current_graph_task_id() != -1
        except Exception:  # noqa: BLE001
            return False


# ----------------------------------------------------------------------------------------------- CUDA

_cudart_lib = None


def _load_cudart_ctypes():
    """The libcudart already loaded in this process (for cudaGetLastError), or None."""
    global _cudart_lib
    if _cudart_lib is not None:
        return _cudart_lib or None
    lib = False
    try:
        if sys.platform.startswith("linux"):
            with open("/proc/self/maps") as f:
                paths = {line.split()[-1] for line in f if "libcudart" in line and "/" in line}
            for p in sorted(paths):
                try:
                    lib = ctypes.CDLL(p)
                    lib.cudaGetLastError.restype = ctypes.c_int
                    break
                except OSError:
                    lib = False
        elif sys.platform == "win32":
            import glob
            torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
            for p in sorted(glob.glob(os.path.join(torch_lib, "cudart64_*.dll"))):
                try:
                    lib = ctypes.CDLL(p)
                    lib.cudaGetLastError.restype = ctypes.c_int
                    break
                except OSError:
                    lib = False
    except Exception:  # noqa: BLE001
        lib = False
    _cudart_lib = lib
    return lib or None


def clear_cuda_error(device=None) -> None:
    """Flush the runtime's 'last error' left by a failed cudaHostRegister.

    Otherwise torch's next kernel-launch check (cudaGetLastError) reports it as a failure of an unrelated kernel.
    """
    lib = _load_cudart_ctypes()
    if lib is not None:
        try:
            lib.cudaGetLastError()
            return
        except Exception:  # noqa: BLE001
            pass
    try:  # portable fallback: a tiny launch whose launch check consumes (and reports) the pending error
        torch.empty(1, device=device or "cuda").zero_()
    except RuntimeError:
        pass


class CudaBackend(Backend):
    is_fake = False
    # what this process registered through any CudaBackend: data_ptr -> bytes. `Tensor.is_pinned()` cannot be
    # used: it looks at the storage's base pointer, and an arena is a page-aligned slice of its storage.
    _registered: dict = {}

    def __init__(self, device):
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CudaBackend needs a cuda device, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())

    def new_stream(self):
        return torch.cuda.Stream(device=self.device)

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def stream(self, stream):
        return torch.cuda.stream(stream)

    def new_event(self, timing: bool = False):
        return torch.cuda.Event(enable_timing=timing)

    def record(self, event, stream):
        event.record(stream)

    def wait(self, stream, event):
        stream.wait_event(event)

    def copy_async(self, dst, src, stream, tag=None):
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(int(nbytes), dtype=torch.uint8, device=self.device)

    def pin(self, t: torch.Tensor) -> bool:
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            return False
        try:
            err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, CUDA_HOST_REGISTER_PORTABLE)
        except Exception as exc:  # noqa: BLE001
            _log.warning("[SeedVR2-BW] cudaHostRegister unavailable (%s): pageable copies", exc)
            return False
        code = _err_code(err)
        if code != 0:
            clear_cuda_error(self.device)
            _log.warning("[SeedVR2-BW] cudaHostRegister of %.1f MiB failed (error %d): this block is copied from "
                         "pageable memory (slower, blocks the host)", nbytes / 2**20, code)
            return False
        CudaBackend._registered[t.data_ptr()] = nbytes
        return True

    def unpin(self, t: torch.Tensor) -> None:
        err = torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
        CudaBackend._registered.pop(t.data_ptr(), None)
        if _err_code(err) != 0:
            clear_cuda_error(self.device)
            _log.warning("[SeedVR2-BW] cudaHostUnregister failed (error %d)", _err_code(err))

    def is_pinned(self, t: torch.Tensor) -> bool:
        p = t.data_ptr()
        return any(b <= p < b + n for b, n in CudaBackend._registered.items())

    @classmethod
    def registered_bytes(cls) -> int:
        """Host bytes currently registered (pinned in place) by BlockSwap in this process."""
        return sum(cls._registered.values())

    def synchronize(self, stream=None) -> None:
        if stream is None:
            torch.cuda.synchronize(self.device)
        else:
            stream.synchronize()

    def elapsed_ms(self, start, end) -> float:
        return float(start.elapsed_time(end))

    def mem_get_info(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)


def _err_code(err) -> int:
    try:
        return int(err)
    except (TypeError, ValueError):
        return int(getattr(err, "value", 1))


# ----------------------------------------------------------------------------------------------- Fake

class FakeStream:
    _ids = itertools.count()

    def __init__(self, name: str, lazy: bool):
        self.name = f"{name}{next(FakeStream._ids)}" if name != "compute" else name
        self.lazy = lazy
        self.pending: list = []   # (seq, fn)
        self.enqueued = 0
        self.executed = 0

    def flush(self, upto: Optional[int] = None):
        while self.pending and (upto is None or self.pending[0][0] < upto):
            _, fn = self.pending.pop(0)
            fn()
            self.executed += 1


class FakeEvent:
    _ids = itertools.count()

    def __init__(self, timing=False):
        self.id = next(FakeEvent._ids)
        self.stream: Optional[FakeStream] = None
        self.pos = 0
        self.time = 0.0


class FakeBackend(Backend):
    """CPU stand-in with the CUDA semantics that matter for correctness.

    The compute stream is the host (immediate). Copy streams are *lazy*: a copy runs only when something
    waits on an event recorded after it (or on synchronize), so a missing `wait(ready)` leaves stale data in the
    slot and shows up as a wrong output. Every call is logged in `self.log` for schedule tests.
    `pin_budget` (bytes) makes pinning fail once exceeded; `pin_fail=True` makes every pin fail.
    """

    is_fake = True

    def __init__(self, pin_fail: bool = False, pin_budget: Optional[int] = None,
                 vram: tuple[int, int] = (8 << 30, 16 << 30)):
        self.device = torch.device("cpu")
        self.pin_fail = pin_fail
        self.pin_budget = pin_budget
        self.vram = vram
        self.pinned: dict[int, int] = {}   # data_ptr -> nbytes
        self.log: list[tuple] = []
        self.compute = FakeStream("compute", lazy=False)
        self.host_syncs = 0
        self.allocated = 0
        self._clock = 0.0

    def new_stream(self):
        s = FakeStream("copy", lazy=True)
        self.track(s)
        self.log.append(("new_stream", s.name))
        return s

    def current_stream(self):
        return self.compute

    def stream(self, stream):
        return nullcontext()

    def new_event(self, timing: bool = False):
        return FakeEvent(timing)

    def record(self, event, stream):
        event.stream = stream
        event.pos = stream.enqueued
        self.log.append(("record", stream.name, event.id))

    def wait(self, stream, event):
        self.log.append(("wait", stream.name, event.id))
        if event.stream is not None and event.stream.lazy and event.stream is not stream:
            event.stream.flush(upto=event.pos)

    def copy_async(self, dst, src, stream, tag=None):
        self.log.append(("copy", stream.name, tag, src.numel() * src.element_size()))
        seq = stream.enqueued
        stream.enqueued += 1

        def run(dst=dst, src=src):
            dst.copy_(src)
        if stream.lazy:
            stream.pending.append((seq, run))
        else:
            run()
            stream.executed += 1

    def alloc(self, nbytes: int) -> torch.Tensor:
        self.allocated += int(nbytes)
        self.log.append(("alloc", int(nbytes)))
        return torch.full((int(nbytes),), 0xAB, dtype=torch.uint8)   # poisoned: unwritten bytes show up

    def pin(self, t: torch.Tensor) -> bool:
        nbytes = t.numel() * t.element_size()
        if self.pin_fail or (self.pin_budget is not None and sum(self.pinned.values()) + nbytes > self.pin_budget):
            self.log.append(("pin_failed", nbytes))
            return False
        self.pinned[t.data_ptr()] = nbytes
        self.log.append(("pin", nbytes))
        return True

    def unpin(self, t: torch.Tensor) -> None:
        self.pinned.pop(t.data_ptr(), None)
        self.log.append(("unpin", t.numel() * t.element_size()))

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.data_ptr() in self.pinned

    def synchronize(self, stream=None) -> None:
        self.host_syncs += 1
        self.log.append(("sync", getattr(stream, "name", None)))
        # flush every lazy stream we know of through the events logged; streams are flushed by their owners
        for s in list(self._streams()):
            if stream is None or s is stream:
                s.flush()

    def _streams(self):
        return getattr(self, "_known_streams", [])

    def track(self, stream):
        if not hasattr(self, "_known_streams"):
            self._known_streams = []
        self._known_streams.append(stream)

    def elapsed_ms(self, start, end) -> float:
        return 0.0

    def mem_get_info(self) -> tuple[int, int]:
        return self.vram


def make_backend(device) -> Backend:
    device = torch.device(device)
    if device.type == "cuda":
        return CudaBackend(device)
    raise ValueError(f"BlockSwap needs a CUDA device (got {device}); use FakeBackend for CPU tests")
