"""The pack inside a real ComfyUI 0.3.75, run in-process through ComfyUI's own PromptExecutor."""
from __future__ import annotations

import importlib
import time
from pathlib import Path

import pytest

from .conftest import REPO
from .prompts import LONG_NODE_ID, PACK_PROMPTS, REQUIRED_NODE_IDS, benchmark_prompt, core_only_prompt, \
    hardware_report_prompt, image_roundtrip_prompt


def test_pack_loads_from_an_unusual_folder_name(comfy_inprocess, pack_parent):
    dirs = {Path(d).name: d for d in comfy_inprocess.loaded_module_dirs.values()}
    link = pack_parent / "ComfyUI-SeedVR2 Blackwell test"
    assert link.name in dirs, f"the pack was not loaded from {link}: {sorted(dirs)}"


def test_every_pack_node_is_registered(comfy_inprocess, pack_node_ids, pack_parent):
    assert REQUIRED_NODE_IDS <= set(pack_node_ids), pack_node_ids
    registered = set(comfy_inprocess.node_classes)
    assert set(pack_node_ids) <= registered, sorted(set(pack_node_ids) - registered)
    # ...and they were registered by the pack module ComfyUI loaded from the custom_nodes folder.
    from_pack = comfy_inprocess.pack_node_ids(str(pack_parent / "ComfyUI-SeedVR2 Blackwell test"))
    assert set(pack_node_ids) == set(from_pack), (pack_node_ids, from_pack)


def test_every_feature_module_imports_inside_comfyui(comfy_inprocess):
    """nodes/__init__.py skips a feature module that fails to import (and logs why); in the test
    environment every feature module that exists must import, so the skip can't hide a bug."""
    from seedvr2bw.nodes import FEATURE_MODULES
    present = [m for m in FEATURE_MODULES if (REPO / "nodes" / f"{m}.py").is_file()]
    assert "hardware" in present
    for name in present:
        module = importlib.import_module(f"seedvr2bw.nodes.{name}")
        assert module.NODES, f"nodes/{name}.py has an empty NODES list"


@pytest.mark.parametrize("case", PACK_PROMPTS, ids=lambda c: c.name)
def test_pack_prompt_runs(comfy_inprocess, case):
    missing = case.node_ids - set(comfy_inprocess.node_classes)
    if missing:
        if case.optional:
            pytest.skip(f"optional nodes not registered: {sorted(missing)}")
        pytest.fail(f"nodes not registered: {sorted(missing)}")
    res = comfy_inprocess.run(case.build())
    assert res.success, (res.status, res.error, res.node_errors)
    case.check(res.outputs)


def test_core_image_roundtrip_writes_a_file(comfy_inprocess):
    res = comfy_inprocess.run(image_roundtrip_prompt(prefix="inproc_roundtrip"))
    assert res.success, res.error
    images = res.outputs["9"]["images"]
    out = Path(comfy_inprocess.folder_paths.get_output_directory()) / images[0]["subfolder"] / images[0]["filename"]
    assert out.is_file() and out.stat().st_size > 0


def test_invalid_prompt_is_rejected_like_the_server_does(comfy_inprocess):
    bad = hardware_report_prompt()
    del bad["1"]["inputs"]["attention"]  # a required input left out
    res = comfy_inprocess.run(bad)
    assert not res.success and res.status == "invalid"
    assert "1" in res.node_errors, res.node_errors


def test_interrupt_stops_the_long_node_cleanly(comfy_inprocess):
    th, box = comfy_inprocess.run_in_thread(benchmark_prompt(seconds=120, size=64))
    t0 = time.time()
    while time.time() - t0 < 60 and not any(e == "progress" for e, _ in comfy_inprocess.events_so_far()):
        time.sleep(0.05)
    assert any(e == "progress" for e, _ in comfy_inprocess.events_so_far()), "the long node never reported progress"
    t_int = time.time()
    comfy_inprocess.interrupt()
    th.join(timeout=30)
    assert not th.is_alive(), "the run did not stop within 30 s of the interrupt"
    assert "exception" not in box, box.get("exception")
    res = box["result"]
    assert res.status == "execution_interrupted", (res.status, res.error)
    assert res.error["node_type"] == LONG_NODE_ID
    assert time.time() - t_int < 10, "the interrupt took too long to land"
    # The executor is healthy: the next prompts run normally.
    again = comfy_inprocess.run(core_only_prompt("after interrupt"))
    assert again.success, again.error
    assert again.outputs["2"]["text"][0] == "after interrupt!"
    quick = comfy_inprocess.run(benchmark_prompt(seconds=0.2, size=64))
    assert quick.success, quick.error


def test_diagnostic_node_runs_in_the_executor(comfy_inprocess):
    res = comfy_inprocess.run({
        "1": {"class_type": "SeedVR2BW_Diagnostic", "inputs": {"quick": True, "details": False}},
        "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 1]}},
    })
    assert res.success, (res.status, res.error)
    report = res.outputs["1"]["text"][0]
    assert any(word in report for word in ("PASS", "WARN", "SKIP")), report
    import json as _json
    data = _json.loads(res.outputs["2"]["text"][0])   # the json output, through a core node
    assert data, data


def test_convert_node_runs_in_the_executor(comfy_inprocess, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file
    g = torch.Generator().manual_seed(0)
    models = tmp_path / "dm"
    models.mkdir()
    save_file({"blocks.0.mlp.proj_in.weight": torch.randn(256, 128, generator=g).to(torch.bfloat16),
               "blocks.0.mlp.proj_out.weight": torch.randn(128, 256, generator=g).to(torch.bfloat16),
               "blocks.0.norm.weight": torch.ones(128)}, str(models / "toy_exec.safetensors"))
    comfy_inprocess.folder_paths.add_model_folder_path("diffusion_models", str(models))
    prompt = {"1": {"class_type": "SeedVR2BW_ConvertToNVFP4", "inputs": {
        "model": "diffusion_models/toy_exec.safetensors", "output_name": "", "format": "nvfp4",
        "keep_patterns": "proj_out", "use_default_keep": True, "device": "cpu", "overwrite": False}}}
    res = comfy_inprocess.run(prompt)
    assert res.success, (res.status, res.error)
    assert "1 layers quantized" in res.outputs["1"]["text"][0], res.outputs
    out = load_file(str(models / "toy_exec_nvfp4.safetensors"))
    assert out["blocks.0.mlp.proj_in.weight"].dtype == torch.uint8
    prompt["1"]["inputs"]["keep_patterns"] = ""   # other settings, same output name: refused unless overwrite
    again = comfy_inprocess.run(prompt)
    assert not again.success and "overwrite" in again.error["exception_message"], again.error
