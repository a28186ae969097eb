"""``GGUFLinear``: a linear layer whose weight stays in its GGUF blocks, dequantized per call; model surgery.

The weight buffer is named ``weight`` (uint8, ``(n_blocks, type_size)``: the file's bytes in order) so that a
GGUF model's state-dict keys stay those of the file, as the pack's other quantized linears do. Being uint8, it
moves with ``.to(device)`` / ``.cuda()`` and is left alone by ``.to(dtype)`` / ``.half()``, which change only the
bias. ``forward`` dequantizes the whole weight to the input's dtype on the input's device (exact float32 values
cast once, see ``dequant.py``) and calls ``F.linear``: memory holds the blocks plus one transient weight.
"""
from __future__ import annotations

import fnmatch
from typing import Callable, Iterable, Mapping, Union

import torch
import torch.nn.functional as F

from .dequant import dequantize, describe, raw_nbytes
from .format import QUANT_SIZES, GGUFError, QType, as_qtype
from .reader import GGUFTensor

KeepRule = Union[None, Callable[[str, torch.nn.Module], bool], str, Iterable[str]]


class GGUFLinear(torch.nn.Module):
    """``y = x @ W.T + b`` with ``W`` held as GGML blocks (any type of ``format.QUANT_SIZES``)."""

    def __init__(self, in_features: int, out_features: int, qtype: int, bias: bool = True, device=None,
                 dtype: torch.dtype | None = None):
        super().__init__()
        q = as_qtype(qtype, "GGUFLinear")
        if q not in QUANT_SIZES:
            raise GGUFError(f"GGUFLinear holds quantized weights; {q.name} is a plain type (use nn.Linear)")
        self.in_features, self.out_features, self.qtype = int(in_features), int(out_features), q
        size = QUANT_SIZES[q][1]
        n_blocks = raw_nbytes(q, (out_features, in_features)) // size
        self.register_buffer("weight", torch.zeros((n_blocks, size), dtype=torch.uint8, device=device))
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=dtype or torch.float32, device=device),
                                           requires_grad=False)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_gguf(cls, tensor: GGUFTensor, bias: torch.Tensor | None = None, device=None,
                  bias_dtype: torch.dtype | None = None) -> "GGUFLinear":
        """A module over ``tensor``'s blocks (zero-copy when ``device`` is None or already theirs)."""
        if len(tensor.shape) != 2:
            raise GGUFError(f"GGUFLinear needs a 2-D weight, got shape {tuple(tensor.shape)}")
        out_f, in_f = tensor.shape
        m = cls(in_f, out_f, tensor.qtype, bias=False, device="meta")
        raw = tensor.raw if device is None else tensor.raw.to(device)
        m.weight = raw.reshape(-1, m.weight.shape[1])  # buffer assignment (a tensor, registered as buffer)
        if bias is not None:
            if tuple(bias.shape) != (out_f,):
                raise GGUFError(f"bias of shape {tuple(bias.shape)} for a weight of shape {(out_f, in_f)}")
            b = bias.detach().to(device=m.weight.device, dtype=bias_dtype or bias.dtype)
            m.bias = torch.nn.Parameter(b, requires_grad=False)
        return m

    def dequantize_weight(self, dtype: torch.dtype = torch.bfloat16, device=None) -> torch.Tensor:
        """The weight as a dense ``(out_features, in_features)`` tensor of ``dtype`` (on ``device``)."""
        raw = self.weight if device is None else self.weight.to(device, non_blocking=True)
        return dequantize(raw, self.qtype, (self.out_features, self.in_features), dtype)

    def weight_nbytes(self) -> int:
        """Bytes the stored weight takes (the blocks; the bias is not counted)."""
        return self.weight.numel() * self.weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype if x.is_floating_point() else torch.float32
        w = self.dequantize_weight(dtype, None if self.weight.device == x.device else x.device)
        b = None if self.bias is None else self.bias.to(device=x.device, dtype=dtype)
        return F.linear(x, w, b)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"qtype={describe(self.qtype)}")


def make_keep_rule(keep: KeepRule) -> Callable[[str, torch.nn.Module], bool]:
    """``keep`` as a predicate on (module name, module): None keeps nothing quantized-as-dense; a callable is used
    as is; a string or list of strings are fnmatch patterns on the module name (``"*.proj_out"``)."""
    if keep is None:
        return lambda name, module: False
    if callable(keep):
        return keep
    patterns = [keep] if isinstance(keep, str) else list(keep)
    return lambda name, module: any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _float_dtype(module: torch.nn.Module) -> torch.dtype:
    """The module's floating dtype (its weight's), float32 when it has none."""
    w = getattr(module, "weight", None)
    return w.dtype if isinstance(w, torch.Tensor) and w.is_floating_point() else torch.float32


def _as_plain(value, dtype: torch.dtype) -> torch.Tensor:
    """A file tensor as a dense tensor of ``dtype`` (quantized ones dequantized exactly, then cast)."""
    if isinstance(value, GGUFTensor):
        return value.dequantize(dtype)
    return value.to(dtype)


def _set_module(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _load_into(model: torch.nn.Module, key: str, value) -> bool:
    """Load one file tensor into the parameter or buffer ``key`` of ``model`` (cast to its dtype); False if the
    model has no such tensor. A meta tensor is replaced (no storage to copy into); others are copied into."""
    mod_name, _, attr = key.rpartition(".")
    try:
        module = model.get_submodule(mod_name) if mod_name else model
    except AttributeError:
        return False
    is_param = attr in module._parameters
    if not is_param and attr not in module._buffers:
        return False
    current = getattr(module, attr)
    if current is None:
        return False
    dtype = current.dtype if current.is_floating_point() or isinstance(value, GGUFTensor) else None
    new = _as_plain(value, dtype) if dtype is not None else value
    if tuple(new.shape) != tuple(current.shape):
        raise GGUFError(f"{key}: the file holds shape {tuple(new.shape)}, the model expects {tuple(current.shape)} "
                        "(a file for another model size?)")
    if current.device.type == "meta":
        if is_param:
            setattr(module, attr, torch.nn.Parameter(new, requires_grad=current.requires_grad))
        else:
            module._buffers[attr] = new
    else:
        with torch.no_grad():
            current.copy_(new)
    return True


def replace_with_gguf_linears(model: torch.nn.Module, tensors: Mapping[str, Union[torch.Tensor, GGUFTensor]],
                              keep: KeepRule = None, prefix: str = "") -> dict[str, list[str]]:
    """Load ``tensors`` (from ``read_gguf``) into ``model``, keeping quantized linear weights quantized.

    Every ``nn.Linear`` whose ``<prefix><name>.weight`` is a ``GGUFTensor`` becomes a ``GGUFLinear`` over those
    blocks (on the module's device; a meta module takes the blocks where they are, i.e. the file mapping), with
    the file's bias in the module's dtype. Linears the ``keep`` rule selects (see ``make_keep_rule``) and every
    other tensor of the file are loaded into the existing modules, dequantized exactly if quantized and cast to
    the model's dtype. Returns ``{"gguf", "kept", "plain", "other", "missing", "unexpected"}``: module names
    (``gguf``, ``kept``, ``plain`` linears), state-dict keys loaded otherwise, model keys the file lacks, file
    keys the model lacks. Shape mismatches raise GGUFError naming the key.
    """
    keep_rule = make_keep_rule(keep)
    report: dict[str, list[str]] = {k: [] for k in ("gguf", "kept", "plain", "other", "missing", "unexpected")}
    used: set[str] = set()
    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear):
            continue
        key = prefix + name
        w = tensors.get(key + ".weight")
        if w is None:
            continue  # reported as missing below
        b = tensors.get(key + ".bias")
        used.add(key + ".weight")
        if b is not None:
            used.add(key + ".bias")
        if tuple(w.shape) != (module.out_features, module.in_features):
            raise GGUFError(f"{key}.weight: the file holds shape {tuple(w.shape)}, the model expects "
                            f"{(module.out_features, module.in_features)} (a file for another model size?)")
        if (b is None) != (module.bias is None) and b is not None:
            raise GGUFError(f"{key}.bias: the file has a bias, the model's linear has none")
        if isinstance(w, GGUFTensor) and name and not keep_rule(name, module):  # (a root Linear cannot be swapped)
            device = None if module.weight.device.type == "meta" else module.weight.device
            dtype = _float_dtype(module)
            bias = _as_plain(b, dtype) if b is not None else module.bias
            if bias is not None and bias.device.type == "meta":
                raise GGUFError(f"{key}.bias: the model's linear has a bias, the file has none")
            new = GGUFLinear.from_gguf(w, bias, device=device, bias_dtype=dtype)
            _set_module(model, name, new)
            report["gguf"].append(name)
            continue
        _load_into(model, name + ".weight", w)
        if b is not None:
            _load_into(model, name + ".bias", b)
        report["kept" if isinstance(w, GGUFTensor) else "plain"].append(name)
    for key, value in tensors.items():
        if key in used:
            continue
        if not key.startswith(prefix) or not _load_into(model, key[len(prefix):], value):
            report["unexpected"].append(key)
        else:
            report["other"].append(key[len(prefix):])
    report["missing"] = [k for k in model.state_dict() if prefix + k not in tensors]
    return report


def gguf_linears(model: torch.nn.Module) -> dict[str, GGUFLinear]:
    """The ``GGUFLinear`` modules of ``model`` by name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, GGUFLinear)}


def summarize(model: torch.nn.Module) -> dict[str, int]:
    """Count of GGUFLinear modules per GGML type name, and their stored bytes (``"bytes"``)."""
    out: dict[str, int] = {}
    for m in gguf_linears(model).values():
        out[QType(m.qtype).name] = out.get(QType(m.qtype).name, 0) + 1
        out["bytes"] = out.get("bytes", 0) + m.weight_nbytes()
    return out
