"""The pack's SeedVR2 models and ComfyUI 0.19.3's model manager, on the CPU: after the image workflow both models are
in ``comfy.model_management.current_loaded_models``; ComfyUI's "free model and node cache" (POST /free with
``{"unload_models": true, "free_memory": true}``) lets go of them: nothing holds them afterwards, not ComfyUI's
model manager, not its node cache, not the pack; the next run loads them anew.

In process (``tests/rig/free_check.py``, 0.19.3's venv): the model manager read directly, weak references to the
models, and the steps 0.19.3's prompt worker (``main.py``) takes for those flags. Over HTTP: the real POST /free,
seen in the next run, whose loader nodes run again instead of coming from the cache.

What only a GPU can show (``tests/rig/README.md`` lists it too): Dynamic VRAM. 0.19.3 turns it on only on an NVIDIA
GPU without ``--cpu`` (``comfy_aimdo.control.init_device``; ``cli_args.enables_dynamic_vram`` is False under
``--cpu``), and ``ModelPatcherDynamic`` falls back to the plain ``ModelPatcher`` for a CPU load device; on the CPU
both the pack's models and ComfyUI's are plain ``ModelPatcher``s (checked here: ``dynamic_vram`` False,
``is_dynamic()`` False). Where Dynamic VRAM is on, ComfyUI's own loaders make ``ModelPatcherDynamic``s
(``CoreModelPatcher``) while the pack makes ``comfy.model_patcher.ModelPatcher``s: how ``free_memory`` weighs the
two kinds against each other, and whether the DiT's own staging (pinned host copy, BlockSwap ring) and aimdo's
virtual VRAM bars leave each other room, can only be measured on the GPU.
"""
from __future__ import annotations

import json
import subprocess
import time

from .conftest import REPO
from .test_next_comfyui import seedvr2_prompt

UPSCALE = {"resolution": 16, "batch_size": 5, "temporal_overlap": 1}
LOADERS = ("SeedVR2BW_LoadDiT", "SeedVR2BW_LoadVAE")


def _cached_nodes(entry: dict) -> set[str]:
    return {n for event, data in entry["status"]["messages"] if event == "execution_cached" for n in data["nodes"]}


def test_free_lets_go_of_our_models_in_process_0193(next_rig, next_server, pack_parent, tmp_path):
    tree, python = next_rig
    prompt = seedvr2_prompt(next_server, "seedvr2_image_upscale.json", **UPSCALE)
    for d in ("output", "input", "temp"):
        (tmp_path / d).mkdir()
    (tmp_path / "input" / "example.png").symlink_to(next_server.input_dir / "example.png")
    job = {"comfy_dir": str(tree), "custom_node_dirs": [str(pack_parent)], "output_dir": str(tmp_path / "output"),
           "input_dir": str(tmp_path / "input"), "temp_dir": str(tmp_path / "temp"),
           "model_dirs": {"seedvr2": str(next_server.models_dir / "SEEDVR2")}, "prompts": [prompt]}
    (tmp_path / "job.json").write_text(json.dumps(job))
    r = subprocess.run([str(python), str(REPO / "tests" / "rig" / "free_check.py"), str(tmp_path / "job.json"),
                        str(tmp_path / "result.json")], cwd=str(tree), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    res = json.loads((tmp_path / "result.json").read_text())
    assert res["comfyui_version"] == "0.19.3"
    first, again = res["results"]
    assert first["success"], json.dumps(first["error"])[:3000]
    # both models went through ComfyUI's model manager, as plain ModelPatchers (no Dynamic VRAM on the CPU)
    assert sorted(m["module_class"] for m in res["before"]) == ["NaDiT", "VideoAutoencoder"], res["before"]
    assert {(m["patcher_class"], m["is_dynamic"], m["device"]) for m in res["before"]} == {("ModelPatcher", False,
                                                                                            "cpu")}
    assert res["dynamic_vram"] is False
    # unloading alone leaves them in ComfyUI's node cache (the loaders' outputs); after the whole free the model
    # manager lists none of ours, and nothing else holds them
    assert res["alive_after_unload"] == ["NaDiT module", "NaDiT patcher", "VideoAutoencoder module",
                                         "VideoAutoencoder patcher"], res["alive_after_unload"]
    assert res["after"] == [], res["after"]
    assert res["alive_after"] == [], f"still held after /free: {res['alive_after']}"
    assert again["success"], json.dumps(again["error"])[:3000]


def test_free_over_http_drops_the_loaded_models_0193(next_server):
    prompt = seedvr2_prompt(next_server, "seedvr2_image_upscale.json", **UPSCALE)
    ids = {p["class_type"]: k for k, p in prompt.items()}
    first = next_server.run_prompt(prompt, timeout=600)
    assert first["status"]["status_str"] == "success", json.dumps(first["status"])[:3000]
    cached = next_server.run_prompt(prompt, timeout=600)          # the same prompt: the loaders come from the cache
    assert {ids[n] for n in LOADERS} <= _cached_nodes(cached), cached["status"]["messages"]
    status, _ = next_server.request("POST", "/free", {"unload_models": True, "free_memory": True})
    assert status == 200
    time.sleep(1.0)                                               # the prompt worker takes the flags when it wakes
    after = next_server.run_prompt(prompt, timeout=600)
    assert after["status"]["status_str"] == "success", json.dumps(after["status"])[:3000]
    assert not {ids[n] for n in LOADERS} & _cached_nodes(after), "the loaders' models were still cached after /free"
    assert next_server.get_json("/system_stats")["devices"][0]["type"] == "cpu"
