"""GGML tensor types as this pack knows them: ids, block geometry, the error type. No dependency on `gguf`.

The ids are GGML's (``ggml_type`` in ggml.h, ``gguf.GGMLQuantizationType`` in the `gguf` package); an IntEnum
so that a ``gguf.GGMLQuantizationType`` member and a ``QType`` member with the same id compare and hash equal.
Every quantized type stores a tensor as a flat sequence of blocks along the innermost (last torch) dimension;
a block of ``block_size`` elements takes ``type_size`` bytes.
"""
from __future__ import annotations

from enum import IntEnum

import torch


class GGUFError(ValueError):
    """A GGUF file or tensor this pack cannot use; the message names the file or tensor and what to do."""


class QType(IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    BF16 = 30


QK_K = 256  # elements per super-block of the K-quants

# (block_size, type_size): elements per block, bytes per block (ggml's type traits)
QUANT_SIZES: dict[QType, tuple[int, int]] = {
    QType.Q4_0: (32, 2 + 16),
    QType.Q4_1: (32, 2 + 2 + 16),
    QType.Q5_0: (32, 2 + 4 + 16),
    QType.Q5_1: (32, 2 + 2 + 4 + 16),
    QType.Q8_0: (32, 2 + 32),
    QType.Q2_K: (QK_K, QK_K // 16 + QK_K // 4 + 2 + 2),
    QType.Q3_K: (QK_K, QK_K // 8 + QK_K // 4 + 12 + 2),
    QType.Q4_K: (QK_K, 2 + 2 + 12 + QK_K // 2),
    QType.Q5_K: (QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),
    QType.Q6_K: (QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
}

# plain (unquantized) element types and the torch dtype they are read as
PLAIN_DTYPES: dict[QType, torch.dtype] = {
    QType.F32: torch.float32,
    QType.F16: torch.float16,
    QType.BF16: torch.bfloat16,
    QType.F64: torch.float64,
    QType.I8: torch.int8,
    QType.I16: torch.int16,
    QType.I32: torch.int32,
    QType.I64: torch.int64,
}

QUANTIZED_QTYPES: tuple[QType, ...] = tuple(QUANT_SIZES)
SUPPORTED_QTYPES: tuple[QType, ...] = tuple(PLAIN_DTYPES) + QUANTIZED_QTYPES


def supported_names() -> str:
    """The supported type names, for error messages."""
    return ", ".join(q.name for q in SUPPORTED_QTYPES)


def qtype_name(qtype: int) -> str:
    """GGML's name for a type id, also for ids this pack does not support (the `gguf` package knows them)."""
    try:
        return QType(int(qtype)).name
    except ValueError:
        pass
    try:
        import gguf

        return gguf.GGMLQuantizationType(int(qtype)).name
    except (ImportError, ValueError):
        return f"type id {int(qtype)}"


def as_qtype(qtype: int, what: str = "tensor") -> QType:
    """``qtype`` as a ``QType``; GGUFError naming ``what`` and the supported types if this pack cannot decode it."""
    try:
        return QType(int(qtype))
    except ValueError:
        raise GGUFError(
            f"{what}: GGML type {qtype_name(qtype)} is not supported (supported: {supported_names()}); "
            "use a file quantized to one of these types") from None


def block_geometry(qtype: int) -> tuple[int, int]:
    """(block_size, type_size) of a quantized or plain type."""
    q = as_qtype(qtype)
    if q in QUANT_SIZES:
        return QUANT_SIZES[q]
    return 1, torch.empty((), dtype=PLAIN_DTYPES[q]).element_size()
