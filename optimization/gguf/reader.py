"""Read a GGUF file (numz's SeedVR2 GGUFs, city96's ComfyUI-GGUF conversions, llama.cpp files) into torch.

``read_gguf(path) -> (tensors, metadata)``: quantized tensors come back as ``GGUFTensor`` (the raw block bytes as a
uint8 torch tensor, the GGML type, the logical torch shape), plain F32/F16/BF16 (and F64/I8..I64) tensors as
ordinary torch tensors of their dtype. The file is memory-mapped copy-on-write through the `gguf` package's
``GGUFReader``: every tensor is a zero-copy view of the mapping (pages are read from disk on first touch, and
a write into a tensor changes only this process' private copy, never the file).

Shapes: GGUF lists a tensor's dimensions innermost first (ggml's ``ne[0]`` = the contiguous dimension), the
reverse of torch's order; a linear weight ``[out, in]`` is stored with dims ``(in, out)``. ComfyUI-GGUF's
converter stores some tensors reshaped (e.g. to ``(n / 256, 256)`` so that K-quant blocks fit, or to fit GGUF's
4 dimensions) and records the real torch shape in the metadata key ``comfy.gguf.orig_shape.<tensor name>``;
that shape wins when present (the element order is unchanged by such a reshape).

Needs the optional `gguf` package (``pip install gguf``) at read time only; dequantization and the linear
modules work without it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Union

import torch

from .dequant import dequantize, raw_nbytes
from .format import PLAIN_DTYPES, QUANT_SIZES, GGUFError, QType, as_qtype, qtype_name, supported_names

ORIG_SHAPE_KEY = "comfy.gguf.orig_shape."  # + tensor name: ComfyUI-GGUF's record of a reshaped tensor's shape
GGUF_MAGIC = b"GGUF"


class GGUFPackageMissing(GGUFError, ImportError):
    """The optional `gguf` package is not installed (catchable as GGUFError or ImportError)."""


@dataclass(frozen=True)
class GGUFTensor:
    """One quantized tensor as stored: ``raw`` uint8 block bytes, the GGML type, the logical torch ``shape``."""

    raw: torch.Tensor
    qtype: QType
    shape: torch.Size

    def __post_init__(self):
        # normalise a gguf.GGMLQuantizationType / int and a tuple shape, so that .name and == work everywhere
        object.__setattr__(self, "qtype", as_qtype(self.qtype, "GGUFTensor"))
        object.__setattr__(self, "shape", torch.Size(self.shape))
        if self.qtype not in QUANT_SIZES:
            raise GGUFError(f"GGUFTensor holds quantized data; {qtype_name(self.qtype)} is not a quantized type")
        if self.raw.dtype != torch.uint8:
            raise GGUFError(f"GGUFTensor.raw must be uint8 block bytes, got {self.raw.dtype}")
        need = raw_nbytes(self.qtype, self.shape)
        if self.raw.numel() != need:
            raise GGUFError(f"{self.qtype.name} tensor of shape {tuple(self.shape)} takes {need} bytes, "
                            f"raw has {self.raw.numel()}")

    @property
    def block_size(self) -> int:
        return QUANT_SIZES[self.qtype][0]

    @property
    def type_size(self) -> int:
        return QUANT_SIZES[self.qtype][1]

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    @property
    def device(self) -> torch.device:
        return self.raw.device

    def dequantize(self, dtype: torch.dtype = torch.bfloat16, device=None) -> torch.Tensor:
        """The values as a ``shape`` tensor of ``dtype`` (on ``device``, default: where ``raw`` is)."""
        raw = self.raw if device is None else self.raw.to(device)
        return dequantize(raw, self.qtype, self.shape, dtype)

    def to(self, device=None, non_blocking: bool = False) -> "GGUFTensor":
        """The same tensor with ``raw`` on ``device`` (bytes unchanged)."""
        return GGUFTensor(self.raw.to(device, non_blocking=non_blocking), self.qtype, self.shape)

    def __repr__(self) -> str:
        return (f"GGUFTensor({self.qtype.name}, shape={tuple(self.shape)}, {self.nbytes} bytes, "
                f"device={self.raw.device})")


def _import_gguf(path: str):
    try:
        import gguf
    except ImportError as e:
        raise GGUFPackageMissing(
            f"{path}: reading GGUF files needs the optional `gguf` package, which is not installed: "
            "pip install gguf (into the Python that runs ComfyUI)") from e
    return gguf


def _check_magic(path: str) -> int:
    """The file size; GGUFError if the file does not start like a GGUF file (with a hint at what it is)."""
    size = os.path.getsize(path)  # FileNotFoundError names the path
    with open(path, "rb") as f:
        head = f.read(16)
    if head[:4] == GGUF_MAGIC:
        return size
    if size == 0:
        raise GGUFError(f"{path}: not a GGUF file: the file is empty (an interrupted download?); download it again")
    if size < len(GGUF_MAGIC) and GGUF_MAGIC.startswith(head):
        raise GGUFError(f"{path}: the GGUF file is truncated ({size} bytes): download it again")
    if len(head) >= 9 and head[8:9] == b"{":
        what = "it looks like a .safetensors file; load it with the safetensors loader"
    elif head[:4] == b"PK\x03\x04":
        what = "it looks like a PyTorch .pt/.pth (zip) checkpoint; load it with the checkpoint loader"
    elif head[:1] == b"\x80":
        what = "it looks like a pickled (legacy PyTorch) checkpoint"
    elif all(32 <= c < 127 or c in b"\t\r\n" for c in head):
        what = "it is text (an HTML error page or a Git LFS pointer instead of the model?); download it again"
    else:
        what = "download the .gguf file again or pick the right file"
    raise GGUFError(f"{path}: not a GGUF file (it starts with {head[:8]!r}, a GGUF file with {GGUF_MAGIC!r}); {what}")


def _open(gguf, path: str, size: int):
    """``gguf.GGUFReader`` over a copy-on-write mapping, its failures turned into GGUFErrors that say what to do."""
    try:
        return gguf.GGUFReader(path, "c")
    except Exception as e:  # noqa: BLE001 - the reader signals every problem with plain exceptions
        msg = str(e)
        if "GGMLQuantizationType" in msg:
            raise GGUFError(
                f"{path}: a tensor has a GGML type this `gguf` package does not know ({msg}); the file is newer than "
                f"the package (pip install -U gguf) or corrupt. This pack decodes: {supported_names()}") from e
        if "version" in msg:
            raise GGUFError(f"{path}: unsupported GGUF version ({msg}); pip install -U gguf, or re-convert the file"
                            ) from e
        raise GGUFError(
            f"{path}: the GGUF file is truncated or corrupt ({size} bytes; reader: {type(e).__name__}: {msg}); "
            "an interrupted download leaves a short file: download it again") from e


def _field_value(field) -> Any:
    try:
        return field.contents()
    except Exception:  # noqa: BLE001 - a metadata value we cannot decode is reported as None, not fatal
        return None


def _orig_shape(metadata: dict, name: str, path: str) -> tuple[int, ...] | None:
    value = metadata.get(ORIG_SHAPE_KEY + name)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
        raise GGUFError(f"{path}: metadata {ORIG_SHAPE_KEY + name!r} should be a list of ints, got {value!r}")
    return tuple(value)


TensorOrGGUF = Union[torch.Tensor, GGUFTensor]


def read_gguf(path: str | os.PathLike) -> tuple[dict[str, TensorOrGGUF], dict[str, Any]]:
    """Tensors and metadata of a GGUF file, zero-copy from a memory mapping.

    Returns ``(tensors, metadata)``: ``tensors[name]`` is a ``GGUFTensor`` for a quantized tensor (Q8_0, Q4_K,
    ...) or a plain torch tensor (F32 -> float32, F16 -> float16, BF16 -> bfloat16, ...) in its logical torch
    shape; ``metadata`` maps each key-value field of the file (``general.architecture``, ...) to its value.
    Raises ``GGUFError`` (a ValueError) naming the file and the fix: not a GGUF file, truncated, a tensor type
    this pack cannot decode, the `gguf` package missing (``GGUFPackageMissing``, also an ImportError).
    """
    path = os.fspath(path)
    gguf = _import_gguf(path)
    size = _check_magic(path)
    reader = _open(gguf, path, size)
    if reader.byte_order != "I":
        raise GGUFError(f"{path}: a big-endian GGUF file; this pack reads little-endian GGUF files only "
                        "(the usual kind: re-download the standard file)")
    metadata = {name: _field_value(f) for name, f in reader.fields.items()}

    known = set(PLAIN_DTYPES) | set(QUANT_SIZES)
    unsupported = [(t.name, qtype_name(t.tensor_type)) for t in reader.tensors if int(t.tensor_type) not in known]
    if unsupported:
        listed = ", ".join(f"{n} ({q})" for n, q in unsupported[:5]) + (" ..." if len(unsupported) > 5 else "")
        raise GGUFError(f"{path}: {len(unsupported)} tensor(s) use GGML types this pack cannot decode: {listed}. "
                        f"Supported: {supported_names()}; use a file in one of these quantizations")

    tensors: dict[str, TensorOrGGUF] = {}
    for t in reader.tensors:
        q = QType(int(t.tensor_type))
        stored = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise GGUFError(f"{path}: truncated: tensor {t.name!r} ends at byte {end}, the file has {size}; "
                            "download it again")
        shape = _orig_shape(metadata, t.name, path) or stored
        if raw_nbytes(q, shape) != int(t.n_bytes):
            raise GGUFError(f"{path}: tensor {t.name!r}: shape {shape} does not match its {t.n_bytes} bytes of "
                            f"{q.name}")
        data = torch.from_numpy(t.data)  # a view of the mapping: no copy
        if q in PLAIN_DTYPES:
            if data.dtype != PLAIN_DTYPES[q]:  # BF16 comes as bytes from the reader
                data = data.reshape(-1).view(PLAIN_DTYPES[q])
            tensors[t.name] = data.reshape(shape)
        else:
            tensors[t.name] = GGUFTensor(data, q, torch.Size(shape))
    return tensors, metadata
