"""Precomputed text embeddings of SeedVR2 (docs/SPEC.md §6 step 7). Pure torch.

SeedVR2 never encodes a prompt at run time: the official repo (and numz) ship ``pos_emb.pt``
(bf16, (58, 5120)) and ``neg_emb.pt`` (bf16, (64, 5120)). One-step inference with cfg = 1 uses only the
positive one; the negative one is loaded when present (for completeness / future cfg) but not required.

ComfyUI's converted DiT files carry both embeddings as the tensors ``positive_conditioning`` and
``negative_conditioning``; when the DiT file has them they are used (read alone, not the weights).
Otherwise, accepted files, looked up beside the DiT checkpoint first, then in any extra folders given:
``pos_emb.pt``, ``pos_emb.pth``, ``pos_emb.safetensors`` (same for ``neg_emb``). A ``.safetensors`` file
must hold one tensor (any name) or a tensor named ``pos_emb``/``neg_emb``/``emb``/``embedding``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from .files import BAKED_CONDITIONING, read_named

EMBEDDING_STEMS = ("pos_emb", "neg_emb")
EMBEDDING_EXTENSIONS = (".safetensors", ".pt", ".pth")


class MissingEmbeddingError(FileNotFoundError):
    """The precomputed text embedding file is not where we looked."""


@dataclass
class TextEmbeddings:
    positive: torch.Tensor            # (L, D)
    negative: Optional[torch.Tensor]  # (L', D) or None
    positive_path: str = ""
    negative_path: str = ""

    @property
    def dim(self) -> int:
        return int(self.positive.shape[-1])


def _search_dirs(model_path: Optional[str], extra_dirs: Iterable[str]) -> list[str]:
    dirs = []
    if model_path:
        dirs.append(os.path.dirname(os.path.abspath(model_path)))
    for d in extra_dirs or ():
        if d:
            d = os.path.abspath(d)
            if d not in dirs:
                dirs.append(d)
    return dirs


def find_embedding_file(stem: str, model_path: Optional[str] = None, extra_dirs: Iterable[str] = ()) -> Optional[str]:
    for d in _search_dirs(model_path, extra_dirs):
        for ext in EMBEDDING_EXTENSIONS:
            p = os.path.join(d, stem + ext)
            if os.path.isfile(p):
                return p
    return None


def load_embedding_file(path: str) -> torch.Tensor:
    """Load one embedding tensor as float32 (L, D) on CPU."""
    stem = os.path.splitext(os.path.basename(path))[0]
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file
        tensors = load_file(path, device="cpu")
        if len(tensors) == 1:
            t = next(iter(tensors.values()))
        else:
            t = next((tensors[k] for k in (stem, "emb", "embedding", "embeds") if k in tensors), None)
            if t is None:
                raise ValueError(f"{path}: expected one tensor or one named {stem!r}, found {sorted(tensors)}")
    else:
        obj = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(obj, dict):
            if len(obj) == 1:
                obj = next(iter(obj.values()))
            else:
                obj = next((obj[k] for k in (stem, "emb", "embedding", "embeds") if k in obj), None)
        if not isinstance(obj, torch.Tensor):
            raise ValueError(f"{path}: does not contain a tensor")
        t = obj
    return _as_embedding(t, path)


def _as_embedding(t: torch.Tensor, source: str) -> torch.Tensor:
    """One embedding as float32 (L, D) on the CPU; a leading batch of 1 is dropped."""
    if t.dim() == 3 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 2:
        raise ValueError(f"{source}: text embedding must be (tokens, dim), got shape {tuple(t.shape)}")
    return t.float().contiguous()


def load_text_embeddings(model_path: Optional[str] = None, extra_dirs: Iterable[str] = (),
                         expected_dim: Optional[int] = None, require_negative: bool = False) -> TextEmbeddings:
    """Load the positive (required) and negative (optional unless ``require_negative``) embedding: from the DiT
    file's ``positive_conditioning`` / ``negative_conditioning`` when it has them, else ``pos_emb`` / ``neg_emb``
    files."""
    baked = {}
    if model_path and os.path.isfile(model_path):
        baked = read_named(model_path, BAKED_CONDITIONING, "SeedVR2 DiT")
    dirs = _search_dirs(model_path, extra_dirs)
    found, tensors = {}, {}
    for stem, key in zip(EMBEDDING_STEMS, BAKED_CONDITIONING):
        if key in baked:
            found[stem] = f"{model_path} ({key})"
            tensors[stem] = _as_embedding(baked[key], found[stem])
            continue
        path = find_embedding_file(stem, model_path, extra_dirs)
        if path is None and (stem == "pos_emb" or require_negative):
            where = dirs[0] if dirs else "the folder of the DiT model"
            raise MissingEmbeddingError(
                f"SeedVR2 text embedding '{stem}.pt' (or {stem}.safetensors) not found. Looked in: "
                f"{', '.join(dirs) or '(no folder)'}. Put the file shipped with SeedVR2 "
                f"(ByteDance-Seed/SeedVR repo root, or the numz SeedVR2_comfyUI download: {stem}.pt) into {where}, "
                f"next to the DiT checkpoint, or use a DiT file that carries it (ComfyUI's converted SeedVR2 files "
                f"hold it as the tensor positive_conditioning).")
        found[stem] = path
        tensors[stem] = load_embedding_file(path) if path else None
    pos, neg = tensors["pos_emb"], tensors["neg_emb"]
    for stem, t in (("pos_emb", pos), ("neg_emb", neg)):
        if t is not None and expected_dim is not None and t.shape[-1] != expected_dim:
            raise ValueError(f"{found[stem]}: embedding dim {t.shape[-1]} does not match the DiT's text input dim "
                             f"{expected_dim} (wrong file for this model?)")
    return TextEmbeddings(pos, neg, found["pos_emb"], found["neg_emb"] or "")
