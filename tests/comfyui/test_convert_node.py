"""The Convert-to-NVFP4 node through ComfyUI's executor: its model list (models/SEEDVR2 included, each file once,
no VAE), its errors (a VAE file, a bad keep pattern), its caching (run again when the output was deleted) and its
mxfp8 output (ComfyUI's layout, the bytes of the pack's quantize_mxfp8)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[2]
NODE = "SeedVR2BW_ConvertToNVFP4"


@pytest.fixture(scope="module")
def folders(comfy_inprocess, tmp_path_factory):
    """A SEEDVR2 folder with the tiny DiT and VAE, and a diffusion_models folder with a toy model."""
    sys.path.insert(0, str(REPO / "tests"))
    from make_tiny_models import make_tiny_models
    root = tmp_path_factory.mktemp("convert")
    paths = make_tiny_models(root)
    seedvr2 = Path(paths["dit_3b"]).parent
    dm = root / "diffusion_models"
    dm.mkdir()
    g = torch.Generator().manual_seed(0)
    save_file({"blocks.0.mlp.proj_in.weight": torch.randn(256, 128, generator=g).to(torch.bfloat16),
               "blocks.0.mlp.proj_out.weight": torch.randn(128, 256, generator=g).to(torch.bfloat16)},
              str(dm / "toy_cache.safetensors"))
    fp = comfy_inprocess.folder_paths
    fp.add_model_folder_path("seedvr2", str(seedvr2))
    fp.add_model_folder_path("diffusion_models", str(dm))
    return {"seedvr2": seedvr2, "dm": dm}


def _prompt(model: str, keep: str = "", output_name: str = "", format: str = "nvfp4") -> dict:
    return {"1": {"class_type": NODE, "inputs": {
        "model": model, "output_name": output_name, "format": format, "keep_patterns": keep,
        "use_default_keep": True, "device": "cpu", "overwrite": False}}}


def test_model_list_has_seedvr2_each_file_once_and_no_vae(comfy_inprocess, folders):
    options = comfy_inprocess.node_classes[NODE].INPUT_TYPES()["required"]["model"][1]["options"]
    assert "seedvr2/seedvr2_tiny_3b.safetensors" in options, options
    assert "diffusion_models/toy_cache.safetensors" in options
    assert "unet/toy_cache.safetensors" not in options  # the same file under ComfyUI's old folder name
    names = [o.partition("/")[2] for o in options]
    assert len(names) == len(set(names)), options
    assert not any("ema_vae_tiny" in o for o in options), options


def test_vae_file_is_refused_with_a_clear_error(comfy_inprocess, folders):
    res = comfy_inprocess.run(_prompt("seedvr2/ema_vae_tiny.safetensors"))
    assert not res.success
    msg = res.error["exception_message"]
    assert "ema_vae_tiny.safetensors is the SeedVR2 VAE, not a diffusion model" in msg and "Fix:" in msg, msg
    assert not any(folders["seedvr2"].glob("ema_vae_tiny_nvfp4*"))


def test_bad_keep_pattern_names_the_pattern(comfy_inprocess, folders):
    res = comfy_inprocess.run(_prompt("diffusion_models/toy_cache.safetensors", keep="proj_out\nblocks.(0"))
    assert not res.success
    msg = res.error["exception_message"]
    assert "keep_patterns: 'blocks.(0' is not a valid regular expression" in msg and "Fix:" in msg, msg
    assert res.error["exception_type"] == "ValueError", res.error["exception_type"]


def test_runs_again_when_its_output_was_deleted(comfy_inprocess, folders):
    def prompt():  # a fresh prompt per run, as /prompt gets one (the executor writes its fingerprint into it)
        return _prompt("diffusion_models/toy_cache.safetensors", output_name="toy_cache_out")
    out = folders["dm"] / "toy_cache_out.safetensors"
    first = comfy_inprocess.run(prompt())
    assert first.success, first.error
    assert out.exists() and load_file(str(out))["blocks.0.mlp.proj_in.weight"].dtype == torch.uint8
    written = out.stat().st_mtime_ns
    cached = comfy_inprocess.run(prompt())  # output still there: ComfyUI's cache answers, nothing is rewritten
    assert cached.success, cached.error
    assert out.stat().st_mtime_ns == written
    out.unlink()
    again = comfy_inprocess.run(prompt())
    assert again.success, again.error
    assert out.exists(), "the node was cached although its output file was deleted"
    assert load_file(str(out))["blocks.0.mlp.proj_in.weight"].dtype == torch.uint8
    rewritten = out.stat().st_mtime_ns
    assert comfy_inprocess.run(prompt()).success and out.stat().st_mtime_ns == rewritten  # cached again


def test_mxfp8_output_is_comfyuis_layout(comfy_inprocess, folders):
    from seedvr2bw.optimization.nvfp4.checkpoint import read_comfy_quant
    from seedvr2bw.optimization.nvfp4.mxfp8 import quantize_mxfp8
    options = comfy_inprocess.node_classes[NODE].INPUT_TYPES()["required"]["format"][1]["options"]
    assert options == ["nvfp4", "mxfp8", "fp8"], options
    res = comfy_inprocess.run(_prompt("diffusion_models/toy_cache.safetensors", keep="proj_out", format="mxfp8"))
    assert res.success, res.error
    text = res.outputs["1"]["text"][0]
    assert "toy_cache_mxfp8.safetensors (mxfp8): 1 layers quantized" in text and "blocks.0.mlp.proj_out" in text, text
    out = load_file(str(folders["dm"] / "toy_cache_mxfp8.safetensors"))
    src = load_file(str(folders["dm"] / "toy_cache.safetensors"))
    assert read_comfy_quant(out["blocks.0.mlp.proj_in.comfy_quant"])["format"] == "mxfp8"
    q, scales = quantize_mxfp8(src["blocks.0.mlp.proj_in.weight"])
    assert out["blocks.0.mlp.proj_in.weight"].dtype == torch.float8_e4m3fn
    assert torch.equal(out["blocks.0.mlp.proj_in.weight"].view(torch.uint8), q.view(torch.uint8))
    assert out["blocks.0.mlp.proj_in.weight_scale"].dtype == torch.uint8
    assert torch.equal(out["blocks.0.mlp.proj_in.weight_scale"], scales)
    assert torch.equal(out["blocks.0.mlp.proj_out.weight"], src["blocks.0.mlp.proj_out.weight"])  # kept
    assert "blocks.0.mlp.proj_out.comfy_quant" not in out
