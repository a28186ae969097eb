"""Load SeedVR2 DiT checkpoints by their original key names.

* ``.safetensors`` (official conversions, numz fp16/fp8, ComfyUI quantized, ComfyUI's files with the text
  conditioning baked in), official ``.pth`` (``torch.load(weights_only=True, mmap=True)``) and GGUF (numz's
  Q8_0 / Q4_K_M ...), told apart by content (``files.read_tensors``).
* 3B vs 7B is detected from tensor names/shapes and the config (dims, heads, layers, shared layers) is
  derived from the shapes, so the tiny golden models load through the same path.
* Anything else (the SeedVR2 VAE, FLUX, ...) is rejected with an error naming the file, what was expected
  and what was found.
* fp16/bf16/fp32 weights load as they are (``dtype=`` casts on request). fp8 e4m3 weights, NVFP4 and ComfyUI's
  ``mxfp8`` / ``int8_tensorwise`` ConvRot layers (``weight_scale`` keys, ``comfy_quant`` markers) go through
  ``optimization.nvfp4.surgery.replace_linears``. GGUF linears whose weight is
  quantized become ``GGUFLinear`` (blocks kept, dequantized per forward on the device the layer runs on); the
  file's other tensors are dequantized exactly and load like those of any file.
"""
from __future__ import annotations

import logging
import os
import re
from typing import Dict, Mapping, Optional, Union

import torch

from ....optimization.gguf import GGUFLinear, GGUFTensor
from ....optimization.nvfp4.surgery import make_keep_rule, replace_linears
from ....optimization.runtime import device_cache
from ..files import BAKED_CONDITIONING, read_tensors
from .config import DiTConfig
from .nadit import NaDiT
from .rope import lang_freqs, pixel_freqs

_log = logging.getLogger(__name__)

StateDict = Dict[str, torch.Tensor]
_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n))
_PREFIXES = ("module.", "model.diffusion_model.", "diffusion_model.", "model.", "dit.")
_CORE_KEYS = ("vid_in.proj.weight", "txt_in.weight", "emb_in.proj_out.weight")
# a quantized layer's scales keep their stored precision whatever ``dtype`` the floating weights are cast to
_QUANT_AUX = (".weight_scale", ".weight_scale_2", ".input_scale", ".pre_quant_scale")


class DiTCheckpointError(ValueError):
    """The file is not a SeedVR2 DiT checkpoint (or not a complete one)."""


# --------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------
def read_state_dict(path: Union[str, os.PathLike]) -> StateDict:
    path = os.fspath(path)
    return unwrap_state_dict(read_tensors(path, "SeedVR2 DiT"), source=path)


def unwrap_state_dict(sd, source: str = "state dict") -> StateDict:
    """Accept {'state_dict': ...}/{'model': ...}/{'module': ...} wrappers and common key prefixes."""
    for wrapper in ("state_dict", "model", "module", "ema"):
        if isinstance(sd, Mapping) and wrapper in sd and isinstance(sd[wrapper], Mapping) and len(sd) <= 4:
            sd = sd[wrapper]
    if not isinstance(sd, Mapping):
        raise DiTCheckpointError(f"{source}: expected a dict of tensors, found {type(sd).__name__}")
    sd = {k: v for k, v in sd.items() if isinstance(v, (torch.Tensor, GGUFTensor))}
    for p in _PREFIXES:
        if any(k.startswith(p + "vid_in.") for k in sd):
            sd = {k[len(p):]: v for k, v in sd.items() if k.startswith(p)}
            break
    return sd


# --------------------------------------------------------------------------------------------------
# Detection and config
# --------------------------------------------------------------------------------------------------
def _describe_found(sd: Mapping[str, torch.Tensor]) -> str:
    keys = list(sd)
    sample = ", ".join(f"{k} {tuple(sd[k].shape)}" for k in keys[:6])
    return f"{len(keys)} tensors, e.g. {sample}" if keys else "no tensors"


def _guess_other(sd: Mapping[str, torch.Tensor]) -> Optional[str]:
    keys = list(sd)
    if any(k.startswith(("double_blocks.", "single_blocks.")) for k in keys):
        return "a FLUX transformer (double_blocks/single_blocks)"
    if any(k.startswith(("encoder.", "decoder.")) for k in keys) and any("conv_in" in k for k in keys):
        return "a VAE (encoder./decoder. keys), e.g. the SeedVR2 video VAE: load it with the VAE loader"
    if any(k.startswith(("joint_blocks.", "input_blocks.", "transformer_blocks.")) for k in keys):
        return "another diffusion model (SD/SD3-style keys)"
    if any(k.startswith(("conditioner.", "cond_stage_model.", "text_model.", "encoder.block.")) for k in keys):
        return "a text encoder or full pipeline checkpoint"
    return None


_EXPECTED = (
    "a SeedVR2 DiT: keys vid_in.proj.weight, txt_in.weight, emb_in.proj_out.weight, "
    "blocks.N.attn.proj_qkv.{vid,txt,all}.weight; 3B: blocks.N.mlp.*.proj_in_gate.weight and "
    "vid_out_norm.weight (32 blocks, dim 2560); 7B: blocks.N.mlp.vid.proj_in.bias, no output norm "
    "(36 blocks, dim 3072)"
)


def detect_variant(sd: Mapping[str, torch.Tensor], source: str = "state dict") -> str:
    """'3b' or '7b'; raises :class:`DiTCheckpointError` naming what was expected and found."""
    other = _guess_other(sd)
    missing = [k for k in _CORE_KEYS if k not in sd]
    has_blocks = any(re.match(r"blocks\.0\.attn\.proj_qkv\.(vid|all)\.weight$", k) for k in sd)
    if other is not None or missing or not has_blocks:
        what = f"; it looks like {other}" if other else ""
        miss = f"; missing {missing}" if missing else ""
        raise DiTCheckpointError(
            f"{source}: not a SeedVR2 DiT checkpoint{what}. Expected {_EXPECTED}. "
            f"Found {_describe_found(sd)}{miss}."
        )
    swiglu = any(k.endswith(".proj_in_gate.weight") for k in sd)
    out_norm = "vid_out_norm.weight" in sd
    gelu_bias = any(re.match(r"blocks\.\d+\.mlp\.(vid|txt|all)\.proj_in\.bias$", k) for k in sd)
    if swiglu and out_norm and not gelu_bias:
        return "3b"
    if gelu_bias and not swiglu and not out_norm:
        return "7b"
    raise DiTCheckpointError(
        f"{source}: DiT keys found but the layout is neither SeedVR2-3B nor -7B "
        f"(swiglu MLP: {swiglu}, output norm: {out_norm}, MLP biases: {gelu_bias}). Expected {_EXPECTED}. "
        f"Found {_describe_found(sd)}."
    )


def _in_features(t: torch.Tensor) -> int:
    # NVFP4 packs two 4-bit values per uint8 along K
    return t.shape[1] * 2 if t.dtype == torch.uint8 else t.shape[1]


def config_from_state_dict(sd: Mapping[str, torch.Tensor], source: str = "state dict") -> DiTConfig:
    """Derive the config (variant, dims, heads, layers, shared layers) from the tensors' names/shapes."""
    variant = detect_variant(sd, source)
    dim = sd["vid_in.proj.weight"].shape[0]
    patch = (1, 2, 2)
    in_ch = _in_features(sd["vid_in.proj.weight"]) // (patch[0] * patch[1] * patch[2])
    out_ch = sd["vid_out.proj.weight"].shape[0] // (patch[0] * patch[1] * patch[2])
    block_ids = sorted({int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))})
    num_layers = block_ids[-1] + 1
    if block_ids != list(range(num_layers)):
        raise DiTCheckpointError(f"{source}: blocks are not numbered 0..{num_layers - 1} (found {block_ids[:8]}...)")
    sep = [i for i in block_ids if f"blocks.{i}.attn.proj_qkv.vid.weight" in sd]
    mm_layers = len(sep)
    if sep != list(range(mm_layers)):
        raise DiTCheckpointError(f"{source}: blocks with separate video/text weights are not a prefix: {sep}")
    stream = "vid" if 0 in sep else "all"
    head_dim = sd[f"blocks.0.attn.norm_q.{stream}.weight"].shape[0]
    heads = sd[f"blocks.0.attn.proj_qkv.{stream}.weight"].shape[0] // (3 * head_dim)
    hidden = sd[f"blocks.0.mlp.{stream}.proj_in.weight"].shape[0]
    n_freqs = sd["blocks.0.attn.rope.rope.freqs"].shape[0] if "blocks.0.attn.rope.rope.freqs" in sd else None
    if variant == "3b":
        expand = next((r for r in (4, 1, 2, 3, 5, 6, 8) if 256 * ((int(2 * dim * r / 3) + 255) // 256) == hidden), None)
        if expand is None:
            raise DiTCheckpointError(f"{source}: SwiGLU hidden size {hidden} fits no expand ratio for dim {dim}")
        rope_dim = head_dim if n_freqs in (None, (head_dim // 3) // 2) else 6 * n_freqs
        cfg = DiTConfig(variant="3b", dim=dim, heads=heads, head_dim=head_dim, num_layers=num_layers,
                        txt_in_dim=_in_features(sd["txt_in.weight"]), vid_in_channels=in_ch,
                        vid_out_channels=out_ch, emb_dim=sd["emb_in.proj_out.weight"].shape[0],
                        expand_ratio=expand, mm_layers=mm_layers, rope_dim=rope_dim)
    else:
        if mm_layers != num_layers:
            raise DiTCheckpointError(f"{source}: a 7B DiT keeps separate video/text weights in every block")
        cfg = DiTConfig(variant="7b", dim=dim, heads=heads, head_dim=head_dim, num_layers=num_layers,
                        txt_in_dim=_in_features(sd["txt_in.weight"]), vid_in_channels=in_ch,
                        vid_out_channels=out_ch, emb_dim=sd["emb_in.proj_out.weight"].shape[0],
                        expand_ratio=hidden // dim)
    if n_freqs is not None and n_freqs != cfg.rope_freqs_count:
        raise DiTCheckpointError(f"{source}: RoPE has {n_freqs} frequencies, expected {cfg.rope_freqs_count}")
    return cfg


def is_quantized(sd: Mapping[str, torch.Tensor]) -> bool:
    return any(v.dtype in _FP8 for v in sd.values()) or any(k.endswith("weight_scale") for k in sd)


def _shapes(sd: Mapping[str, object]) -> StateDict:
    """``sd`` with each GGUF tensor as a float meta tensor of its logical shape: detection reads names and shapes."""
    return {k: (torch.empty(v.shape, device="meta") if isinstance(v, GGUFTensor) else v) for k, v in sd.items()}


def _swap_gguf_linears(model: NaDiT, sd: Mapping[str, object], dtype: Optional[torch.dtype], keep_high_precision,
                       source: str) -> set:
    """Turn each ``nn.Linear`` whose weight the file holds in GGML blocks into a ``GGUFLinear`` over those blocks
    (unless the keep rule selects it); returns the names of the swapped linears."""
    keep = (lambda name, module: False) if keep_high_precision is None else make_keep_rule(
        None if keep_high_precision == "default" else keep_high_precision)
    swapped = set()
    for name, module in list(model.named_modules()):
        w = sd.get(name + ".weight")
        if not isinstance(module, torch.nn.Linear) or not isinstance(w, GGUFTensor) or keep(name, module):
            continue
        if tuple(w.shape) != (module.out_features, module.in_features):
            raise DiTCheckpointError(f"{source}: {name}.weight has shape {tuple(w.shape)}, the model expects "
                                     f"{(module.out_features, module.in_features)}")
        bias = sd.get(name + ".bias")
        if (bias is None) != (module.bias is None):
            raise DiTCheckpointError(f"{source}: {name}: the file {'lacks' if bias is None else 'has'} a bias "
                                     f"the SeedVR2-{model.config.variant.upper()} layer "
                                     f"{'has' if bias is None else 'lacks'}")
        if isinstance(bias, GGUFTensor):
            bias = bias.dequantize(torch.float32)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child,
                GGUFLinear.from_gguf(w, bias, bias_dtype=dtype or (bias.dtype if bias is not None else None)))
        swapped.add(name)
    return swapped


# --------------------------------------------------------------------------------------------------
# Building and loading
# --------------------------------------------------------------------------------------------------
def build_dit(config: DiTConfig, device="meta", dtype=None, attention_backend: str = "auto", block_runner=None) -> NaDiT:
    model = NaDiT(config, attention_backend=attention_backend, block_runner=block_runner, device=device, dtype=dtype)
    device_cache.lease(model)   # the ops' shared device tensors go when the last model does
    return model


def _fix_rope_buffers(model: NaDiT) -> None:
    """The RoPE frequencies are constants computed in fp32; a half-precision file rounds them. Put the
    fp32 values back (they are what the official model computes at construction)."""
    cfg = model.config
    axis = cfg.rope_dim // 3
    exact = lang_freqs(axis) if cfg.variant == "3b" else pixel_freqs(axis)
    for b in model.blocks:
        holder = b.attn.rope.rope
        f = holder.freqs
        if f.dtype != torch.float32 or f.device.type == "meta":
            holder.freqs = exact.to(device=f.device if f.device.type != "meta" else "cpu")
        elif not torch.allclose(f.cpu(), exact, rtol=1e-6, atol=0):
            _log.warning("blocks.%d RoPE frequencies differ from the formula; keeping the file's values", b.index)


def _upcast_stray_fp8(model: NaDiT, target: torch.dtype) -> None:
    """fp8 files may store small tensors (ada vectors, norm weights, biases) in fp8 too; only the quantized
    linears keep fp8 storage, everything else is cast to the compute dtype (it is tiny)."""
    for mod in model.modules():
        if type(mod).__name__ in ("FP8Linear", "NVFP4Linear"):
            continue
        for pname, p in list(mod.named_parameters(recurse=False)):
            if p.dtype in _FP8:
                setattr(mod, pname, torch.nn.Parameter(p.detach().to(target), requires_grad=False))


def load_dit(
    checkpoint: Union[str, os.PathLike, Mapping[str, torch.Tensor]],
    device: Union[str, torch.device] = "cpu",
    dtype: Optional[torch.dtype] = None,
    attention_backend: str = "auto",
    block_runner=None,
    nvfp4_path: str = "auto",
    keep_high_precision=None,
) -> NaDiT:
    """Build the right DiT for ``checkpoint`` (path or state dict) and load it strictly.

    ``dtype``: cast floating weights (fp32/fp16/bf16) to this dtype; None keeps the file's dtype (bf16 for GGUF).
    Quantized files (fp8 weights, NVFP4 ``weight_scale`` keys) are handed to
    ``optimization.nvfp4.surgery.replace_linears(model, state_dict, nvfp4_path, ...)``; ``nvfp4_path="auto"``: each
    NVFP4 linear runs the hardware policy's path of the device it runs on (not of ``device``).
    """
    source = os.fspath(checkpoint) if isinstance(checkpoint, (str, os.PathLike)) else "state dict"
    sd = read_state_dict(checkpoint) if isinstance(checkpoint, (str, os.PathLike)) else unwrap_state_dict(dict(checkpoint), source)
    for key in BAKED_CONDITIONING:  # the text embeddings: load_text_embeddings reads them
        sd.pop(key, None)
    cfg = config_from_state_dict(_shapes(sd), source)
    model = build_dit(cfg, device="meta", attention_backend=attention_backend, block_runner=block_runner)

    if dtype is None and any(isinstance(v, GGUFTensor) for v in sd.values()):
        dtype = torch.bfloat16  # a GGUF file's dense tensors are F32 by the converter's habit, not a precision choice
    if dtype is not None:
        sd = {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype not in _FP8
                  and not k.endswith(("rope.freqs",) + _QUANT_AUX) else v)
              for k, v in sd.items()}

    linear_names = set()
    if any(isinstance(v, GGUFTensor) for v in sd.values()):
        linear_names = _swap_gguf_linears(model, sd, dtype, keep_high_precision, source)
        # what stays in blocks is owned by a GGUFLinear; any other quantized tensor becomes a dense one
        sd = {k: (v.dequantize(dtype or torch.bfloat16) if isinstance(v, GGUFTensor) else v) for k, v in sd.items()
              if k.rpartition(".")[0] not in linear_names}
        _log.info("%s: %d GGUF linears (blocks dequantized per forward)", source, len(linear_names))
    elif is_quantized(sd):
        try:
            report = replace_linears(model, sd, nvfp4_path, keep_high_precision=keep_high_precision,
                                     dtype=dtype or torch.bfloat16)
        except (KeyError, ValueError) as exc:   # a layer the file holds in a layout we cannot read: name the file
            raise DiTCheckpointError(f"{source}: {exc.args[0] if exc.args else exc}") from exc
        if report.get("missing"):
            raise DiTCheckpointError(f"{source}: no weights for linear layers {report['missing'][:8]}")
        kinds = ("nvfp4", "fp8", "mxfp8", "int8", "plain", "kept")
        linear_names = {n for kind in kinds for n in report.get(kind, [])}
        _log.info("%s: linears %s", source, ", ".join(f"{len(report[k])} {k}" for k in kinds if report.get(k)))

    def owned_by_linear(key: str) -> bool:
        return key.rpartition(".")[0] in linear_names

    rest = {k: v for k, v in sd.items() if not owned_by_linear(k)}
    result = model.load_state_dict(rest, strict=False, assign=True)
    missing = [k for k in result.missing_keys if not owned_by_linear(k)]
    unexpected = list(result.unexpected_keys)
    if missing or unexpected:
        raise DiTCheckpointError(
            f"{source}: detected SeedVR2-{cfg.variant.upper()} (dim {cfg.dim}, {cfg.num_layers} blocks) but the "
            f"keys do not match: missing {missing[:8]}{'...' if len(missing) > 8 else ''} "
            f"({len(missing)}), unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''} ({len(unexpected)})"
        )
    _upcast_stray_fp8(model, dtype or torch.bfloat16)
    _fix_rope_buffers(model)
    model.compute_dtype = None if dtype is None else dtype
    model = model.to(device)
    model.eval().requires_grad_(False)
    return model
