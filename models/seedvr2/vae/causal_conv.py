"""Causal 3-D convolution with exact chunked (sliced) temporal processing and a memory-limited spatial path.

docs/SPEC.md §5: a conv with temporal padding p gets no zero padding in time; instead 2p copies of the first frame are
prepended ("causal"), so output frame t depends on input frames <= t only. When a clip is processed in temporal
chunks, the last (kernel_t - stride_t) frames of each chunk's extended input are kept and prepended to the next
chunk instead of the replicated first frame; this reproduces the single pass exactly (official `set_causal_slicing`).
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ....optimization import fused
from ....optimization.runtime import knobs
from . import row_parallel
from .layout import empty_like_layout, layout_of

GIB = 1024 ** 3
# Convs to at most this many channels run streamed (``CausalConv3d.streams``): cuDNN's tiles are built for wide outputs
STREAM_MAX_OUT = 4


class TemporalCache:
    """Per-module memory carried from one temporal chunk to the next (one instance per clip / spatial tile).

    `first_chunk` is True while the chunk being processed holds the clip's first frame: the causal convs then
    replicate the first frame, and temporal upsamplers drop the duplicate frame the first latent frame produces.
    `last_chunk` is True while it holds the clip's last: no chunk follows, so nothing is kept for one.
    """

    def __init__(self, last_chunk: bool = False):
        self.first_chunk = True
        self.last_chunk = last_chunk
        self._memory: Dict[int, torch.Tensor] = {}

    def get(self, module: nn.Module):
        return self._memory.get(id(module))

    def keeps(self) -> bool:
        """Whether the convs keep their last frames for a next chunk."""
        return not self.last_chunk

    def put(self, module: nn.Module, frames) -> None:
        """``frames``: what the module's next chunk needs (its last input frames; a streamed conv's tap sums)."""
        self._memory[id(module)] = frames

    def next_chunk(self, last: bool = False) -> None:
        self.first_chunk = False
        self.last_chunk = last

    def clear(self) -> None:
        self._memory.clear()


def extend_time(prefix: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``prefix`` (n frames, a broadcast view allowed) then ``x`` along time, in x's layout
    (torch.cat would return NCDHW for a broadcast prefix)."""
    n = prefix.shape[2]
    shape = list(x.shape)
    shape[2] += n
    out = empty_like_layout(x, shape)
    out[:, :, :n].copy_(prefix)
    out[:, :, n:].copy_(x)
    return out


def pad_spatial(x: torch.Tensor, pad: Sequence[int]) -> torch.Tensor:
    """Zero padding (top, bottom, left, right) of the last two dims, in x's layout."""
    b, c, t, h, w = x.shape
    out = empty_like_layout(x, (b, c, t, h + pad[0] + pad[1], w + pad[2] + pad[3]))
    out.zero_()
    out[:, :, :, pad[0]:pad[0] + h, pad[2]:pad[2] + w].copy_(x)
    return out


def _pad_bytes(x: torch.Tensor, pad: Sequence[int]) -> int:
    b, c, t, h, w = x.shape
    return b * c * t * (h + pad[0] + pad[1]) * (w + pad[2] + pad[3]) * x.element_size()


# torch hands a convolution whose one sample (input or output) has more elements than a 32-bit index reaches to a
# generic fallback instead of cuDNN: measured on an H100, a 1080p x 21 decode without bands did not finish in
# minutes (its 256-channel full-resolution convs hold 3.2e9 elements a sample). Bands keep every call below it.
INDEX_LIMIT = 2 ** 31 - 1


def _bands_needed(x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int], pad: Sequence[int],
                  max_bytes: float) -> float:
    """How many times over its limits this conv is: padded input bytes against ``max_bytes``, and one sample's
    input and output elements against INDEX_LIMIT."""
    _, c, t, h, w = x.shape
    hp, wp = h + pad[0] + pad[1], w + pad[2] + pad[3]
    k = weight.shape[2:]
    out = weight.shape[0] * ((t - k[0]) // stride[0] + 1) * ((hp - k[1]) // stride[1] + 1) * \
        ((wp - k[2]) // stride[2] + 1)
    return max(_pad_bytes(x, pad) / max_bytes, c * t * hp * wp / INDEX_LIMIT, out / INDEX_LIMIT)


def conv3d_limited(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    stride: Tuple[int, int, int],
    pad: Tuple[int, int, int, int],
    max_bytes: float = math.inf,
    split_dims: Tuple[int, ...] = (3, 4),
    head_sum: bool = False,
) -> torch.Tensor:
    """conv3d of `x` (already extended in time) with spatial zero padding pad = (top, bottom, left, right).

    When the padded input exceeds `max_bytes`, the output is computed in bands along H (then W, recursively),
    each band from the input rows it needs plus their halo, and written into one preallocated output. This is the
    official conv_max_mem path (`memory_limit_conv`): mathematically exact, it bounds the padded copies and conv
    workspace to one band. Without a limit, bands still keep one sample under INDEX_LIMIT elements.
    ``head_sum``: x starts with the clip's first frame twice, standing for three copies (``CausalConv3d.sums_head``):
    the output gets one frame more in front, that frame's three temporal taps summed (``head_sum_conv``).
    """
    over = _bands_needed(x, weight, stride, pad, max_bytes)
    if over <= 1 or not split_dims:
        # on NDHWC torch adds a cuDNN convolution's bias in a broadcast pass of its own at half the copy rate
        late = bias is not None and fused.enabled(x) and fused.channels_last(x)
        b = None if late else bias
        if pad[0] != pad[1] or pad[2] != pad[3]:
            x, pad = pad_spatial(x, pad), (0, 0, 0, 0)
        if head_sum:
            y = head_sum_conv(x, weight, b, stride, (0, pad[0], pad[2]))
        else:
            y = F.conv3d(x, weight, b, stride, padding=(0, pad[0], pad[2]))
        # cuDNN answers NDHWC with NDHWC; torch's CPU convolutions may not, and the next layer must not transpose
        y = y.contiguous(memory_format=layout_of(x))
        return fused.bias_add_(y, bias) if late else y

    dim = split_dims[0]
    axis = dim - 3                       # 0 = H, 1 = W
    k, s = weight.shape[dim], stride[dim - 2]
    p0, p1 = pad[2 * axis], pad[2 * axis + 1]
    size = x.shape[dim]
    out_len = (size + p0 + p1 - k) // s + 1
    n = max(1, min(out_len, math.ceil(over)))
    bounds = [round(i * out_len / n) for i in range(n + 1)]

    out = None
    for o0, o1 in zip(bounds[:-1], bounds[1:]):
        if o1 <= o0:
            continue
        # Input rows (unpadded coordinates) that output rows [o0, o1) read, and the zero padding they still need.
        i0, i1 = o0 * s - p0, (o1 - 1) * s + k - p0
        c0, c1 = max(i0, 0), min(i1, size)
        sub_pad = list(pad)
        sub_pad[2 * axis], sub_pad[2 * axis + 1] = c0 - i0, i1 - c1
        part = conv3d_limited(x.narrow(dim, c0, c1 - c0), weight, bias, stride, tuple(sub_pad), max_bytes,
                              split_dims[1:], head_sum)
        if out is None:
            shape = list(part.shape)
            shape[dim] = out_len
            out = empty_like_layout(part, shape)
        out.narrow(dim, o0, o1 - o0).copy_(part)
        del part
    return out


def conv_into(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], stride: Sequence[int],
              padding: Sequence[int], out: torch.Tensor) -> torch.Tensor:
    """F.conv3d(x, weight, bias, stride, padding) written into ``out``: cuDNN writes it there itself where it can (no
    bias, ``out`` dense in x's layout: e.g. frames of a larger output), else a copy."""
    if (x.is_cuda and bias is None and torch.backends.cudnn.is_available() and torch.backends.cudnn.enabled
            and out.is_contiguous(memory_format=layout_of(x)) and weight.is_contiguous(memory_format=layout_of(x))):
        cudnn = torch.backends.cudnn
        return torch.ops.aten.cudnn_convolution.out(x, weight, list(padding), list(stride), [1, 1, 1], 1,
                                                    cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32, out=out)
    return out.copy_(F.conv3d(x, weight, bias, stride, padding))


def head_sum_conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], stride: Sequence[int],
                  padding: Sequence[int]) -> torch.Tensor:
    """The conv (temporal kernel 3, stride 1) of [f0, f0, f0, f1, ...] from x = [f0, f0, f1, ...]: one replicated frame
    fewer to convolve. Output frame 0 reads f0 through all three temporal taps: it is f0 convolved with their sum,
    kept exact in 16 bits as a high and a low part (hi + lo, two taps of a conv over x's first two frames, both f0;
    float32 accumulation): 2/3 of a frame's convolution instead of one. Frames 1.. are the conv of x."""
    b, _, t, h, w = x.shape
    layout = layout_of(x)
    ho = (h + 2 * padding[1] - weight.shape[3]) // stride[1] + 1
    wo = (w + 2 * padding[2] - weight.shape[4]) // stride[2] + 1
    y = torch.empty((b, weight.shape[0], t - 1, ho, wo), device=x.device, dtype=x.dtype, memory_format=layout)
    if t > 2:
        conv_into(x, weight, bias, stride, padding, y[:, :, 1:])
    total = weight.float().sum(2)
    hi = total.to(weight.dtype)
    parts = torch.stack([hi, (total - hi.float()).to(weight.dtype)], 2).contiguous(memory_format=layout)
    conv_into(x[:, :, :2], parts, bias, stride, padding, y[:, :, :1])
    return y


class CausalConv3d(nn.Conv3d):
    """`InflatedCausalConv3d`: weight layout and key names of nn.Conv3d (`weight`, `bias`).

    padding = (pt, ph, pw) as in the official constructor: pt is not zero padding but the number of replicated
    first frames / 2; (ph, pw) is ordinary zero padding. `spatial_pad` (top, bottom, left, right) overrides it for
    the downsamplers, which pad only bottom/right.
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, bias=True,
                 spatial_pad: Optional[Tuple[int, int, int, int]] = None):
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=0, bias=bias)
        pt, ph, pw = (padding,) * 3 if isinstance(padding, int) else tuple(padding)
        self.head_frames = 2 * pt
        # Frames the next chunk needs from this one: a window of kernel_t frames advancing by stride_t.
        self.memory_frames = max(self.kernel_size[0] - self.stride[0], 0)
        self.spatial_pad = tuple(spatial_pad) if spatial_pad is not None else (ph, ph, pw, pw)
        self.max_bytes = math.inf        # conv_max_mem, set by the autoencoder

    def input_buffer(self, like: torch.Tensor, shape: Sequence[int], cache: Optional[TemporalCache] = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(buf, body): an empty input for this conv whose ``body`` has ``shape`` (B, C, T, H, W) and ``like``'s
        dtype, device and layout, with room in front for the frames the conv prepends (the previous chunk's memory,
        else the replicated first frame), under a row split above and below for the neighbouring bands' rows, and
        around it the zeros of a spatial padding the convolution cannot apply itself (``_own_pad``). The producer
        writes ``body``, then calls ``run_buffer(buf, cache)``: the conv's input is not a second copy."""
        _, n = self._prefix(cache)
        above, below = self._halo_rows()
        top, bottom, left, right = self._own_pad()
        b, c, t, h, w = shape
        buf = empty_like_layout(like, (b, c, n + t, above + top + h + bottom + below, left + w + right))
        for rows in (slice(above, above + top), slice(above + top + h, above + top + h + bottom)):
            buf[:, :, :, rows].zero_()
        for cols in (slice(0, left), slice(left + w, left + w + right)):
            buf[..., cols].zero_()
        return buf, buf[:, :, n:, above + top:above + top + h, left:left + w]

    def edges(self, body: torch.Tensor, cache: Optional[TemporalCache] = None
              ) -> tuple[int, Optional[torch.Tensor]]:
        """What the producer of an ``input_buffer``'s ``body`` may write as well, in the same pass (saving a pass
        over those frames each): (head, keep). head: how many copies of the body's first frame go in front of it
        (the first chunk's replicated frames; 0 when the previous chunk's memory goes there). keep: an empty tensor
        for the body's last frames, which the next chunk prepends (None when no chunk follows, or the body is
        shorter than that memory). ``run_buffer(..., written=(head, keep))`` then leaves them alone."""
        memory, n = self._prefix(cache)
        own_pad = any(self._own_pad())       # the padded frames go whole: run_buffer and the clone keep them
        head = n if memory is None and not own_pad else 0
        m = self.memory_frames
        if cache is None or not m or not cache.keeps() or body.shape[2] < m or own_pad:
            return head, None
        b, c, _, h, w = body.shape
        return head, empty_like_layout(body, (b, c, m, h, w))

    def run_buffer(self, buf: torch.Tensor, cache: Optional[TemporalCache] = None, bias: bool = True,
                   written: tuple[int, Optional[torch.Tensor]] = (0, None)) -> torch.Tensor:
        """The conv of an ``input_buffer`` whose body is written: fills the prepended frames, then runs (without its
        bias when ``bias`` is False: the caller adds it where it reads the output). ``written``: the ``edges``
        the producer wrote too."""
        memory, n = self._prefix(cache)
        above, below = self._halo_rows()
        head, keep = written
        band = buf[:, :, :, above:buf.shape[3] - below]      # with the zero padding the buffer carries
        if memory is not None:
            band[:, :, :n].copy_(memory)
        elif n and not head:
            band[:, :, :n].copy_(band[:, :, n:n + 1].expand(-1, -1, n, -1, -1))
        return self(buf, cache, extended=True, rows=(above, below), bias=bias, keep=keep)

    def streams(self, x: torch.Tensor) -> bool:
        """Whether this conv runs as ``fused.stream_conv3d`` on x (its input, not extended in time: no
        ``input_buffer``): a 3 x 3 x 3 causal conv to at most STREAM_MAX_OUT channels (the decoder's conv_out), stride
        1, zero padding 1, on the fused kernels' channels-last activations of whole frames (no row split), with
        ``SEEDVR2BW_VAE_STREAM_CONV`` on."""
        return (self.out_channels <= STREAM_MAX_OUT and tuple(self.kernel_size) == (3, 3, 3)
                and tuple(self.stride) == (1, 1, 1) and self.head_frames == 2 and self.spatial_pad == (1, 1, 1, 1)
                and x.ndim == 5 and knobs.get("VAE_STREAM_CONV") and fused.enabled(x) and fused.channels_last(x)
                and row_parallel.current() is None)

    def stream_norm_silu(self, x: torch.Tensor, norm: nn.GroupNorm, cache: Optional[TemporalCache] = None,
                         bias: bool = True) -> torch.Tensor:
        """This conv of SiLU(norm(x)) where it ``streams`` x: the norm applied as the conv's GEMM loads x."""
        return self._stream(x.to(self.weight.dtype), cache, bias, norm)

    def _stream(self, x: torch.Tensor, cache: Optional[TemporalCache], bias: bool,
                norm: Optional[nn.GroupNorm] = None) -> torch.Tensor:
        state = cache.get(self) if cache is not None else None
        if state is not None and not isinstance(state, tuple):
            raise RuntimeError("CausalConv3d: a temporal chunk took the streamed conv after one that did not")
        keep = cache is not None and cache.keeps()
        y, state = fused.stream_conv3d(x, self.weight, self.bias if bias else None, state, keep, self.max_bytes,
                                       norm)
        if keep:
            cache.put(self, state)
        return y

    def _own_pad(self) -> tuple[int, int, int, int]:
        """The zero rows and columns (top, bottom, left, right) an ``input_buffer`` carries: the spatial padding
        when it differs between the two sides (the downsamplers': cuDNN pads both sides alike, so the plain path
        copies the input into a padded one), outside a row split (whose halo exchange pads)."""
        p = self.spatial_pad
        if (p[0] == p[1] and p[2] == p[3]) or row_parallel.current() is not None:
            return (0, 0, 0, 0)
        return p

    def sums_head(self) -> bool:
        """Whether, at the clip's first chunk, this conv's input carries the first frame replicated once instead of
        twice, and the conv sums the temporal taps that read the copies (``head_sum_conv``: a third of a frame's
        convolution less): a causal conv over time (kernel 3, stride 1) with ``SEEDVR2BW_VAE_HEAD_SUM`` on (auto:
        16-bit weights on a GPU)."""
        if self.head_frames != 2 or self.kernel_size[0] != 3 or self.stride[0] != 1:
            return False
        on = knobs.get("VAE_HEAD_SUM")
        return bool(self.weight.is_cuda and self.weight.dtype in (torch.bfloat16, torch.float16) if on is None else on)

    def _prefix(self, cache: Optional[TemporalCache]) -> tuple[Optional[torch.Tensor], int]:
        """(the previous chunk's frames or None, how many frames go in front of the input)."""
        memory = cache.get(self) if cache is not None else None
        if memory is not None:
            return memory, memory.shape[2]
        return None, 1 if self.sums_head() else self.head_frames

    def _halo_rows(self) -> tuple[int, int]:
        shard = row_parallel.current()
        if shard is None or self.kernel_size[1] == 1:
            return 0, 0
        return shard.halo_rows(self.spatial_pad, self.kernel_size[1], self.stride[1])

    def forward(self, x: torch.Tensor, cache: Optional[TemporalCache] = None, extended: bool = False,
                rows: tuple[int, int] = (0, 0), bias: bool = True, keep: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
        """``extended``: x already starts with the prepended frames and has ``rows`` (above, below) around its band
        for the neighbours' rows (``input_buffer`` / ``run_buffer``). ``bias`` False: the output lacks the bias.
        ``keep``: the frames the next chunk prepends, already written (``edges``)."""
        x = x.to(self.weight.dtype)
        if not extended and self.streams(x):
            return self._stream(x, cache, bias)
        memory, n = self._prefix(cache)
        head_sum = memory is None and n < self.head_frames
        if not extended and memory is not None:
            x = extend_time(memory, x)
        elif not extended and n:
            x = extend_time(x[:, :, :1].expand(-1, -1, n, -1, -1), x)
        above, below = rows
        if cache is not None and self.memory_frames and cache.keeps():
            # clone: a view would keep the whole chunk alive until the next chunk; the band's own rows only
            if keep is None:
                keep = x[:, :, -self.memory_frames:, above:x.shape[3] - below].clone()
            cache.put(self, keep)
        pad = (0, 0, 0, 0) if extended and any(self._own_pad()) else self.spatial_pad
        shard = row_parallel.current()
        if shard is not None and self.kernel_size[1] > 1:     # the rows above and below come from other ranks
            k, st = self.kernel_size[1], self.stride[1]
            x, pad = shard.fill_halo(x, above, below, pad, k, st) if above or below else shard.halo(x, pad, k, st)
        return conv3d_limited(x, self.weight, self.bias if bias else None, self.stride, pad, self.max_bytes,
                              head_sum=head_sum)
