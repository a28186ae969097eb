"""One contiguous, page-aligned host arena per swapped module (block), in the tensors' stored dtypes.

Every parameter and buffer of the module (NVFP4 uint8 + scales, fp8, bf16, ...; trainable tensors excepted)
is laid out at a 256-byte aligned offset, so that one host->device copy moves the whole block and the GPU views
`slot[off:off+n].view(dtype).view(shape)` are aligned for any kernel. The module's tensors are re-pointed at
views of the arena (`t.data = view`): the arena *is* the host copy, there is never a second one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

ALIGN = 256
PAGE = 4096
SMALL_TENSOR_BYTES = 16384   # smaller tensors (norm weights, RoPE freqs, modulation, scalar scales) stay on the GPU


@dataclass
class TensorRecord:
    tensor: torch.Tensor      # the Parameter / buffer object itself (identity kept: only .data changes)
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple
    name: str


_increment_version = getattr(torch.autograd.graph, "increment_version", None) or torch._C._increment_version


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def swappable_tensors(module: nn.Module, small_bytes: int = SMALL_TENSOR_BYTES, exclude=frozenset()):
    """(qualified name, tensor) for each parameter and buffer of `module` to stream, de-duplicated.

    Left out (they stay on the compute device): trainable parameters (requires_grad, e.g. LoRA adapters), tensor
    subclasses, and tensors under `small_bytes` (a few KB per block; like ComfyUI's force-loaded small weights,
    and code that reads e.g. a block's RoPE freqs outside the block's forward keeps working).
    """
    seen = set()
    out = []
    for name, t in list(module.named_parameters(recurse=True)) + list(module.named_buffers(recurse=True)):
        if t is None or id(t) in seen or id(t) in exclude:
            continue
        seen.add(id(t))
        if t.requires_grad:
            continue
        if type(t.data) is not torch.Tensor or t.is_sparse or t.is_quantized:
            continue
        if t.numel() * t.element_size() < small_bytes:
            continue
        out.append((name, t))
    return out


def module_bytes(module: nn.Module, only_swappable: bool = False, small_bytes: int = SMALL_TENSOR_BYTES) -> int:
    if only_swappable:
        return sum(t.numel() * t.element_size() for _, t in swappable_tensors(module, small_bytes))
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def arena_layout(tensors) -> tuple[list[tuple], int]:
    """[(offset, nbytes)] for each tensor and the total size (a multiple of the page size)."""
    off, lay = 0, []
    for _, t in tensors:
        n = t.numel() * t.element_size()
        lay.append((off, n))
        off = _round_up(off + n, ALIGN)
    return lay, _round_up(max(off, 1), PAGE)


class HostArena:
    """Packs `module`'s swappable tensors into one page-aligned host buffer and re-points them at it."""

    def __init__(self, module: nn.Module, name: str = "", pin_fn=None, small_bytes: int = SMALL_TENSOR_BYTES,
                 exclude=frozenset()):
        self.module = module
        self.name = name
        tensors = swappable_tensors(module, small_bytes, exclude)
        layout, total = arena_layout(tensors)
        self.nbytes = total
        self.payload_bytes = sum(n for _, n in layout)
        # page-aligned: cudaHostRegister works per page; two arenas never share a page
        self._raw = torch.empty(total + PAGE, dtype=torch.uint8)
        start = (-self._raw.data_ptr()) % PAGE
        self.buffer = self._raw[start:start + total]
        self.pinned = bool(pin_fn(self.buffer)) if pin_fn is not None else False  # pin first: D2H fill runs fast
        self.records: list[TensorRecord] = []
        with torch.no_grad():
            for (qname, t), (off, n) in zip(tensors, layout):
                view = self.view(self.buffer, off, n, t.dtype, tuple(t.shape))
                view.copy_(t.data)
                self.records.append(TensorRecord(t, off, n, t.dtype, tuple(t.shape), qname))
                t.data = view           # the arena now holds the only host copy
        self.host_views = [r.tensor.data for r in self.records]

    @staticmethod
    def view(buf: torch.Tensor, off: int, n: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        flat = buf[off:off + n]
        if dtype != torch.uint8:
            flat = flat.view(dtype)
        return flat.view(shape)

    @property
    def inference(self) -> bool:
        """Whether the module's tensors are inference tensors (a model built under ``torch.inference_mode``, as
        ComfyUI's loaders do); views bound to them must be inference tensors too, or using them raises."""
        return any(r.tensor.is_inference() for r in self.records)

    def device_views(self, slot: torch.Tensor) -> list[torch.Tensor]:
        """Views of a device buffer laid out like the arena, of the same inference-ness as the module's tensors."""
        with torch.inference_mode(self.inference):
            return [self.view(slot, r.offset, r.nbytes, r.dtype, r.shape) for r in self.records]

    def bind(self, views: list[torch.Tensor]) -> None:
        for r, v in zip(self.records, views):
            r.tensor.data = v

    def unbind(self) -> None:
        for r, v in zip(self.records, self.host_views):
            r.tensor.data = v
            # anything autograd saved from this block (the weight or a view of it, e.g. W.t()) aliases the ring
            # slot that is about to be refilled: bump the version so such a backward raises instead of silently
            # using another block's weights (training must use per-block checkpointing); inference tensors have
            # no version and no autograd
            if not r.tensor.is_inference():
                _increment_version(r.tensor)

    def restore_to(self, device: Optional[torch.device]) -> None:
        """Move the tensors to `device` and drop the arena. For a CPU device nothing is copied: the tensors keep
        pointing at the (unpinned) arena, which stays alive through them -- never a second host copy."""
        if device is None or torch.device(device).type == "cpu":
            return
        with torch.no_grad():
            for r, v in zip(self.records, self.host_views):
                r.tensor.data = v.to(device, copy=True)
        self.records, self.host_views = [], []
        self.buffer = self._raw = None

    def __len__(self):
        return len(self.records)
