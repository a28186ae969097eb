"""Files written by the pack's converter load through ComfyUI 0.19.3's own loader to the weights the pack computes.

In 0.19.3's executor (``tests/rig/load_quantized.py``: a process of its own with 0.19.3's venv, where comfy-kitchen
imports) the Convert node turns the tiny FLUX (``tiny_flux.py``, bf16) and the tiny golden SeedVR2 3B DiT
(``tests/data/golden``, fp32) into nvfp4 and mxfp8 files. ComfyUI's ``UNETLoader`` then loads each one; for every
quantized layer the weight ComfyUI dequantizes (comfy-kitchen's ``QuantizedTensor.dequantize()``, float32 on the CPU,
where both sides are exact) must equal, bit for bit, the pack's own dequantization of the file's bytes
(``format.dequantize_nvfp4`` / ``mxfp8.dequantize_mxfp8``), and every other weight must equal the file's.

SeedVR2: 0.19.3's detection recognises only the full-size 3B and 7B, so the tiny 3B's dimensions (the golden
manifest's) are handed to it; everything after detection is ComfyUI's (``load_quantized.py`` says how). The tiny 7B
is not used: ComfyUI's NaDiT picks its 7B layout by ``vid_dim == 3072``.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from .conftest import REPO

GOLDEN = REPO / "tests" / "data" / "golden"
NODE = "SeedVR2BW_ConvertToNVFP4"
SOURCES = {"flux": "tiny_flux1.safetensors", "seedvr2": "seedvr2_tiny_3b.safetensors"}
FORMATS = ("nvfp4", "mxfp8")
LAYOUT = {"nvfp4": "TensorCoreNVFP4Layout", "mxfp8": "TensorCoreMXFP8Layout"}
MODEL_CLASS = {"flux": "Flux", "seedvr2": "SeedVR2"}


def _out_name(model: str, fmt: str) -> str:
    return f"{model}_{fmt}.safetensors"


def _tiny_3b_config() -> dict:
    """The tiny golden 3B's dimensions in the terms of ComfyUI's SeedVR2 detection."""
    kw = json.loads((GOLDEN / "manifest.json").read_text())["dit"]["tiny_models"]["3b"]["constructor_kwargs"]
    cfg = {k: kw[k] for k in ("vid_in_channels", "vid_out_channels", "vid_dim", "txt_in_dim", "heads", "head_dim",
                              "expand_ratio", "num_layers", "mm_layers", "mlp_type", "rope_dim", "norm_eps")}
    return {"image_model": "seedvr2", "qk_rope": None, "vid_out_norm": True, **cfg}


@pytest.fixture(scope="module")
def converted(next_rig, pack_parent, comfy_inprocess, tmp_path_factory):
    """The subprocess's result: the four conversions through the executor, then the four loads and comparisons."""
    from .tiny_flux import write_tiny_flux_files  # made with the in-process ComfyUI's classes (see tiny_flux.py)
    tree, python = next_rig
    work = tmp_path_factory.mktemp("next_quantized")
    models = work / "diffusion_models"
    models.mkdir()
    flux = write_tiny_flux_files(tmp_path_factory.getbasetemp() / "tiny_flux_files")["unet"]
    (models / SOURCES["flux"]).symlink_to(flux)
    (models / SOURCES["seedvr2"]).symlink_to(GOLDEN / "dit_3b_tiny_weights.safetensors")
    for d in ("output", "input", "temp"):
        (work / d).mkdir()
    prompts = [{"1": {"class_type": NODE, "inputs": {
        "model": f"diffusion_models/{SOURCES[m]}", "output_name": _out_name(m, fmt), "format": fmt,
        "keep_patterns": "", "use_default_keep": True, "device": "cpu", "overwrite": False}}}
        for m in SOURCES for fmt in FORMATS]
    loads = [{"unet_name": _out_name(m, fmt), "unet_config": _tiny_3b_config() if m == "seedvr2" else None}
             for m in SOURCES for fmt in FORMATS]
    job = {"comfy_dir": str(tree), "custom_node_dirs": [str(pack_parent)], "output_dir": str(work / "output"),
           "input_dir": str(work / "input"), "temp_dir": str(work / "temp"),
           "model_dirs": {"diffusion_models": str(models)}, "prompts": prompts, "loads": loads}
    (work / "job.json").write_text(json.dumps(job))
    r = subprocess.run([str(python), str(REPO / "tests" / "rig" / "load_quantized.py"), str(work / "job.json"),
                        str(work / "result.json")], cwd=str(tree), capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    res = json.loads((work / "result.json").read_text())
    assert res["comfyui_version"] == "0.19.3"
    return res


def test_convert_node_writes_each_format_in_0193(converted):
    for i, (m, fmt) in enumerate((m, fmt) for m in SOURCES for fmt in FORMATS):
        r = converted["results"][i]
        assert r["success"], json.dumps(r["error"])[:3000]
        assert f"{_out_name(m, fmt)} ({fmt}):" in r["outputs"]["1"]["text"][0], r["outputs"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("model", list(SOURCES))
def test_comfyuis_loader_dequantizes_to_our_weights(converted, model, fmt):
    load = next(x for x in converted["loads"] if x["unet_name"] == _out_name(model, fmt))
    assert load["model_class"] == MODEL_CLASS[model]
    # every layer the file quantizes is a comfy-kitchen QuantizedTensor in ComfyUI, in the file's layout
    assert load["file_layers"] and set(load["file_layers"].values()) == {fmt}
    assert set(load["quantized"]) == set(load["file_layers"])
    for layer, q in load["quantized"].items():
        assert (q["quant_format"], q["layout"], q["dtype"]) == (fmt, LAYOUT[fmt], "torch.float32"), (layer, q)
    differ = {k: q["max_abs"] for k, q in load["quantized"].items() if not q["equal"]}
    assert not differ, f"ComfyUI's dequantized weight differs from ours (max |diff|): {differ}"
    assert not load["plain_differ"], load["plain_differ"]
    assert load["plain_equal"] > 0
    # ComfyUI's SeedVR2 model has the baked text conditioning as buffers; the golden tiny file has none
    assert sorted(load["not_in_file"]) == ([] if model == "flux" else ["negative_conditioning",
                                                                        "positive_conditioning"])
