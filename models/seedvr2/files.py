"""Reading a model file's tensors, safely and with errors a user can act on: a damaged or truncated download, a
file that is not a model, and a pickle that carries code (never run: ``weights_only``) are told apart and named
with the file and what to do. Used by the DiT and the VAE loaders."""
from __future__ import annotations

import os
import pickle
from typing import Union

import torch

SAFETENSORS = (".safetensors",)
PICKLES = (".pth", ".pt", ".ckpt", ".bin")


class ModelFileError(ValueError):
    """A model file that cannot be read, with the reason and the fix."""


def read_tensors(path: Union[str, os.PathLike], what: str = "model", device: str = "cpu"):
    """The file's top-level object: a dict of tensors (.safetensors) or what a weights-only unpickling gives
    (.pth / .pt / .ckpt / .bin). ``what`` names the file's role in the messages ("SeedVR2 DiT", ...)."""
    path = os.fspath(path)
    name = os.path.basename(path)
    if not os.path.isfile(path):
        raise ModelFileError(f"{what} file not found: {path}. Fix: check the file name and folder.")
    lower = path.lower()
    if lower.endswith(SAFETENSORS):
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        try:
            return load_file(path, device=device)
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelFileError(
                f"{what} file {name} is damaged or is not a model file ({_size(path)}; safetensors says: {exc}). "
                f"Fix: download it again (an interrupted download leaves a truncated file): {path}") from exc
    if lower.endswith(PICKLES):
        try:
            return torch.load(path, map_location=device, weights_only=True, mmap=True)
        except pickle.UnpicklingError as exc:
            raise ModelFileError(
                f"{what} file {name} contains Python code (pickled objects besides the weights), so it is not "
                f"loaded: loading it could run that code on this machine. Fix: use the .safetensors version of "
                f"this model, or re-save only its tensors: {path}") from exc
        except (RuntimeError, OSError, EOFError, ValueError) as exc:
            raise ModelFileError(
                f"{what} file {name} is damaged or is not a model file ({_size(path)}; torch says: {exc}). "
                f"Fix: download it again: {path}") from exc
    if lower.endswith(".gguf"):
        raise ModelFileError(f"{what} file {name} is a GGUF file, which this loader does not read yet. Fix: use the "
                             f".safetensors (fp16, fp8 or NVFP4) version of this model: {path}")
    raise ModelFileError(f"{what} file {name} has an unknown file type. Fix: use a .safetensors or .pth file: "
                         f"{path}")


def _size(path: str) -> str:
    n = os.path.getsize(path)
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} bytes"
