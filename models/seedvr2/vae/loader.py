"""Load SeedVR2 VAE weights (`.safetensors`, official `.pth`) by their original key names.

Accepts the official `ema_vae.pth` (torch.load with weights_only=True), the numz `ema_vae_fp16.safetensors`, a state
dict nested under "state_dict"/"model"/"ema"/"module", keys with a "vae."/"module."/"first_stage_model." prefix, and
the old diffusers attention names (query/key/value/proj_attn), which the official loader converts too. Anything that
is not a SeedVR2 VAE is rejected with the keys that were expected and those that were found.
"""
from __future__ import annotations

import os
from typing import Dict, Mapping, Optional, Union

import torch

from ..files import KIND_FLUX, KIND_SEEDVR2_DIT, KIND_SEEDVR2_VAE, container, file_kind, kind_of_keys, read_tensors
from .config import VAEConfig, config_from_state_dict
from .autoencoder import VideoAutoencoder

# Keys every SeedVR2 VAE has, whatever its widths (the real one, the tiny golden one).
SIGNATURE_KEYS = (
    "encoder.conv_in.weight",
    "encoder.down_blocks.0.resnets.0.conv1.weight",
    "encoder.mid_block.resnets.0.conv1.weight",
    "encoder.conv_out.weight",
    "decoder.conv_in.weight",
    "decoder.up_blocks.0.upsamplers.0.upscale_conv.weight",
    "decoder.conv_out.weight",
)
_PREFIXES = ("module.", "vae.", "first_stage_model.", "model.")
_OLD_ATTN = {"query.": "to_q.", "key.": "to_k.", "value.": "to_v.", "proj_attn.": "to_out.0."}


class NotASeedVR2VAE(ValueError):
    pass


def read_state_dict(path: Union[str, os.PathLike], device: str = "cpu") -> Dict[str, torch.Tensor]:
    return read_tensors(path, "SeedVR2 VAE", device)


def normalize_state_dict(sd: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Unwrap nesting, strip a common prefix, rename old diffusers attention keys."""
    for wrapper in ("state_dict", "model", "ema", "module"):
        if isinstance(sd, Mapping) and wrapper in sd and isinstance(sd[wrapper], Mapping) and len(sd) <= 3:
            sd = sd[wrapper]
    sd = {k: v for k, v in sd.items() if torch.is_tensor(v)}
    for p in _PREFIXES:
        if sd and all(k.startswith(p) for k in sd):
            sd = {k[len(p):]: v for k, v in sd.items()}
    out = {}
    for k, v in sd.items():
        if ".attentions." in k:
            for old, new in _OLD_ATTN.items():
                head, sep, tail = k.rpartition(".attentions.0.")
                if sep and tail.startswith(old):
                    k = head + sep + new + tail[len(old):]
                    # old diffusers stored the attention projections as 1x1 convs in some checkpoints
                    if v.ndim == 4:
                        v = v[:, :, 0, 0]
                    break
        out[k] = v
    return out


# what to do with a file of another kind chosen in the VAE loader
_USE_INSTEAD = {KIND_SEEDVR2_DIT: "this is a SeedVR2 DiT: use the DiT loader (SeedVR2 Load DiT)",
                KIND_FLUX: "this is a FLUX transformer: load it with ComfyUI's Load Diffusion Model"}


def _refuse_other_kind(kind, source: str) -> None:
    if kind in _USE_INSTEAD:
        raise NotASeedVR2VAE(f"{source} is not a SeedVR2 video VAE: {_USE_INSTEAD[kind]}. The SeedVR2 VAE is "
                             f"ema_vae.pth / ema_vae_fp16.safetensors.")


def check_is_seedvr2_vae(sd: Mapping[str, torch.Tensor], source: str = "state dict") -> None:
    _refuse_other_kind(kind_of_keys(sd), source)
    missing = [k for k in SIGNATURE_KEYS if k not in sd]
    bad = [k for k in ("encoder.conv_in.weight", "decoder.conv_in.weight", "decoder.conv_out.weight")
           if k in sd and len(sd[k].shape) != 5]
    if missing or bad:
        found = sorted(sd.keys())
        sample = ", ".join(found[:12]) + (f", ... ({len(found)} keys)" if len(found) > 12 else "")
        detail = []
        if missing:
            detail.append(f"missing keys: {', '.join(missing)}")
        if bad:
            detail.append("3-D causal conv weights (5-D tensors) expected for: "
                          + ", ".join(f"{k} {tuple(sd[k].shape)}" for k in bad))
        raise NotASeedVR2VAE(
            f"{source} is not a SeedVR2 video VAE (video_vae_v3). Expected keys such as "
            f"{', '.join(SIGNATURE_KEYS)} with 5-D conv weights; {'; '.join(detail)}. Found: {sample or 'no tensors'}."
        )


def load_state_dict_into(model: VideoAutoencoder, sd: Mapping[str, torch.Tensor], source: str = "state dict",
                         assign: bool = False) -> None:
    """Load by name; every model key must be present with its shape and every file key must be used."""
    own = model.state_dict()
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    shapes = [f"{k}: file {tuple(sd[k].shape)} vs model {tuple(own[k].shape)}"
              for k in own if k in sd and tuple(sd[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or shapes:
        raise NotASeedVR2VAE(
            f"{source} does not match the SeedVR2 VAE built from its config: "
            f"{len(missing)} missing {missing[:8]}, {len(unexpected)} unexpected {unexpected[:8]}, "
            f"{len(shapes)} shape mismatches {shapes[:8]}"
        )
    model.load_state_dict(dict(sd), strict=True, assign=assign)


def build_vae(sd: Mapping[str, torch.Tensor], config: Optional[VAEConfig] = None, norm_num_groups: Optional[int] = None,
              dtype: Optional[torch.dtype] = None, device: Union[str, torch.device, None] = None,
              source: str = "state dict") -> VideoAutoencoder:
    sd = normalize_state_dict(sd)
    check_is_seedvr2_vae(sd, source)
    if config is None:
        config = config_from_state_dict(sd, norm_num_groups=norm_num_groups)
    with torch.device("meta"):
        model = VideoAutoencoder(config)
    if dtype is not None:
        sd = {k: v.to(dtype) for k, v in sd.items()}
    if device is not None:
        sd = {k: v.to(device) for k, v in sd.items()}
    # assign=True: the tensors of the file become the parameters (no second copy; works from the meta device).
    load_state_dict_into(model, sd, source, assign=True)
    return model.eval().requires_grad_(False)


def load_vae(path: Union[str, os.PathLike], dtype: Optional[torch.dtype] = None, device="cpu",
             config: Optional[VAEConfig] = None, norm_num_groups: Optional[int] = None) -> VideoAutoencoder:
    """Read a SeedVR2 VAE file and return the model in eval mode (dtype default: as stored). A file whose weights
    cannot tell the GroupNorm group count (the test models) records it in its metadata."""
    kind = file_kind(path)
    if kind != KIND_SEEDVR2_VAE:
        _refuse_other_kind(kind, os.fspath(path))  # from the header: a wrong file's weights are never read
    sd = read_state_dict(path)
    if norm_num_groups is None and container(os.fspath(path)) == "safetensors":
        from safetensors import safe_open
        with safe_open(os.fspath(path), framework="pt") as f:
            groups = (f.metadata() or {}).get("seedvr2.norm_num_groups")
        norm_num_groups = int(groups) if groups else None
    return build_vae(sd, config=config, norm_num_groups=norm_num_groups, dtype=dtype, device=device,
                     source=os.fspath(path))
