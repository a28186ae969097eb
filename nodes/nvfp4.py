"""Node that converts a bf16/fp16/fp32/fp8 safetensors model (SeedVR2 DiT, FLUX, ...) to NVFP4 (or FP8).

Streams tensor by tensor (peak RAM about one tensor), shows ComfyUI's progress bar, can be interrupted (the
output file is then left untouched: it is written to a temp file and renamed into place at the end), and
reports which layers were quantized / kept and the size before / after.
"""
from __future__ import annotations

import os

import torch
from comfy_api.latest import io

from ..optimization.nvfp4.surgery import DEFAULT_KEEP_PATTERNS
from .types import CATEGORY

_MODEL_FOLDERS = ("diffusion_models", "checkpoints", "unet")


def _model_files() -> list[str]:
    try:
        import folder_paths
    except ImportError:
        return []
    out = []
    for folder in _MODEL_FOLDERS:
        try:
            out += [f"{folder}/{f}" for f in folder_paths.get_filename_list(folder) if f.endswith(".safetensors")]
        except Exception:  # noqa: BLE001 - folder not registered in this ComfyUI
            continue
    return sorted(set(out))


def _resolve(entry: str) -> str:
    import folder_paths
    folder, _, name = entry.partition("/")
    path = folder_paths.get_full_path(folder, name)
    if path is None:
        raise FileNotFoundError(f"model file not found: {entry}")
    return path


class ConvertToNVFP4(io.ComfyNode):
    """Converts a model file to NVFP4 (ComfyUI's quantized-checkpoint format) next to the source."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SeedVR2BW_ConvertToNVFP4",
            display_name="Convert Model to NVFP4 (SeedVR2-BW)",
            category=CATEGORY,
            description="Streams a bf16/fp16/fp32/fp8 .safetensors model to NVFP4 (or FP8 E4M3) in ComfyUI's "
                        "quantized format. Embeddings, norms, modulation and first/last layers stay high precision.",
            inputs=[
                io.Combo.Input("model", options=_model_files() or ["(no .safetensors found)"],
                               tooltip="Source model (diffusion_models / checkpoints folder)."),
                io.String.Input("output_name", default="",
                                tooltip="File name for the result (same folder). Empty: <source>_nvfp4.safetensors"),
                io.Combo.Input("format", options=["nvfp4", "fp8"], default="nvfp4"),
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
    def execute(cls, model: str, output_name: str, format: str, keep_patterns: str, use_default_keep: bool,
                device: str, overwrite: bool) -> io.NodeOutput:
        import comfy.model_management as mm
        import comfy.utils

        from ..optimization.nvfp4.convert import convert_file

        src = _resolve(model)
        name = output_name.strip() or os.path.splitext(os.path.basename(src))[0] + f"_{format}.safetensors"
        if not name.endswith(".safetensors"):
            name += ".safetensors"
        dst = os.path.join(os.path.dirname(src), os.path.basename(name))
        if os.path.abspath(dst) == os.path.abspath(src):
            raise ValueError("the output would overwrite the source model; choose another output_name")
        if os.path.exists(dst) and not overwrite:
            raise FileExistsError(f"{dst} exists; set overwrite to replace it")
        patterns = [p.strip() for p in keep_patterns.splitlines() if p.strip()]
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
