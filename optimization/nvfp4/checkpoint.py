"""Quantized checkpoints: ComfyUI's NVFP4 / FP8 format, nvidia-modelopt NVFP4 exports, a streaming writer.

ComfyUI format (current Comfy-Org/ComfyUI ``comfy/ops.py`` + ``comfy/quant_ops.py`` + ``comfy/utils.py``), per
quantized linear ``L``:

* ``L.weight``          uint8 ``[roundup(N,16), roundup(K,16)/2]``, nibble order hi_first (comfy-kitchen default)
* ``L.weight_scale``    float8_e4m3fn ``[roundup(N,128), roundup(K/16,4)]``, 128x4 swizzled
* ``L.weight_scale_2``  float32 0-d (the global scale, amax/(6*448))
* ``L.input_scale``     float32 0-d, optional (static activation global scale)
* ``L.bias``            optional, high precision
* ``L.comfy_quant``     uint8 tensor holding the UTF-8 JSON ``{"format": "nvfp4"}``; ComfyUI's
  ``MixedPrecisionOps.Linear._load_from_state_dict`` pops it and reads ``format`` (and optionally
  ``full_precision_matrix_mult``). We add ``"nibble_order": "hi_first"`` (ignored by ComfyUI).
* File-level safetensors metadata ``_quantization_metadata`` = ``{"format_version": "1.0", "layers":
  {"L": {"format": "nvfp4"}}}`` (older files; ``comfy.utils.convert_old_quants`` turns it into the per-layer
  markers). The writer emits both, with identical layer names.

FP8 (ComfyUI ``float8_e4m3fn`` format, also the widely shared SeedVR2 fp8 files): ``L.weight`` float8_e4m3fn
``[N, K]``, ``L.weight_scale`` fp32 (0-d; absent in plain-cast files = scale 1), optional ``L.input_scale``,
marker ``{"format": "float8_e4m3fn"}``. Legacy ``scale_weight`` / ``scale_input`` names are accepted.

nvidia-modelopt NVFP4 HF export (``NVFP4QTensor.quantize``): ``L.weight`` uint8 ``[N, Kp/2]`` **lo_first**,
``L.weight_scale`` float8_e4m3fn flat ``[N, Kp/16]`` (not swizzled unless exported with
``enable_swizzle_layout``), ``L.weight_scale_2`` fp32, ``L.input_scale`` fp32, optional ``L.pre_quant_scale``
(AWQ smoothing; multiplied into the activation). TensorRT-LLM-style names ``weights_scaling_factor``,
``weights_scaling_factor_2``, ``activation_scaling_factor`` are accepted too. These are converted to the
internal convention (hi_first, rows padded to 16, swizzled) when loaded.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Iterable, Mapping

import torch

from . import format as fmt
from .format import NVFP4Tensor, roundup

NVFP4_FORMAT = "nvfp4"
FP8_FORMAT = "float8_e4m3fn"
MXFP8_FORMAT = "mxfp8"                         # mxfp8.py: layout and layer
INT8_FORMATS = ("int8_tensorwise", "int8")     # int8.py: ConvRot layout and layer; the first is ComfyUI's name
KNOWN_FORMATS = (NVFP4_FORMAT, FP8_FORMAT, "float8_e5m2", MXFP8_FORMAT) + INT8_FORMATS
PACK_METADATA_KEY = "seedvr2bw_quant"

_ALIASES = {
    "weight_scale": ("weight_scale", "weights_scaling_factor"),
    "weight_scale_2": ("weight_scale_2", "weights_scaling_factor_2"),
    "input_scale": ("input_scale", "activation_scaling_factor", "scale_input"),
}

_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


# ----------------------------------------------------------------------------------------------------------
# markers
# ----------------------------------------------------------------------------------------------------------
def comfy_quant_tensor(conf: Mapping) -> torch.Tensor:
    return torch.tensor(list(json.dumps(dict(conf)).encode("utf-8")), dtype=torch.uint8)


def read_comfy_quant(t: torch.Tensor) -> dict:
    return json.loads(bytes(t.cpu().to(torch.uint8).tolist()).decode("utf-8"))


def quantization_metadata(layers: Mapping[str, Mapping]) -> str:
    return json.dumps({"format_version": "1.0", "layers": {k: dict(v) for k, v in layers.items()}})


def _get(sd: Mapping, key: str, name: str):
    for alias in _ALIASES.get(name, (name,)):
        v = sd.get(f"{key}.{alias}")
        if v is not None:
            return v
    return None


def layer_conf(sd: Mapping, key: str, metadata: Mapping | None = None) -> dict | None:
    t = sd.get(f"{key}.comfy_quant")
    if t is not None:
        return read_comfy_quant(t)
    if metadata and "_quantization_metadata" in metadata:
        layers = json.loads(metadata["_quantization_metadata"]).get("layers", {})
        v = layers.get(key)
        if isinstance(v, str):
            return {"format": v}
        return v
    return None


def detect_layer_format(sd: Mapping, key: str, metadata: Mapping | None = None) -> str | None:
    """'nvfp4', 'fp8', 'mxfp8', 'int8', 'plain' or None (no weight under ``key``); a ``comfy_quant`` format this
    pack cannot run raises ``ValueError`` naming the layer."""
    w = sd.get(f"{key}.weight")
    if w is None:
        return None
    conf = layer_conf(sd, key, metadata)
    if conf is not None:
        f = conf.get("format")
        if f == NVFP4_FORMAT:
            return "nvfp4"
        if f in (FP8_FORMAT, "float8_e5m2"):
            return "fp8"
        if f == MXFP8_FORMAT:
            return "mxfp8"
        if f in INT8_FORMATS:
            return "int8"
        raise ValueError(f"{key}: quantization format {f!r} (its comfy_quant tensor) is not one this pack loads "
                         f"({', '.join(KNOWN_FORMATS)}); convert the model from its fp16/bf16 file instead")
    if w.dtype == torch.uint8 and _get(sd, key, "weight_scale_2") is not None:
        return "nvfp4"
    if w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return "fp8"
    return "plain"


# ----------------------------------------------------------------------------------------------------------
# NVFP4 layers
# ----------------------------------------------------------------------------------------------------------
def detect_nvfp4_source(sd: Mapping, key: str, metadata: Mapping | None = None) -> str:
    """'comfy' (hi_first, swizzled) or 'modelopt' (lo_first, flat scales) or 'modelopt_swizzled'."""
    conf = layer_conf(sd, key, metadata)
    if sd.get(f"{key}.comfy_quant") is not None or (conf is not None and metadata
                                                     and "_quantization_metadata" in metadata):
        if conf and conf.get("nibble_order") == "lo_first":
            return "modelopt_swizzled"
        return "comfy"
    meta = dict(metadata or {})
    if PACK_METADATA_KEY in meta:
        return "comfy"
    packed = sd[f"{key}.weight"]
    scale = _get(sd, key, "weight_scale")
    rows, nb = packed.shape[0], packed.shape[1] * 2 // 16
    if tuple(scale.shape) != (rows, nb) and tuple(scale.shape) == fmt.swizzled_scale_shape(rows, nb):
        return "modelopt_swizzled"
    return "modelopt"


def load_nvfp4_layer(sd: Mapping, key: str, out_features: int | None = None, in_features: int | None = None,
                     source: str = "auto", metadata: Mapping | None = None) -> dict:
    """Read one NVFP4 layer into the internal convention.

    Returns ``{"weight": NVFP4Tensor, "bias": tensor|None, "input_scale": tensor|None,
    "pre_quant_scale": tensor|None, "source": str}``.
    """
    if source == "auto":
        source = detect_nvfp4_source(sd, key, metadata)
    packed = sd[f"{key}.weight"]
    scale = _get(sd, key, "weight_scale")
    g = _get(sd, key, "weight_scale_2")
    if packed is None or scale is None or g is None:
        raise KeyError(f"{key}: NVFP4 layer needs weight, weight_scale and weight_scale_2")
    packed = packed.view(torch.uint8) if packed.dtype != torch.uint8 else packed
    scale = scale.view(torch.float8_e4m3fn) if scale.dtype == torch.uint8 else scale.to(torch.float8_e4m3fn)
    rows, half = packed.shape
    cols = half * 2
    n = out_features or rows
    k = in_features or cols
    pr, pc = roundup(rows, 16), roundup(cols, 16)
    nb = pc // 16
    if source == "comfy":
        swz = scale.reshape(fmt.swizzled_scale_shape(rows, cols // 16))
    else:
        packed = fmt.swap_nibbles(packed)
        if source == "modelopt":
            flat = scale.reshape(rows, cols // 16)
        elif source == "modelopt_swizzled":
            flat = fmt.unswizzle_block_scales(scale, rows, cols // 16)
        else:
            raise ValueError(f"unknown NVFP4 source {source!r}")
        if (pr, pc) != (rows, cols):
            packed = torch.nn.functional.pad(packed, (0, (pc - cols) // 2, 0, pr - rows))
            f2 = torch.zeros((pr, nb), dtype=torch.float8_e4m3fn)
            f2[:rows, : cols // 16] = flat
            flat = f2
        swz = fmt.swizzle_block_scales(flat)
    t = NVFP4Tensor(packed.contiguous(), swz.contiguous(), g.float().reshape(()).clone(), (n, k))
    return {"weight": t, "bias": sd.get(f"{key}.bias"), "input_scale": _opt_scalar(_get(sd, key, "input_scale")),
            "pre_quant_scale": sd.get(f"{key}.pre_quant_scale"), "source": source}


def _opt_scalar(t):
    if t is None:
        return None
    t = t.float()
    if t.numel() != 1:
        return t
    return t.reshape(())


def nvfp4_layer_entries(key: str, t: NVFP4Tensor, bias: torch.Tensor | None = None,
                        input_scale: torch.Tensor | None = None, marker: bool = True) -> dict:
    """State-dict entries of one NVFP4 layer in ComfyUI's format (internal convention == ComfyUI's)."""
    out = {f"{key}.weight": t.packed, f"{key}.weight_scale": t.block_scale,
           f"{key}.weight_scale_2": t.global_scale.float().reshape(())}
    if input_scale is not None:
        out[f"{key}.input_scale"] = input_scale.float().reshape(())
    if bias is not None:
        out[f"{key}.bias"] = bias
    if marker:
        out[f"{key}.comfy_quant"] = comfy_quant_tensor({"format": NVFP4_FORMAT, "nibble_order": fmt.NIBBLE_ORDER})
    return out


# ----------------------------------------------------------------------------------------------------------
# FP8 layers
# ----------------------------------------------------------------------------------------------------------
def load_fp8_layer(sd: Mapping, key: str) -> dict:
    w = sd[f"{key}.weight"]
    scale = _get(sd, key, "weight_scale")
    if scale is None:
        scale = sd.get(f"{key}.scale_weight")
    if scale is None:
        scale = torch.ones((), dtype=torch.float32)
    return {"weight": w, "weight_scale": scale.float().reshape(()) if scale.numel() == 1 else scale.float(),
            "bias": sd.get(f"{key}.bias"), "input_scale": _opt_scalar(_get(sd, key, "input_scale"))}


def fp8_layer_entries(key: str, w8: torch.Tensor, scale: torch.Tensor, bias=None, input_scale=None,
                      marker: bool = True) -> dict:
    out = {f"{key}.weight": w8, f"{key}.weight_scale": scale.float()}
    if input_scale is not None:
        out[f"{key}.input_scale"] = input_scale.float().reshape(())
    if bias is not None:
        out[f"{key}.bias"] = bias
    if marker:
        out[f"{key}.comfy_quant"] = comfy_quant_tensor({"format": FP8_FORMAT})
    return out


# ----------------------------------------------------------------------------------------------------------
# MXFP8 and INT8 (ConvRot) layers
# ----------------------------------------------------------------------------------------------------------
def load_mxfp8_layer(sd: Mapping, key: str) -> dict:
    """``{"weight": e4m3 [Np, Kp], "weight_scale": uint8 swizzled E8M0, "bias"}`` of one ComfyUI MXFP8 layer."""
    w, s = sd[f"{key}.weight"], sd.get(f"{key}.weight_scale")
    if s is None:
        raise KeyError(f"{key}: an mxfp8 layer needs {key}.weight_scale (its E8M0 block scales)")
    if w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{key}.weight: an mxfp8 weight is float8_e4m3fn, the file holds {w.dtype}")
    if s.element_size() != 1:
        raise ValueError(f"{key}.weight_scale: mxfp8 block scales are one byte each (uint8 E8M0), got {s.dtype}")
    return {"weight": w, "weight_scale": s.view(torch.uint8), "bias": sd.get(f"{key}.bias")}


def int8_convrot_group(conf: Mapping | None) -> int | None:
    """The ConvRot group size an int8 layer's ``comfy_quant`` asks for (None without ConvRot); the keys may sit
    under ``"params"`` as some writers put them."""
    conf = dict(conf or {})
    params = conf.get("params") if isinstance(conf.get("params"), dict) else {}
    if not conf.get("convrot", params.get("convrot", False)):
        return None
    return int(conf.get("convrot_groupsize", params.get("convrot_groupsize", 256)))


def load_int8_layer(sd: Mapping, key: str, metadata: Mapping | None = None) -> dict:
    """``{"weight": int8 [N, K], "weight_scale": float32, "bias", "convrot_group"}`` of one ComfyUI int8 layer."""
    w, s = sd[f"{key}.weight"], sd.get(f"{key}.weight_scale")
    if s is None:
        raise KeyError(f"{key}: an int8 layer needs {key}.weight_scale")
    if w.dtype != torch.int8:
        raise ValueError(f"{key}.weight: an int8 layer's weight is int8, the file holds {w.dtype}")
    return {"weight": w, "weight_scale": s.float(), "bias": sd.get(f"{key}.bias"),
            "convrot_group": int8_convrot_group(layer_conf(sd, key, metadata))}


# ----------------------------------------------------------------------------------------------------------
# Streaming safetensors writer
# ----------------------------------------------------------------------------------------------------------
def tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    return t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.uint8 else t.numpy().tobytes()


def _header_bytes(plan: Iterable[tuple[str, torch.dtype, tuple]], metadata: Mapping[str, str] | None):
    header = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    off = 0
    sizes = []
    for name, dtype, shape in plan:
        n = 1
        for s in shape:
            n *= int(s)
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": [int(s) for s in shape], "data_offsets": [off, off + nbytes]}
        sizes.append((name, nbytes))
        off += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * ((8 - len(raw) % 8) % 8)
    return struct.pack("<Q", len(raw)) + raw, sizes, off


class StreamingSafetensorsWriter:
    """Writes a safetensors file tensor by tensor, never holding more than one tensor in memory.

    The header needs every tensor's dtype and shape, so the caller gives the *plan* (name, dtype, shape) up
    front; ``write(name, tensor)`` then appends tensors in plan order to ``<path>.tmp``; ``close()`` checks
    that everything was written, fsyncs, and ``os.replace``s the temp file onto ``path`` (atomic). On an
    exception inside a ``with`` block (or ``abort()``), the temp file is removed and ``path`` is untouched.
    """

    def __init__(self, path: str, plan: list[tuple[str, torch.dtype, tuple]], metadata: Mapping[str, str] | None = None):
        self.path = str(path)
        self.tmp = self.path + ".tmp"
        header, self._sizes, self.total_data_bytes = _header_bytes(plan, metadata)
        self._i = 0
        self._f = open(self.tmp, "wb")
        self._f.write(header)
        self.bytes_written = len(header)

    def write(self, name: str, tensor: torch.Tensor):
        if self._i >= len(self._sizes):
            raise ValueError(f"{name}: more tensors than planned")
        want, nbytes = self._sizes[self._i]
        if name != want:
            raise ValueError(f"tensor {name!r} written out of plan order (expected {want!r})")
        data = tensor_bytes(tensor)
        if len(data) != nbytes:
            raise ValueError(f"{name}: {len(data)} bytes, plan says {nbytes}")
        self._f.write(data)
        self.bytes_written += len(data)
        self._i += 1

    def close(self):
        if self._f is None:
            return
        if self._i != len(self._sizes):
            self.abort()
            raise ValueError(f"only {self._i} of {len(self._sizes)} planned tensors were written")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        self._f = None
        os.replace(self.tmp, self.path)

    def abort(self):
        if self._f is not None:
            self._f.close()
            self._f = None
        if os.path.exists(self.tmp):
            os.remove(self.tmp)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort()
        else:
            self.close()
        return False


def save_state_dict(path: str, sd: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None):
    """Write a whole state dict through the streaming writer (atomic)."""
    plan = [(k, v.dtype, tuple(v.shape)) for k, v in sd.items()]
    with StreamingSafetensorsWriter(path, plan, metadata) as w:
        for k, v in sd.items():
            w.write(k, v)


def load_state_dict(path: str, device: str = "cpu") -> tuple[dict, dict]:
    """(state dict, header metadata) of a safetensors file."""
    from safetensors import safe_open
    with safe_open(str(path), framework="pt", device=device) as f:
        meta = f.metadata() or {}
        return {k: f.get_tensor(k) for k in f.keys()}, meta
