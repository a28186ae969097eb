"""Streaming bf16/fp16/fp32/fp8 safetensors -> NVFP4, MXFP8 or FP8 converter, ComfyUI's checkpoint format.

Tensor by tensor: each source tensor is read with ``safe_open``, quantized on ``device`` and appended to the
output through ``StreamingSafetensorsWriter`` (header planned up front, temp file, ``os.replace``), so peak
host memory is about one tensor, never a model copy. Used by ``scripts/convert_to_nvfp4.py`` and the
ComfyUI node in ``nodes/nvfp4.py``.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import torch

from . import format as fmt
from .checkpoint import (FP8_FORMAT, MXFP8_FORMAT, NVFP4_FORMAT, PACK_METADATA_KEY, StreamingSafetensorsWriter,
                         comfy_quant_tensor, quantization_metadata, read_comfy_quant)
from .mxfp8 import MX_BLOCK, quantize_mxfp8
from .surgery import make_keep_rule

_AUX = ("weight_scale", "weight_scale_2", "input_scale", "scale_weight", "scale_input", "comfy_quant",
        "weights_scaling_factor", "weights_scaling_factor_2", "activation_scaling_factor")
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
TARGETS = ("nvfp4", "mxfp8", "fp8")


@dataclass
class ConversionSummary:
    source: str
    output: str
    target: str
    quantized: list = field(default_factory=list)
    kept: list = field(default_factory=list)
    passthrough: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    params_quantized: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["ratio"] = self.bytes_after / self.bytes_before if self.bytes_before else None
        return d

    def text(self) -> str:
        gib = 1024 ** 3
        return (f"{os.path.basename(self.source)} -> {os.path.basename(self.output)} ({self.target}): "
                f"{len(self.quantized)} layers quantized ({self.params_quantized / 1e9:.3f} B params), "
                f"{len(self.kept)} linear-like weights kept in high precision, {self.passthrough} other tensors "
                f"copied; size {self.bytes_before / gib:.3f} GiB -> {self.bytes_after / gib:.3f} GiB "
                f"({100 * self.bytes_after / max(self.bytes_before, 1):.1f}%) in {self.seconds:.1f} s")


def _source_conf(f, keys: set, layer: str):
    k = f"{layer}.comfy_quant"
    if k in keys:
        return read_comfy_quant(f.get_tensor(k))
    return None


def _load_source_weight(f, keys: set, layer: str, meta_layers: dict) -> tuple[torch.Tensor, str]:
    """Source weight of ``layer`` as a float tensor plus its source format ('float', 'fp8', 'nvfp4')."""
    w = f.get_tensor(f"{layer}.weight")
    conf = _source_conf(f, keys, layer) or meta_layers.get(layer)
    if isinstance(conf, str):
        conf = {"format": conf}
    if w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        scale = None
        for n in ("weight_scale", "scale_weight"):
            if f"{layer}.{n}" in keys:
                scale = f.get_tensor(f"{layer}.{n}").float()
        w = w.float()
        if scale is not None:
            w = w * (scale.reshape(-1, 1) if scale.numel() > 1 else scale)
        return w, "fp8"
    if w.dtype == torch.uint8 and (conf or {}).get("format") == NVFP4_FORMAT or f"{layer}.weight_scale_2" in keys:
        return w, "nvfp4"
    return w, "float"


def _is_candidate(key: str, shape, dtype) -> bool:
    return key.endswith(".weight") and len(shape) == 2 and (dtype in _FLOATS or dtype in (torch.float8_e4m3fn,
                                                                                           torch.float8_e5m2))


def convert_file(src: str, dst: str, target: str = "nvfp4", keep=None, device: str = "cpu",
                 recipe: str = "comfy", keep_dtype: torch.dtype | None = None,
                 progress: Callable[[int, int, str], None] | None = None,
                 check_interrupt: Callable[[], None] | None = None) -> ConversionSummary:
    """Convert ``src`` to ``dst`` (NVFP4, MXFP8 or FP8 E4M3 per-tensor, ComfyUI format). See the module docstring.

    ``keep``: keep rule (None = defaults, see ``linear.make_keep_rule``). ``keep_dtype``: cast kept/copied
    floating tensors to this dtype (None = unchanged; fp8 weights of kept layers are dequantized to bf16).
    ``progress(i, n, key)`` is called per source tensor; ``check_interrupt()`` may raise to abort (the
    output file is then left untouched).
    """
    from safetensors import safe_open
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    t0 = time.time()
    rule = make_keep_rule(keep)
    summary = ConversionSummary(source=str(src), output=str(dst), target=target,
                                bytes_before=os.path.getsize(src))
    with safe_open(str(src), framework="pt", device="cpu") as f:
        keys = list(f.keys())
        keyset = set(keys)
        meta = dict(f.metadata() or {})
        meta_layers = {}
        if "_quantization_metadata" in meta:
            meta_layers = json.loads(meta.pop("_quantization_metadata")).get("layers", {})

        # ---- 1. plan: decide each layer, compute every output tensor's dtype and shape -------------------
        layers = {}     # layer -> "quantize" | "keep"
        for k in keys:
            if not k.endswith(".weight"):
                continue
            sl = f.get_slice(k)
            shape, dtype = tuple(sl.get_shape()), _st_dtype(sl.get_dtype())
            layer = k[: -len(".weight")]
            is_nvfp4 = dtype == torch.uint8 and f"{layer}.weight_scale_2" in keyset
            if not (is_nvfp4 or _is_candidate(k, shape, dtype)):
                continue
            k_in = shape[1] * 2 if is_nvfp4 else shape[1]
            mod = SimpleNamespace(in_features=k_in, out_features=shape[0])
            layers[layer] = "keep" if (rule(layer, mod) and not is_nvfp4) else "quantize"
            if is_nvfp4:
                layers[layer] = "nvfp4_passthrough"
        aux_of = {}
        for layer in layers:
            for a in _AUX:
                if f"{layer}.{a}" in keyset:
                    aux_of[f"{layer}.{a}"] = layer

        plan, work = [], []   # work items: (kind, key_or_layer)
        marker_nv = comfy_quant_tensor({"format": NVFP4_FORMAT, "nibble_order": fmt.NIBBLE_ORDER})
        marker_f8 = comfy_quant_tensor({"format": FP8_FORMAT})
        marker_mx = comfy_quant_tensor({"format": MXFP8_FORMAT})
        for k in keys:
            if k == "scaled_fp8" or k.endswith(".scaled_fp8"):
                continue
            if k in aux_of:
                layer = aux_of[k]
                if layers[layer] == "nvfp4_passthrough":
                    plan.append((k, *_meta_of(f, k)))
                    work.append(("copy", k))
                continue
            layer = k[: -len(".weight")] if k.endswith(".weight") else None
            action = layers.get(layer)
            if action == "quantize":
                sl = f.get_slice(k)
                n, kk = sl.get_shape()
                if target == "nvfp4":
                    pr, pc = fmt.roundup(n, 16), fmt.roundup(kk, 16)
                    plan += [(f"{layer}.weight", torch.uint8, (pr, pc // 2)),
                             (f"{layer}.weight_scale", torch.float8_e4m3fn, fmt.swizzled_scale_shape(pr, pc // 16)),
                             (f"{layer}.weight_scale_2", torch.float32, ()),
                             (f"{layer}.comfy_quant", torch.uint8, tuple(marker_nv.shape))]
                elif target == "mxfp8":
                    pr, pc = fmt.roundup(n, MX_BLOCK), fmt.roundup(kk, MX_BLOCK)
                    plan += [(f"{layer}.weight", torch.float8_e4m3fn, (pr, pc)),
                             (f"{layer}.weight_scale", torch.uint8, fmt.swizzled_scale_shape(pr, pc // MX_BLOCK)),
                             (f"{layer}.comfy_quant", torch.uint8, tuple(marker_mx.shape))]
                else:
                    plan += [(f"{layer}.weight", torch.float8_e4m3fn, (n, kk)),
                             (f"{layer}.weight_scale", torch.float32, ()),
                             (f"{layer}.comfy_quant", torch.uint8, tuple(marker_f8.shape))]
                work.append(("quantize", layer))
            elif action == "keep":
                dtype, shape = _meta_of(f, k)
                if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                    dtype = keep_dtype or torch.bfloat16
                elif keep_dtype is not None and dtype in _FLOATS:
                    dtype = keep_dtype
                plan.append((k, dtype, shape))
                work.append(("keep", layer))
            else:
                dtype, shape = _meta_of(f, k)
                if keep_dtype is not None and dtype in _FLOATS:
                    dtype = keep_dtype
                plan.append((k, dtype, shape))
                work.append(("copy", k))

        layer_format = {"nvfp4": NVFP4_FORMAT, "mxfp8": MXFP8_FORMAT, "fp8": FP8_FORMAT}[target]
        qlayers = {l: {"format": layer_format} for l, a in layers.items() if a == "quantize"}
        qlayers.update({l: {"format": NVFP4_FORMAT} for l, a in layers.items() if a == "nvfp4_passthrough"})
        out_meta = dict(meta)
        out_meta["_quantization_metadata"] = quantization_metadata(qlayers)
        out_meta[PACK_METADATA_KEY] = json.dumps({"target": target, "nibble_order": fmt.NIBBLE_ORDER,
                                                  "recipe": recipe, "source": os.path.basename(str(src))})

        # ---- 2. stream -------------------------------------------------------------------------------------
        n_work = len(work)
        with StreamingSafetensorsWriter(str(dst), plan, out_meta) as writer:
            for i, (kind, name) in enumerate(work):
                if check_interrupt is not None:
                    check_interrupt()
                if kind == "copy":
                    t = f.get_tensor(name)
                    if keep_dtype is not None and t.dtype in _FLOATS:
                        t = t.to(keep_dtype)
                    writer.write(name, t)
                    summary.passthrough += 1
                elif kind == "keep":
                    w, src_fmt = _load_source_weight(f, keyset, name, meta_layers)
                    dtype = [p for p in plan if p[0] == f"{name}.weight"][0][1]
                    writer.write(f"{name}.weight", w.to(dtype))
                    summary.kept.append(name)
                else:
                    w, src_fmt = _load_source_weight(f, keyset, name, meta_layers)
                    if src_fmt == "nvfp4":
                        raise ValueError(f"{name}: already NVFP4")
                    w = w.to(device)
                    if target == "nvfp4":
                        t = fmt.quantize_nvfp4(w, recipe=recipe, return_tensor=True)
                        writer.write(f"{name}.weight", t.packed)
                        writer.write(f"{name}.weight_scale", t.block_scale)
                        writer.write(f"{name}.weight_scale_2", t.global_scale.reshape(()))
                        writer.write(f"{name}.comfy_quant", marker_nv)
                    elif target == "mxfp8":
                        q, sc = quantize_mxfp8(w)
                        writer.write(f"{name}.weight", q)
                        writer.write(f"{name}.weight_scale", sc)
                        writer.write(f"{name}.comfy_quant", marker_mx)
                    else:
                        w8, s = fmt.quantize_fp8_per_tensor(w)
                        writer.write(f"{name}.weight", w8)
                        writer.write(f"{name}.weight_scale", s.reshape(()))
                        writer.write(f"{name}.comfy_quant", marker_f8)
                    summary.quantized.append(name)
                    summary.params_quantized += w.numel()
                    del w
                if progress is not None:
                    progress(i + 1, n_work, name)
    summary.bytes_after = os.path.getsize(dst)
    summary.seconds = time.time() - t0
    return summary


_ST_TO_TORCH = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _st_dtype(s: str) -> torch.dtype:
    return _ST_TO_TORCH[s]


def _meta_of(f, k):
    sl = f.get_slice(k)
    return _st_dtype(sl.get_dtype()), tuple(sl.get_shape())
