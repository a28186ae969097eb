"""Device -> host copies into ordinary (pageable) host tensors, through two small pinned buffers.

A pageable destination makes the driver stage the copy itself and fill the destination on one thread: measured
0.45 s for a 1080p x 21 float32 output (0.5 GB) on an H100 host. Here the GPU copies piece by piece into pinned
memory while the previous piece is spread into the destination by torch's threaded copy. Most of what is left is
the kernel mapping the fresh destination's pages on their first write (0.5 GB: 100 ms into new memory, 22 ms into
mapped memory on a 2-core machine); ``map_pages`` does that on a thread while the GPU still computes.
"""
from __future__ import annotations

import threading

import torch

PIECE_BYTES = 32 * 2 ** 20
_buffers: dict = {}
_lock = threading.Lock()


def _staging(device: torch.device) -> list[torch.Tensor]:
    with _lock:
        if device not in _buffers:
            _buffers[device] = [torch.empty(PIECE_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        return _buffers[device]


def copy_to_host(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` for a contiguous host ``dst`` and a CUDA ``src`` of the same shape and dtype; anything
    else is left to ``copy_``. Returns ``dst`` when the copy is complete."""
    if not (src.is_cuda and dst.device.type == "cpu" and dst.is_contiguous() and dst.dtype == src.dtype
            and dst.shape == src.shape) or dst.numel() * dst.element_size() <= PIECE_BYTES:
        return dst.copy_(src)
    flat_src = src.contiguous().view(-1).view(torch.uint8)
    flat_dst = dst.view(-1).view(torch.uint8)
    stage = _staging(src.device)
    n = flat_src.numel()
    starts = list(range(0, n, PIECE_BYTES))
    done = [torch.cuda.Event() for _ in stage]
    stream = torch.cuda.current_stream(src.device)

    def fetch(i: int) -> None:
        a = starts[i]
        b = min(a + PIECE_BYTES, n)
        stage[i % 2][:b - a].copy_(flat_src[a:b], non_blocking=True)
        done[i % 2].record(stream)

    fetch(0)
    for i, a in enumerate(starts):
        if i + 1 < len(starts):
            fetch(i + 1)     # the next piece crosses the bus while this one is spread on the host
        done[i % 2].synchronize()
        b = min(a + PIECE_BYTES, n)
        flat_dst[a:b].copy_(stage[i % 2][:b - a])
    return dst


def map_pages(t: torch.Tensor) -> threading.Thread:
    """Writes zeros into a new host tensor on a thread (torch's ops release the GIL: the caller goes on launching
    GPU work), so its pages are mapped before the copies into it; ``join()`` it before the first write."""
    thread = threading.Thread(target=t.zero_, name="seedvr2bw-map-pages", daemon=True)
    thread.start()
    return thread
