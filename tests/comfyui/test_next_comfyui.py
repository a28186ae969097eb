"""The pack in the second rig, ComfyUI 0.19.3 (2026; ``tests/rig/setup_comfyui_next.sh`` from ``../shared``):
every node registers, and the FLUX LoRA training workflow runs through its executor, over /prompt and in-process
(a process of its own: one ComfyUI per process). Skipped with the reason where ``../shared`` has no 0.19.3 tree
(a user's fresh clone); under CI a tree that is there but not set up fails."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from rig.server import PACK_FOLDER_NAME

from .conftest import REPO
from .test_flux_training import _ids, _images, _server_models, tiny_ui_workflow, with_base_branch
from .ui_to_api import from_object_info, ui_to_api


def test_every_pack_node_registers_in_0193(next_server, pack_node_ids):
    assert next_server.get_json("/system_stats")["system"]["comfyui_version"] == "0.19.3"
    info = next_server.object_info()
    missing = set(pack_node_ids) - set(info)
    assert not missing, f"not registered in ComfyUI 0.19.3: {sorted(missing)}"
    bad = [line for line in next_server.log_text().splitlines()
           if PACK_FOLDER_NAME in line and "IMPORT FAILED" in line]
    assert not bad, bad


def test_training_workflow_over_http_in_0193(next_server, comfy_inprocess):
    loras = _server_models(next_server, comfy_inprocess)
    prompt = with_base_branch(ui_to_api(tiny_ui_workflow("next_http/tiny"), from_object_info(next_server.object_info())))
    entry = next_server.run_prompt(prompt, timeout=600)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[:3000]
    assert (loras / "next_http" / "tiny.safetensors").is_file()
    assert "lora key not loaded" not in next_server.log_text()
    save = str(_ids(tiny_ui_workflow())["SaveImage"])
    assert np.abs(_images(next_server.output_dir, entry["outputs"], save)
                  - _images(next_server.output_dir, entry["outputs"], "114")).max() > 0


def test_training_workflow_in_process_in_0193(next_rig, next_server, comfy_inprocess, pack_parent, tmp_path):
    """ComfyUI 0.19.3's PromptExecutor in a process of its own (tests/rig/run_prompts.py): train, then resume."""
    tree, python = next_rig
    loras = _server_models(next_server, comfy_inprocess)   # the same tiny files, the same model folders
    info = next_server.object_info()
    first = with_base_branch(ui_to_api(tiny_ui_workflow("next_inproc/tiny", steps=2), from_object_info(info)))
    cont = ui_to_api(tiny_ui_workflow("next_inproc/tiny", steps=3, resume=True), from_object_info(info))
    for d in ("output", "input", "temp"):
        (tmp_path / d).mkdir()
    (tmp_path / "input" / "flux_lora_dataset").symlink_to(next_server.input_dir / "flux_lora_dataset")
    job = {"comfy_dir": str(tree), "custom_node_dirs": [str(pack_parent)], "output_dir": str(tmp_path / "output"),
           "input_dir": str(tmp_path / "input"), "temp_dir": str(tmp_path / "temp"),
           "model_dirs": {k: str(next_server.models_dir / k) for k in ("diffusion_models", "text_encoders", "vae",
                                                                      "loras")},
           "prompts": [first, cont]}
    (tmp_path / "job.json").write_text(json.dumps(job))
    r = subprocess.run([str(python), str(REPO / "tests" / "rig" / "run_prompts.py"), str(tmp_path / "job.json"),
                        str(tmp_path / "result.json")], cwd=str(tree), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    res = json.loads((tmp_path / "result.json").read_text())
    assert res["comfyui_version"] == "0.19.3"
    a, b = res["results"]
    assert a["success"], json.dumps(a["error"])[:3000]
    assert b["success"], json.dumps(b["error"])[:3000]
    train = str(_ids(tiny_ui_workflow())["SeedVR2BW_FluxLoraTrain"])
    assert a["outputs"][train]["text"] == ["saved next_inproc/tiny.safetensors (2 steps)"]
    assert b["outputs"][train]["text"] == ["saved next_inproc/tiny.safetensors (3 steps)"]
    assert (loras / "next_inproc" / "tiny.safetensors").is_file()
    save = str(_ids(tiny_ui_workflow())["SaveImage"])
    out = Path(tmp_path / "output")
    assert np.abs(_images(out, a["outputs"], save) - _images(out, a["outputs"], "114")).max() > 0


def _tiny_seedvr2(next_server) -> None:
    """The tiny SeedVR2 models in the server's models/SEEDVR2 and an input image example.png."""
    import sys
    from PIL import Image
    sys.path.insert(0, str(REPO / "tests"))
    from make_tiny_models import make_tiny_models
    seed_dir = next_server.models_dir / "SEEDVR2"
    if not (seed_dir / "seedvr2_tiny_3b.safetensors").exists():
        tmp = next_server.workdir / "tiny_seedvr2"
        for kind, p in make_tiny_models(tmp).items():
            (seed_dir / Path(p).name).symlink_to(p)
    rng = np.random.default_rng(0)
    Image.fromarray((rng.random((24, 40, 3)) * 255).astype(np.uint8)).save(next_server.input_dir / "example.png")


def seedvr2_prompt(next_server, name: str, **upscale) -> dict:
    """The example workflow ``workflows/<name>`` as an API prompt on the tiny models, the upscaler's inputs updated."""
    _tiny_seedvr2(next_server)
    wf = json.loads((REPO / "workflows" / name).read_text())
    prompt = ui_to_api(wf, from_object_info(next_server.object_info()))
    ids = {n["type"]: str(n["id"]) for n in wf["nodes"]}
    prompt[ids["SeedVR2BW_LoadDiT"]]["inputs"]["model"] = "seedvr2_tiny_3b.safetensors"
    prompt[ids["SeedVR2BW_LoadVAE"]]["inputs"]["model"] = "ema_vae_tiny.safetensors"
    prompt[ids["SeedVR2BW_Upscale"]]["inputs"].update(upscale)
    if "RepeatImageBatch" in ids:
        prompt[ids["RepeatImageBatch"]]["inputs"]["amount"] = 6
    return prompt


@pytest.mark.parametrize("name", ["seedvr2_image_upscale.json", "seedvr2_video_upscale.json"])
def test_seedvr2_workflows_over_http_in_0193(next_server, name):
    prompt = seedvr2_prompt(next_server, name, resolution=16, batch_size=5, temporal_overlap=1)
    entry = next_server.run_prompt(prompt, timeout=600)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[:3000]
    outs = [o for o in entry["outputs"].values() if o.get("images")]
    assert outs, entry["outputs"]


def test_error_type_is_short_in_0193(next_server):
    """0.19.3's error panel prints ``type.__module__ + "." + name``: the pack's types say ``seedvr2bw.<Name>``, not the
    folder path of the pack, so the message that follows is not cut off."""
    prompt = seedvr2_prompt(next_server, "seedvr2_image_upscale.json", resolution=16, batch_size=4)
    entry = next_server.run_prompt(prompt, timeout=600)
    errors = [data for event, data in entry["status"]["messages"] if event == "execution_error"]
    assert errors, json.dumps(entry["status"])[:3000]
    assert errors[0]["exception_type"] == "seedvr2bw.SeedVR2InputError", errors[0]["exception_type"]
    assert "4n+1" in errors[0]["exception_message"]
