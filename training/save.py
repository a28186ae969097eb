"""Saving: kohya-format LoRA files (atomic), checkpoints keeping the last N, full resume state."""
from __future__ import annotations

import glob
import json
import os
import time
from pathlib import Path

import torch


def atomic_save_safetensors(sd: dict, path: str, metadata: dict | None = None):
    from safetensors.torch import save_file
    path = str(path)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        save_file(sd, tmp, metadata={k: str(v) for k, v in (metadata or {}).items()})
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def atomic_torch_save(obj, path: str):
    path = str(path)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def kohya_metadata(cfg, network, step: int, dataset_info: dict | None = None, extra: dict | None = None) -> dict:
    spec = network.spec
    md = {
        "ss_network_module": "networks.lora_flux",
        "ss_network_dim": str(spec.rank),
        "ss_network_alpha": str(spec.alpha),
        "ss_network_args": json.dumps({"train_double_block_indices": spec.double_blocks,
                                       "train_single_block_indices": spec.single_blocks,
                                       **{f"{k}_dim": str(v) for k, v in spec.type_ranks.items()}}),
        "ss_base_model_version": "flux1",
        "ss_training_comment": "trained with SeedVR2-Blackwell FluxLoraTrain (activation-side LoRA)",
        "ss_steps": str(step),
        "ss_max_train_steps": str(cfg.steps),
        "ss_learning_rate": str(cfg.learning_rate),
        "ss_optimizer": cfg.optimizer,
        "ss_lr_scheduler": cfg.lr_scheduler,
        "ss_lr_warmup_steps": str(cfg.warmup_steps),
        "ss_gradient_accumulation_steps": str(cfg.grad_accum),
        "ss_max_grad_norm": str(cfg.max_grad_norm),
        "ss_timestep_sampling": cfg.timestep_sampling,
        "ss_discrete_flow_shift": str(cfg.shift),
        "ss_sigmoid_scale": str(cfg.sigmoid_scale),
        "ss_model_prediction_type": "raw",
        "ss_guidance_scale": str(cfg.guidance),
        "ss_loss_type": cfg.loss_type,
        "ss_mixed_precision": cfg.compute_dtype,
        "ss_fp8_base": str(cfg.base_precision == "fp8"),
        "ss_base_precision": cfg.base_precision,
        "ss_gradient_checkpointing": str(cfg.gradient_checkpointing),
        "ss_seed": str(cfg.seed),
        "ss_training_finished_at": str(time.time()),
        "modelspec.architecture": "flux-1-dev/lora",
        "modelspec.implementation": "https://github.com/black-forest-labs/flux",
        "modelspec.title": cfg.output_name,
    }
    if dataset_info:
        md["ss_num_train_images"] = str(dataset_info.get("num_images", ""))
        md["ss_resolution"] = str(dataset_info.get("resolution", ""))
        md["ss_bucket_info"] = json.dumps(dataset_info.get("buckets", {}))
        md["ss_tag_frequency"] = json.dumps(dataset_info.get("captions", {}))[:20000]
    if extra:
        md.update({k: str(v) for k, v in extra.items()})
    return md


def prune_checkpoints(pattern: str, keep: int):
    """Keep the newest ``keep`` files matching ``pattern`` (sorted by name: names carry zero-padded steps)."""
    if keep <= 0:
        return
    files = sorted(glob.glob(pattern))
    for f in files[:-keep]:
        try:
            os.remove(f)
        except OSError:
            pass


class OutputNameError(ValueError):
    pass


_RULE = ("output_name must be a file name inside models/loras, sub-folders allowed (e.g. 'my_lora' or "
         "'people/alice_v2'); '..', absolute paths and drive letters are not allowed")


def resolve_output_name(lora_dir: str, output_name: str) -> tuple[str, str]:
    """``(folder, base name)`` of the LoRA ``output_name`` names inside ``lora_dir`` (".safetensors" optional).
    Anything that would land outside ``lora_dir`` (``..``, an absolute path, a drive letter, a symlink out of it)
    raises ``OutputNameError`` naming the rule."""
    raw = str(output_name or "")
    name = raw.strip().replace("\\", "/")
    if name.lower().endswith(".safetensors"):
        name = name[: -len(".safetensors")]
    parts = name.split("/")
    bad = None
    if not name or not parts[-1].strip():
        bad = "it is empty or ends with a folder separator"
    elif name.startswith("/") or os.path.isabs(name):
        bad = "it is an absolute path"
    elif len(name) >= 2 and name[1] == ":":
        bad = "it starts with a drive letter"
    elif any(p in ("..", ".") for p in parts):
        bad = "it contains '..' or '.' as a folder"
    elif any(not p.strip() for p in parts):
        bad = "it contains an empty folder name"
    elif any(c in name for c in ':*?"<>|') or any(ord(c) < 32 for c in name):
        bad = 'it contains one of : * ? " < > | or a control character'
    if bad is None:
        root = os.path.realpath(lora_dir)
        target = os.path.realpath(os.path.join(root, *parts))
        if os.path.commonpath([root, target]) != root:
            bad = "it resolves outside models/loras (through a link)"
    if bad is not None:
        raise OutputNameError(f"output_name {raw!r} is refused: {bad}. Fix: {_RULE}.")
    return os.path.join(lora_dir, *parts[:-1]), parts[-1]


def check_overwrite(lora_path: str, state_path: str, resume: bool, overwrite: bool) -> bool:
    """Whether this run resumes. An existing LoRA is continued (``resume`` with its state file), replaced
    (``overwrite``) or refused with an error saying which setting to change; never replaced silently."""
    has_state, has_lora = os.path.isfile(state_path), os.path.isfile(lora_path)
    if resume and has_state:
        return True
    if has_lora and not overwrite:
        why = ("resume is on, but it has no resume state (" + os.path.basename(state_path) + ")") if resume \
            else "resume is off"
        raise FileExistsError(
            f"the LoRA {lora_path} already exists and {why}, so training would replace it. Fix: choose another "
            f"output_name, turn 'overwrite' on to replace it"
            + ("" if resume else ", or turn 'resume' on to continue training it") + ".")
    return False
