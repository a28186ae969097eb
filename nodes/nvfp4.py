"""Node that converts a bf16/fp16/fp32/fp8 safetensors model (SeedVR2 DiT, FLUX, ...) to NVFP4 (or MXFP8, FP8).

Streams tensor by tensor (peak RAM about one tensor), shows ComfyUI's progress bar, can be interrupted (the
output file is then left untouched: it is written to a temp file and renamed into place at the end), and
reports which layers were quantized / kept and the size before / after.
"""
from __future__ import annotations

import os
import re

import torch
from comfy_api.latest import io

from ..models.seedvr2.files import KIND_EMBEDDING, KIND_OTHER_VAE, KIND_SEEDVR2_VAE, file_kind
from ..optimization.nvfp4.convert import TARGETS, convert_file
from ..optimization.nvfp4.surgery import DEFAULT_KEEP_PATTERNS
from .seedvr2 import FOLDER_KEY, register_folders
from .types import CATEGORY

# models/SEEDVR2 first (where the README puts DiTs); "unet" is ComfyUI's old name of diffusion_models
_MODEL_FOLDERS = (FOLDER_KEY, "diffusion_models", "checkpoints", "unet")
_NOT_CONVERTIBLE = {KIND_SEEDVR2_VAE: "the SeedVR2 VAE", KIND_OTHER_VAE: "a VAE", KIND_EMBEDDING: "a text embedding"}


def _model_files() -> list[str]:
    """``<folder>/<name>`` of every .safetensors model, each file once (the first folder that lists it), VAEs and
    embeddings left out."""
    try:
        import folder_paths
        register_folders()
    except ImportError:
        return []
    out, seen = [], set()
    for folder in _MODEL_FOLDERS:
        try:
            names = folder_paths.get_filename_list(folder)
        except Exception:  # noqa: BLE001 - folder not registered in this ComfyUI
            continue
        for name in names:
            path = folder_paths.get_full_path(folder, name) if name.endswith(".safetensors") else None
            real = os.path.realpath(path) if path else None
            if real and real not in seen and file_kind(real) not in _NOT_CONVERTIBLE:
                seen.add(real)
                out.append(f"{folder}/{name}")
    return out


def _resolve(entry: str) -> str:
    import folder_paths
    register_folders()
    folder, _, name = entry.partition("/")
    path = folder_paths.get_full_path(folder, name)
    if path is None:
        raise FileNotFoundError(f"model file not found: {entry}")
    return path


def _output_path(model: str, output_name: str, format: str) -> str:
    src = _resolve(model)
    name = output_name.strip() or os.path.splitext(os.path.basename(src))[0] + f"_{format}.safetensors"
    if not name.endswith(".safetensors"):
        name += ".safetensors"
    return os.path.join(os.path.dirname(src), os.path.basename(name))


def _keep_patterns(text: str) -> list[str]:
    """The non-empty lines of ``keep_patterns``, each checked to be a regular expression."""
    patterns = [p.strip() for p in text.splitlines() if p.strip()]
    for p in patterns:
        try:
            re.compile(p)
        except re.error as exc:
            raise ValueError(f"keep_patterns: {p!r} is not a valid regular expression ({exc.msg} at position "
                             f"{exc.pos}). Fix: correct that line (one pattern per line; a literal ( [ . * + ? "
                             f"needs a backslash), or delete it") from None
    return patterns


# output path -> [generation, seen present]: a generation is a run whose output was deleted after it existed
_OUTPUT_STATE: dict[str, list] = {}


class ConvertToNVFP4(io.ComfyNode):
    """Converts a model file to NVFP4 (ComfyUI's quantized-checkpoint format) next to the source."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SeedVR2BW_ConvertToNVFP4",
            display_name="Convert Model to NVFP4 (SeedVR2-BW)",
            category=CATEGORY,
            description="Streams a bf16/fp16/fp32/fp8 .safetensors model to NVFP4 (or MXFP8, FP8 E4M3) in ComfyUI's "
                        "quantized format. Embeddings, norms, modulation and first/last layers stay high precision.",
            inputs=[
                io.Combo.Input("model", options=_model_files() or ["(no .safetensors found)"],
                               tooltip="Source model (SEEDVR2 / diffusion_models / checkpoints folder)."),
                io.String.Input("output_name", default="",
                                tooltip="File name for the result (same folder). Empty: <source>_<format>.safetensors"),
                io.Combo.Input("format", options=list(TARGETS), default="nvfp4",
                               tooltip="nvfp4: 4-bit, 16-element blocks (ComfyUI's TensorCoreNVFP4Layout); mxfp8: "
                                       "FP8 E4M3 with a power-of-two scale per 32 elements (TensorCoreMXFP8Layout, "
                                       "ComfyUI with comfy-kitchen); fp8: FP8 E4M3 with one scale per tensor."),
                io.String.Input("keep_patterns", default="", multiline=True,
                                tooltip="Extra regular expressions (one per line) of layer names to keep in high "
                                        "precision, added to the defaults."),
                io.Boolean.Input("use_default_keep", default=True,
                                 tooltip="Keep embeddings, norms, modulation/adaLN, patch-in/out high precision."),
                io.Combo.Input("device", options=["auto", "cpu", "cuda"], default="auto",
                               tooltip="Where the quantization math runs (GPU is much faster)."),
                io.Boolean.Input("overwrite", default=False),
            ],
            outputs=[io.String.Output(display_name="summary")],
            is_output_node=True,
            not_idempotent=True,
        )

    @classmethod
    def fingerprint_inputs(cls, model: str, output_name: str, format: str, **_) -> tuple:
        """Same inputs, same value while the output file stays; a new value once it was deleted, so that ComfyUI
        runs the conversion again instead of returning its cached summary."""
        dst = _output_path(model, output_name, format)
        state = _OUTPUT_STATE.setdefault(dst, [0, False])
        if os.path.exists(dst):
            state[1] = True
        elif state[1]:
            state[0], state[1] = state[0] + 1, False
        return dst, state[0]

    @classmethod
    def execute(cls, model: str, output_name: str, format: str, keep_patterns: str, use_default_keep: bool,
                device: str, overwrite: bool) -> io.NodeOutput:
        import comfy.model_management as mm
        import comfy.utils

        src = _resolve(model)
        kind = file_kind(src)
        if kind in _NOT_CONVERTIBLE:
            raise ValueError(f"{model} is {_NOT_CONVERTIBLE[kind]}, not a diffusion model: NVFP4 conversion is for "
                             "the linear layers of a DiT / diffusion model (SeedVR2 DiT, FLUX). Fix: choose the DiT "
                             "file (the VAE runs in bf16/fp16 as it is)")
        dst = _output_path(model, output_name, format)
        if os.path.abspath(dst) == os.path.abspath(src):
            raise ValueError("the output would overwrite the source model; choose another output_name")
        if os.path.exists(dst) and not overwrite:
            raise FileExistsError(f"{dst} exists; set overwrite to replace it")
        patterns = _keep_patterns(keep_patterns)
        if use_default_keep:
            patterns += list(DEFAULT_KEEP_PATTERNS)
        if device == "auto":
            dev = mm.get_torch_device()
            device = "cuda" if dev.type == "cuda" else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            device = "cpu"
        bar = [None]

        def progress(i, n, _name):
            if bar[0] is None:
                bar[0] = comfy.utils.ProgressBar(n)
            bar[0].update_absolute(i, n)

        summary = convert_file(src, dst, target=format, keep=patterns, device=device, progress=progress,
                               check_interrupt=mm.throw_exception_if_processing_interrupted)
        text = summary.text()
        if summary.kept:
            text += "\nkept: " + ", ".join(summary.kept[:40]) + (" ..." if len(summary.kept) > 40 else "")
        return io.NodeOutput(text, ui={"text": [text]})


NODES = [ConvertToNVFP4]
