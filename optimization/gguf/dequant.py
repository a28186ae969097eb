"""GGML block dequantization in plain torch: the same code runs on CPU and CUDA tensors, vectorised over blocks.

Bit-exact with the `gguf` package's numpy ``gguf.quants.dequantize`` in float32: every product and sum is
formed in float32 in the reference's order (``d * scale`` first, then ``* q``, then ``- min`` / ``+ m``), each
as its own torch op (no addcmul / fused multiply-add, which would round once instead of twice). The result is
cast to the requested dtype only at the end (round to nearest even).

Block layouts (byte offsets inside one block; fp16 fields are little-endian IEEE half):

* Q8_0 (34 B / 32): d f16 | 32 x int8.                     x = q * d
* Q4_0 (18 B / 32): d f16 | 16 B nibbles.                  x = d * (nibble - 8)
* Q4_1 (20 B / 32): d f16 | m f16 | 16 B nibbles.          x = d * nibble + m
* Q5_0 (22 B / 32): d f16 | qh u32 | 16 B nibbles.         x = d * ((nibble | bit << 4) - 16)
* Q5_1 (24 B / 32): d f16 | m f16 | qh u32 | 16 B.         x = d * (nibble | bit << 4) + m
  (32-element types: element j < 16 is the low nibble of byte j, element j >= 16 the high nibble of byte j-16;
  bit j of the little-endian qh word is element j's fifth bit)
* Q2_K (84 B / 256): 16 B scales (lo nibble: scale, hi: min) | 64 B 2-bit q | d f16 | dmin f16.
* Q3_K (110 B / 256): 32 B hmask | 64 B 2-bit q | 12 B packed 6-bit scales | d f16.
* Q4_K (144 B / 256): d f16 | dmin f16 | 12 B packed 6-bit scales and mins | 128 B nibbles.
* Q5_K (176 B / 256): d f16 | dmin f16 | 12 B scales and mins | 32 B high bits | 128 B nibbles.
* Q6_K (210 B / 256): 128 B low nibbles | 64 B 2-bit highs | 16 x int8 scales | d f16.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from .format import PLAIN_DTYPES, QK_K, QUANT_SIZES, GGUFError, QType, as_qtype, qtype_name

# elements per chunk: bounds the float32 intermediates when the output is bf16/fp16 (a Python loop over
# chunks of many blocks, never over single blocks)
CHUNK_ELEMENTS = 1 << 24


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 field at byte ``at`` of every block, as float32 (n, 1)."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).to(torch.float32)


def _unpack(data: torch.Tensor, group: int, step: int, mask: int) -> torch.Tensor:
    """Split each byte into bit fields of ``step`` bits: data (n, m) -> (n, m // group, 8 // step, group).

    Field ``s`` of byte ``i`` of a group of ``group`` bytes is ``(byte >> (s * step)) & mask``; the result
    flattens as: group, then field, then byte (ggml's element order for every type below).
    """
    n = data.shape[0]
    shifts = torch.arange(0, 8, step, dtype=torch.uint8, device=data.device).view(1, 1, -1, 1)
    return (data.reshape(n, -1, 1, group) >> shifts) & mask


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    x = b[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return x * d


def _nibbles32(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 elements (low nibbles first), uint8 (n, 32)."""
    return _unpack(qs, 16, 4, 0x0F).reshape(qs.shape[0], 32)


def _fifth_bits32(qh: torch.Tensor) -> torch.Tensor:
    """4 bytes (little-endian u32) -> bit j for element j, uint8 (n, 32)."""
    return _unpack(qh, 1, 1, 0x01).reshape(qh.shape[0], 32)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    q = _nibbles32(b[:, 2:18]).to(torch.int8) - 8
    return d * q.to(torch.float32)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    q = _nibbles32(b[:, 4:20]).to(torch.float32)
    return (d * q) + m


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    q = (_nibbles32(b[:, 6:22]) | (_fifth_bits32(b[:, 2:6]) << 4)).to(torch.int8) - 16
    return d * q.to(torch.float32)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    q = (_nibbles32(b[:, 8:24]) | (_fifth_bits32(b[:, 4:8]) << 4)).to(torch.float32)
    return (d * q) + m


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, 0:16]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = (d * (scales & 0x0F).to(torch.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
    # 2 groups of 32 bytes x 4 two-bit fields = 256 elements, in 16 sub-blocks of 16
    q = _unpack(b[:, 16:80], 32, 2, 0x03).reshape(n, 16, 16).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs, packed = b[:, 0:32], b[:, 32:96], b[:, 96:108]
    d = _f16(b, 108)
    # 16 six-bit scales: low 4 bits from the nibbles of bytes 0-7, high 2 bits from the 2-bit fields of bytes 8-11
    low = _unpack(packed[:, 0:8], 8, 4, 0x0F).reshape(n, 16)
    high = _unpack(packed[:, 8:12], 4, 2, 0x03).reshape(n, 16)
    sc = ((low | (high << 4)).to(torch.int8) - 32).to(torch.float32)
    dl = (d * sc).reshape(n, 16, 1)
    ql = _unpack(qs, 32, 2, 0x03).reshape(n, 16, 16)
    # a set hmask bit means no offset, a clear one subtracts 4
    qh = _unpack(hmask, 32, 1, 0x01).reshape(n, 16, 16) ^ 1
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).to(torch.float32)
    return (dl * q).reshape(n, QK_K)


def _k_scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and 8 six-bit mins of Q4_K / Q5_K from their 12 packed bytes, uint8 (n, 8) each."""
    n = packed.shape[0]
    p = packed.reshape(n, 3, 4)
    d, m, md = p[:, 0], p[:, 1], p[:, 2]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    return (d * sc.to(torch.float32)).reshape(n, 8, 1), (dmin * mn.to(torch.float32)).reshape(n, 8, 1)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    dl, ml = _k_scales(b)
    q = _unpack(b[:, 16:144], 32, 4, 0x0F).reshape(n, 8, 32).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    dl, ml = _k_scales(b)
    qh = _unpack(b[:, 16:48], 32, 1, 0x01).reshape(n, 8, 32)
    ql = _unpack(b[:, 48:176], 32, 4, 0x0F).reshape(n, 8, 32)
    q = (ql | (qh << 4)).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = _f16(b, 208)
    dl = (d * scales).reshape(n, 16, 1)
    ql = _unpack(b[:, 0:128], 64, 4, 0x0F).reshape(n, 8, 32)
    qh = _unpack(b[:, 128:192], 32, 2, 0x03).reshape(n, 8, 32)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, 16, 16).to(torch.float32)
    return (dl * q).reshape(n, QK_K)


_DECODERS: dict[QType, Callable[[torch.Tensor], torch.Tensor]] = {
    QType.Q8_0: _q8_0, QType.Q4_0: _q4_0, QType.Q4_1: _q4_1, QType.Q5_0: _q5_0, QType.Q5_1: _q5_1,
    QType.Q2_K: _q2_k, QType.Q3_K: _q3_k, QType.Q4_K: _q4_k, QType.Q5_K: _q5_k, QType.Q6_K: _q6_k,
}
assert set(_DECODERS) == set(QUANT_SIZES)


def raw_nbytes(qtype: int, shape: Sequence[int]) -> int:
    """Bytes a tensor of ``shape`` takes in type ``qtype`` (GGUFError if the element count is not whole blocks)."""
    q = as_qtype(qtype)
    numel = 1
    for s in shape:
        numel *= int(s)
    if q in PLAIN_DTYPES:
        return numel * torch.empty((), dtype=PLAIN_DTYPES[q]).element_size()
    block, size = QUANT_SIZES[q]
    if numel % block:
        raise GGUFError(f"{q.name} tensor of shape {tuple(shape)}: {numel} elements are not a multiple of the "
                        f"block size {block}")
    return numel // block * size


def dequantize_blocks(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """uint8 blocks (n_blocks, type_size) -> float32 (n_blocks, block_size), the exact reference values."""
    return _DECODERS[as_qtype(qtype)](blocks)


def dequantize(raw: torch.Tensor, qtype: int, shape: Sequence[int],
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Decode GGML data to a ``shape`` tensor of ``dtype`` on ``raw``'s device.

    ``raw``: the stored bytes as a uint8 tensor of any shape (its elements in storage order), or for a plain
    type (F32/F16/BF16/...) also a tensor of that element type. Quantized values are computed in float32,
    bit-exact with ``gguf.quants.dequantize``, then cast to ``dtype``.
    """
    q = as_qtype(qtype)
    shape = tuple(int(s) for s in shape)
    if q in PLAIN_DTYPES:
        src = PLAIN_DTYPES[q]
        flat = raw.reshape(-1)
        if flat.dtype != src:
            flat = flat.contiguous().view(torch.uint8).view(src)
        if flat.numel() != raw_nbytes(q, shape) // flat.element_size():
            raise GGUFError(f"{q.name} data of {flat.numel()} elements does not fill shape {shape}")
        return flat.reshape(shape).to(dtype)
    if raw.dtype != torch.uint8:
        raise GGUFError(f"{q.name} data must be a uint8 tensor of block bytes, got {raw.dtype}")
    block, size = QUANT_SIZES[q]
    nbytes = raw_nbytes(q, shape)
    if raw.numel() != nbytes:
        raise GGUFError(f"{q.name} tensor of shape {shape} takes {nbytes} bytes, the data has {raw.numel()}")
    blocks = raw.reshape(-1, size)
    n = blocks.shape[0]
    per_chunk = max(1, CHUNK_ELEMENTS // block)
    if n <= per_chunk:
        return _DECODERS[q](blocks).reshape(shape).to(dtype)
    # many blocks: decode chunk by chunk straight into the output, so float32 exists only for one chunk
    out = torch.empty((n, block), dtype=dtype, device=raw.device)
    for start in range(0, n, per_chunk):
        out[start:start + per_chunk] = _DECODERS[q](blocks[start:start + per_chunk])
    return out.reshape(shape)


def describe(qtype: int) -> str:
    """``Q4_K (256 elements in 144 bytes, 4.5 bits/weight)``: for logs and reports."""
    if int(qtype) not in QUANT_SIZES:
        return qtype_name(qtype)
    q = QType(int(qtype))
    block, size = QUANT_SIZES[q]
    return f"{q.name} ({block} elements in {size} bytes, {8 * size / block:g} bits/weight)"
