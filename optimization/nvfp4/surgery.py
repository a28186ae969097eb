"""Model surgery: turn a model's ``nn.Linear`` layers into quantized ones, from a checkpoint (``replace_linears``)
or from the weights in memory (``quantize_model_linears``), and the rule of which layers stay in high precision."""
from __future__ import annotations

import re
from typing import Callable, Mapping

import torch

from .checkpoint import detect_layer_format, load_fp8_layer, load_int8_layer, load_mxfp8_layer, load_nvfp4_layer
from .int8 import Int8Linear, dequantize_int8
from .linear import FP8Linear, NVFP4Linear
from .mxfp8 import MXFP8Linear, dequantize_mxfp8

DEFAULT_KEEP_PATTERNS = (
    r"(^|\.)[^.]*(embed|embedding)[^.]*(\.|$)",                      # embeddings (x_embedder, pos_embed, ...)
    r"(^|\.)(emb_in|time_in|vector_in|guidance_in|t_embedder|y_embedder|time_text_embed|timestep\w*)(\.|$)",
    r"(^|\.)[^.]*norm[^.]*(\.|$)",                                   # norms
    r"(^|\.)(ada\w*|adaln\w*|\w*_mod|mod|modulation|\w*modulation\w*)(\.|$)",  # modulation / adaLN
    r"^(vid_in|vid_out|img_in|txt_in|patch_in|patch_out|patch_embed|final_layer|proj_in|proj_out|"
    r"conv_in|conv_out|x_embedder|norm_out|head)(\.|$)",             # patch-in / patch-out, first / last
)


def make_keep_rule(keep=None) -> Callable[[str, torch.nn.Module], bool]:
    """Build the "keep in high precision" rule.

    ``keep`` may be None (defaults), a callable ``(name, module) -> bool``, or an iterable of regular
    expressions (searched in the module name, case-insensitive) which *replace* the default name patterns.
    Layers whose K (in_features) is not a multiple of 16 are always kept.
    """
    if callable(keep):
        user = keep
    else:
        pats = [re.compile(p, re.IGNORECASE) for p in (DEFAULT_KEEP_PATTERNS if keep is None else keep)]

        def user(name, module):
            return any(p.search(name) for p in pats)

    def rule(name: str, module) -> bool:
        k = getattr(module, "in_features", None)
        if k is None and hasattr(module, "weight"):
            k = module.weight.shape[-1]
        if k is not None and k % 16:
            return True
        return bool(user(name, module))

    return rule


def _set_module(model: torch.nn.Module, name: str, new: torch.nn.Module):
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def replace_linears(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], path: str = "auto",
                    keep_high_precision=None, prefix: str = "", dtype=torch.bfloat16, metadata: Mapping | None = None,
                    nvfp4_source: str = "auto", fp8_mode: str = "cast", load_rest: bool = False) -> dict:
    """Swap every ``nn.Linear`` of ``model`` for the format ``state_dict`` holds for it and load its tensors.

    NVFP4 keys -> ``NVFP4Linear`` with ``path`` ("auto": the hardware policy of the device each layer runs on);
    FP8 weights -> ``FP8Linear``; ComfyUI's ``mxfp8`` -> ``MXFP8Linear`` and ``int8_tensorwise`` (ConvRot) ->
    ``Int8Linear`` (each ``path="auto"``); plain weights are copied into the existing ``nn.Linear``.
    ``keep_high_precision=None`` (default) honours the file's choice for every layer; ``"default"`` applies the
    default keep rule, or give a callable / list of patterns (see ``make_keep_rule``): a layer the rule selects is
    loaded as a plain ``nn.Linear`` in ``dtype`` even if the file holds it quantized (dequantized exactly).
    ``prefix`` is prepended to module names to form state-dict keys. ``load_rest=True`` then loads every
    other matching key with ``load_state_dict(strict=False)``. Returns a report
    ``{"nvfp4": [...], "fp8": [...], "mxfp8": [...], "int8": [...], "plain": [...], "kept": [...], "missing": [...]}``.
    """
    if keep_high_precision is None:
        keep = lambda name, module: False  # noqa: E731 - honour the file
    else:
        keep = make_keep_rule(None if keep_high_precision == "default" else keep_high_precision)
    report = {"nvfp4": [], "fp8": [], "mxfp8": [], "int8": [], "plain": [], "kept": [], "missing": []}
    used = set()
    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear):
            continue
        key = prefix + name
        kind = detect_layer_format(state_dict, key, metadata)
        if kind is None:
            report["missing"].append(name)
            continue
        device = module.weight.device if module.weight.device.type != "meta" else torch.device("cpu")
        used.update(k for k in state_dict if k.startswith(key + "."))
        if kind == "nvfp4":
            d = load_nvfp4_layer(state_dict, key, module.out_features, module.in_features, nvfp4_source, metadata)
            if keep(name, module):
                _load_plain(module, d["weight"].dequantize(torch.float32), d["bias"], dtype, device)
                report["kept"].append(name)
                continue
            new = NVFP4Linear.from_nvfp4(d["weight"].to(device), d["bias"], d["input_scale"], path=path, dtype=dtype,
                                         pre_quant_scale=d["pre_quant_scale"])
            _set_module(model, name, new)
            report["nvfp4"].append(name)
        elif kind == "fp8":
            d = load_fp8_layer(state_dict, key)
            if keep(name, module):
                s = d["weight_scale"]
                w = d["weight"].float() * (s.reshape(-1, 1) if s.numel() > 1 else s)
                _load_plain(module, w, d["bias"], dtype, device)
                report["kept"].append(name)
                continue
            new = FP8Linear.from_fp8(d["weight"].to(device), d["weight_scale"], d["bias"], dtype=dtype, mode=fp8_mode,
                                     input_scale=d["input_scale"])
            _set_module(model, name, new)
            report["fp8"].append(name)
        elif kind == "mxfp8":
            d = load_mxfp8_layer(state_dict, key)
            shape = (module.out_features, module.in_features)
            if keep(name, module):
                _load_plain(module, dequantize_mxfp8(d["weight"], d["weight_scale"], shape=shape), d["bias"], dtype,
                            device)
                report["kept"].append(name)
                continue
            new = MXFP8Linear.from_mxfp8(d["weight"].to(device), d["weight_scale"].to(device), shape, d["bias"],
                                         dtype=dtype)
            _set_module(model, name, new)
            report["mxfp8"].append(name)
        elif kind == "int8":
            d = load_int8_layer(state_dict, key, metadata)
            if keep(name, module):
                w = dequantize_int8(d["weight"], d["weight_scale"], d["convrot_group"])
                _load_plain(module, w, d["bias"], dtype, device)
                report["kept"].append(name)
                continue
            new = Int8Linear.from_int8(d["weight"].to(device), d["weight_scale"].to(device), d["bias"],
                                       d["convrot_group"], dtype=dtype)
            if (new.out_features, new.in_features) != (module.out_features, module.in_features):
                raise ValueError(f"{key}.weight: int8 shape {(new.out_features, new.in_features)}, the model's "
                                 f"linear is {(module.out_features, module.in_features)}")
            _set_module(model, name, new)
            report["int8"].append(name)
        else:
            _load_plain(module, state_dict[key + ".weight"], state_dict.get(key + ".bias"), None, device)
            report["plain"].append(name)
    if load_rest:
        rest = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix) and k not in used}
        model.load_state_dict(rest, strict=False)
    return report


def _load_plain(module: torch.nn.Linear, w, b, dtype, device):
    dtype = dtype or w.dtype
    module.weight = torch.nn.Parameter(w.detach().to(device=device, dtype=dtype), requires_grad=False)
    if b is not None:
        module.bias = torch.nn.Parameter(b.detach().to(device=device, dtype=dtype), requires_grad=False)


def quantize_model_linears(model: torch.nn.Module, path: str = "auto", keep=None, fmt_name: str = "nvfp4",
                           recipe: str = "comfy", fp8_mode: str = "cast") -> dict:
    """Quantize an in-memory model's ``nn.Linear`` layers (NVFP4 or FP8) in place, layer by layer; NVFP4 layers
    get ``path`` (see ``replace_linears``)."""
    rule = make_keep_rule(keep)
    report = {"quantized": [], "kept": []}
    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear):
            continue
        if rule(name, module):
            report["kept"].append(name)
            continue
        if fmt_name == "nvfp4":
            new = NVFP4Linear.from_linear(module, path=path, recipe=recipe, dtype=module.weight.dtype
                                          if module.weight.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16)
        elif fmt_name == "fp8":
            new = FP8Linear.from_linear(module, mode=fp8_mode)
        else:
            raise ValueError(f"format must be 'nvfp4' or 'fp8', got {fmt_name!r}")
        _set_module(model, name, new)
        report["quantized"].append(name)
    return report
