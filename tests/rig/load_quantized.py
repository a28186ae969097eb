"""Quantized diffusion-model files through a ComfyUI's own loader, compared with the pack's own dequantization, in a
process of their own (a ComfyUI with its own venv, e.g. 0.19.3 with comfy-kitchen):

    <that venv's python> tests/rig/load_quantized.py job.json result.json

``job.json``: what ``run_prompts.py`` takes (its ``prompts`` run first through the in-process executor: the pack's
Convert node writing the files), plus ``"loads": [{"unet_name": <file in diffusion_models>, "unet_config": {...}}]``.

Each file is loaded by ComfyUI's ``UNETLoader`` (``nodes.UNETLoader().load_unet(name, "default")``: what the node runs,
detection, ``comfy_quant`` layers as comfy-kitchen ``QuantizedTensor`` weights in ``mixed_precision_ops``). Then, layer
by layer: the weight ComfyUI dequantizes (``QuantizedTensor.dequantize()``) against the pack's dequantization of the
file's bytes (``optimization/nvfp4/format.dequantize_nvfp4``, ``mxfp8.dequantize_mxfp8``, cast to ComfyUI's dtype);
every other parameter and persistent buffer against the file's tensor in ComfyUI's dtype (an RMSNorm's ``weight``
against the file's ``scale``, its older name). Compared bit for bit.

``unet_config``: ComfyUI's model detection told the model's dimensions. ComfyUI's SeedVR2 detection knows only the
full-size 3B and 7B (it looks for ``blocks.31`` / ``blocks.36`` and fixes the widths), so a tiny SeedVR2 file needs
it; ``model_detection.detect_unet_config`` is wrapped to return it where ComfyUI's own detection finds nothing. All
else (the supported-model class, the quantization config read from ``comfy_quant``, the ops, the weights' loading)
is ComfyUI's.

``result.json``: ``{"comfyui_version", "results": [as run_prompts.py], "loads": [{"unet_name", "model_class",
"patcher_class", "file_layers": {layer: format}, "quantized": {layer: {"quant_format", "layout", "dtype", "shape",
"equal", "max_abs"}}, "plain_equal": n, "plain_differ": [names], "not_in_file": [names]}]}``.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping

import run_prompts

PACK_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _SafetensorsFile(Mapping):
    """The file's tensors, read one at a time."""

    def __init__(self, path: str):
        from safetensors import safe_open
        self._f = safe_open(path, "pt")
        self._keys = set(self._f.keys())
        self.metadata = self._f.metadata() or {}

    def __getitem__(self, key):
        if key not in self._keys:
            raise KeyError(key)
        return self._f.get_tensor(key)

    def __iter__(self):
        return iter(self._keys)

    def __len__(self):
        return len(self._keys)


def _bits_equal(a, b) -> bool:
    import torch
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _max_abs(a, b) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def _ours(sd, layer: str, fmt: str, shape):
    """The pack's dequantization (float32) of one layer of the file."""
    from seedvr2bw.optimization.nvfp4 import checkpoint, mxfp8
    if fmt == "nvfp4":
        t = checkpoint.load_nvfp4_layer(sd, layer, out_features=shape[0], in_features=shape[1],
                                        metadata=sd.metadata)["weight"]
        return t.dequantize()
    if fmt == "mxfp8":
        d = checkpoint.load_mxfp8_layer(sd, layer)
        return mxfp8.dequantize_mxfp8(d["weight"], d["weight_scale"], shape=tuple(shape))
    raise ValueError(f"{layer}: no comparison for format {fmt!r}")


def load_and_compare(rig, unet_name: str, unet_config: dict | None) -> dict:
    import comfy.model_detection as detection
    from comfy.quant_ops import QuantizedTensor

    from seedvr2bw.optimization.nvfp4 import checkpoint

    own_detection = detection.detect_unet_config

    def detect(state_dict, key_prefix, metadata=None):
        found = own_detection(state_dict, key_prefix, metadata=metadata)
        return found if found is not None or unet_config is None else dict(unet_config)

    detection.detect_unet_config = detect
    try:
        (patcher,) = rig.nodes.UNETLoader().load_unet(unet_name, "default")
    finally:
        detection.detect_unet_config = own_detection
    path = rig.folder_paths.get_full_path("diffusion_models", unet_name)
    sd = _SafetensorsFile(path)
    file_layers = {k[: -len(".comfy_quant")]: checkpoint.read_comfy_quant(sd[k])["format"]
                   for k in sd if k.endswith(".comfy_quant")}
    dm = patcher.model.diffusion_model
    quantized, skip = {}, set()
    for name, module in dm.named_modules():
        w = getattr(module, "weight", None)
        if not isinstance(w, QuantizedTensor):
            continue
        skip.update({f"{name}.weight", f"{name}.input_scale"})
        theirs = w.dequantize()
        fmt = getattr(module, "quant_format", None)
        ours = _ours(sd, name, file_layers.get(name, fmt), tuple(theirs.shape)).to(theirs.dtype)
        quantized[name] = {"quant_format": fmt, "layout": getattr(module, "layout_type", None),
                           "dtype": str(theirs.dtype), "shape": list(theirs.shape),
                           "equal": _bits_equal(ours, theirs), "max_abs": _max_abs(ours, theirs)}
    plain_equal, plain_differ, not_in_file = 0, [], []
    saved = set(dm.state_dict(keep_vars=True))   # leaves out non-persistent buffers (caches)
    for name, t in list(dm.named_parameters()) + list(dm.named_buffers()):
        if name in skip or name not in saved:
            continue
        key = name
        if key not in sd and key.endswith("norm.weight"):   # RMSNorm's "scale" in older files, "weight" in 0.19.3
            key = key[: -len("weight")] + "scale"
        if key not in sd:
            not_in_file.append(name)
            continue
        if _bits_equal(sd[key].to(t.dtype), t.detach()):
            plain_equal += 1
        else:
            plain_differ.append(name)
    return {"unet_name": unet_name, "model_class": type(patcher.model).__name__,
            "patcher_class": type(patcher).__name__, "is_dynamic": bool(patcher.is_dynamic()),
            "file_layers": file_layers, "quantized": quantized, "plain_equal": plain_equal,
            "plain_differ": plain_differ, "not_in_file": not_in_file}


def main(job_path: str, result_path: str) -> int:
    job = run_prompts.load_job(job_path)
    comfy = run_prompts.boot(job)
    sys.path.insert(0, PACK_ROOT)
    from pack_import import import_pack
    import_pack()
    out = {"comfyui_version": run_prompts.comfyui_version(), "results": run_prompts.run_all(comfy, job["prompts"]),
           "loads": []}
    if all(r["success"] for r in out["results"]):
        for load in job.get("loads", []):
            out["loads"].append(load_and_compare(comfy, load["unet_name"], load.get("unet_config")))
    run_prompts.write_result(result_path, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
