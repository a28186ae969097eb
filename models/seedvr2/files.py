"""Reading a model file's tensors, safely and with errors a user can act on: a damaged or truncated download, a
file that is not a model, and a pickle that carries code (never run: ``weights_only``) are told apart and named
with the file and what to do. The container is recognised by the file's first bytes (a GGUF file renamed to
.safetensors still loads); the extension decides only for bytes that match no container. Used by the DiT and the
VAE loaders."""
from __future__ import annotations

import json
import os
import pickle
from typing import Optional, Union

import torch

from ...optimization.gguf import GGUFError, GGUFPackageMissing, GGUFTensor, read_gguf

SAFETENSORS = (".safetensors",)
PICKLES = (".pth", ".pt", ".ckpt", ".bin")
GGUF = (".gguf",)
# ComfyUI's converted SeedVR2 DiT files carry the text conditioning as two extra tensors (docs/SPEC.md §6)
BAKED_CONDITIONING = ("positive_conditioning", "negative_conditioning")


class ModelFileError(ValueError):
    """A model file that cannot be read, with the reason and the fix."""


def read_tensors(path: Union[str, os.PathLike], what: str = "model", device: str = "cpu"):
    """The file's top-level object: a dict of tensors (safetensors), a dict of tensors and ``GGUFTensor`` blocks
    (GGUF, memory-mapped on the CPU whatever ``device``) or what a weights-only unpickling gives (.pth / .pt /
    .ckpt / .bin). ``what`` names the file's role in the messages ("SeedVR2 DiT", ...)."""
    path = os.fspath(path)
    name = os.path.basename(path)
    if not os.path.isfile(path):
        raise ModelFileError(f"{what} file not found: {path}. Fix: check the file name and folder.")
    kind = container(path)
    if kind == "gguf":
        return _read_gguf(path, name, what)
    lower = path.lower()
    if kind == "safetensors" or (kind is None and lower.endswith(SAFETENSORS)):
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        try:
            return load_file(path, device=device)
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelFileError(
                f"{what} file {name} is damaged or is not a model file ({_size(path)}; safetensors says: {exc}). "
                f"Fix: download it again (an interrupted download leaves a truncated file): {path}") from exc
    if kind == "pickle" or (kind is None and lower.endswith(PICKLES)):
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
    if lower.endswith(GGUF):
        return _read_gguf(path, name, what)  # not GGUF bytes: its reader names what the file is
    raise ModelFileError(f"{what} file {name} has an unknown file type. Fix: use a .safetensors, .gguf or .pth "
                         f"file: {path}")


def container(path: str) -> Optional[str]:
    """"gguf", "safetensors" or "pickle" from the file's first bytes; None when they match none of these."""
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError:
        return None
    if head[:4] == b"GGUF":
        return "gguf"
    if len(head) >= 9 and head[8:9] == b"{":  # safetensors: u64 header length, then the JSON header
        return "safetensors"
    if head[:4] == b"PK\x03\x04" or (head[:1] == b"\x80" and head[1:2] in b"\x02\x03\x04\x05"):
        return "pickle"  # torch's zip format, or a legacy pickle (PROTO opcode)
    return None


def read_named(path: Union[str, os.PathLike], names, what: str = "model") -> dict:
    """The tensors called ``names`` (also under a key prefix such as ``model.diffusion_model.``), read alone: the
    other weights are never loaded. Keys are the bare names; a pickle gives {} (it cannot be read in part)."""
    path = os.fspath(path)
    kind = container(path)

    def bare(key: str):
        return next((n for n in names if key == n or key.endswith("." + n)), None)

    if kind == "safetensors":
        from safetensors import SafetensorError, safe_open
        try:
            with safe_open(path, framework="pt") as f:
                return {bare(k): f.get_tensor(k) for k in f.keys() if bare(k)}
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelFileError(f"{what} file {os.path.basename(path)} is damaged or is not a model file "
                                 f"(safetensors says: {exc}). Fix: download it again: {path}") from exc
    if kind == "gguf":
        tensors = _read_gguf(path, os.path.basename(path), what)
        return {bare(k): (v.dequantize(torch.float32) if isinstance(v, GGUFTensor) else v.clone())
                for k, v in tensors.items() if bare(k)}
    return {}


# What a file holds, told from its tensor names (prefixes such as "model.diffusion_model." are allowed).
KIND_SEEDVR2_DIT, KIND_SEEDVR2_VAE = "SeedVR2 DiT", "SeedVR2 VAE"
KIND_FLUX, KIND_OTHER_VAE, KIND_EMBEDDING = "FLUX transformer", "VAE (not SeedVR2's)", "text embedding"
KIND_UNKNOWN = "model of an unknown kind"  # a readable header whose names fit none of the kinds above


def kind_of_keys(keys) -> Optional[str]:
    """One of the KIND_* names for a file with these tensor names; None when the names fit none of them."""
    keys = list(keys)

    def has(suffix: str) -> bool:
        return any(k == suffix or k.endswith("." + suffix) for k in keys)

    if any(k.startswith(("double_blocks.", "single_blocks.")) or ".double_blocks." in k for k in keys):
        return KIND_FLUX
    if has("vid_in.proj.weight") and has("txt_in.weight") and any(".attn.proj_qkv." in k for k in keys):
        return KIND_SEEDVR2_DIT
    if has("encoder.conv_in.weight") and has("decoder.conv_in.weight"):
        return KIND_SEEDVR2_VAE if any("upsamplers.0.upscale_conv." in k for k in keys) else KIND_OTHER_VAE
    if 0 < len(keys) <= 2 and all(k.split(".")[-1] in ("pos_emb", "neg_emb", "emb", "embedding") for k in keys):
        return KIND_EMBEDDING
    return None


_KIND_CACHE: dict = {}


def file_kind(path: Union[str, os.PathLike]) -> Optional[str]:
    """``kind_of_keys`` of a file's tensor names (KIND_UNKNOWN when they fit no kind), from its header alone
    (safetensors JSON header, GGUF tensor list), cached by (path, mtime, size); None when the header cannot be
    read without loading the file (a pickle, a damaged file, GGUF without the `gguf` package)."""
    path = os.fspath(path)
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (path, st.st_mtime_ns, st.st_size)
    if key not in _KIND_CACHE:
        names = _header_names(path)
        _KIND_CACHE[key] = None if names is None else (kind_of_keys(names) or KIND_UNKNOWN)
    return _KIND_CACHE[key]


def _header_names(path: str) -> Optional[list]:
    """The tensor names a file's header lists, without reading any weights (None when they cannot be read)."""
    kind = container(path)
    try:
        if kind == "safetensors":
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                if size > 100 * 2**20:  # no real header is this large: a damaged file
                    return None
                header = json.loads(f.read(size))
            return [k for k in header if k != "__metadata__"]
        if kind == "gguf":
            import gguf  # the optional package's reader parses the header; the tensors stay on disk
            return [t.name for t in gguf.GGUFReader(path, "r").tensors]
    except Exception:  # noqa: BLE001 - a damaged file is listed as unreadable; loading it names the problem
        return None
    return None


def _read_gguf(path: str, name: str, what: str):
    """The GGUF file's tensors (quantized ones as ``GGUFTensor``, memory-mapped), errors as ModelFileError."""
    try:
        return read_gguf(path)[0]
    except GGUFPackageMissing as exc:
        raise ModelFileError(f"{what} file {name} is a GGUF file; reading GGUF needs the `gguf` package, which is "
                             f"not installed. Fix: pip install gguf (in the Python that runs ComfyUI): {path}"
                             ) from exc
    except GGUFError as exc:
        raise ModelFileError(f"{what} file {name}: {exc}") from exc


def _size(path: str) -> str:
    n = os.path.getsize(path)
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} bytes"
