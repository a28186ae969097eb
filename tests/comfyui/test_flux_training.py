"""workflows/flux_lora_train.json through ComfyUI's own executor (in-process and over /prompt), on a FLUX.1 model
that ComfyUI's loaders detect (tiny_flux.py): train, save into models/loras, LoraLoader + KSampler with the LoRA.

ComfyUI runs every prompt inside ``torch.inference_mode()`` and builds its models there: these tests are the ones
that would have caught training failing inside it (the unit tests call ``execute()`` outside it)."""
from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import numpy as np
import pytest

from .tiny_flux import CLIP_L, UNET, VAE, write_dataset, write_tiny_flux_files
from .ui_to_api import from_node_classes, from_object_info, ui_to_api

REPO = Path(__file__).resolve().parents[2]
WORKFLOW = REPO / "workflows" / "flux_lora_train.json"
DATASET = "flux_lora_dataset"   # the folder name the shipped workflow uses, inside ComfyUI's input folder


def _ids(wf: dict) -> dict:
    return {n["type"]: n["id"] for n in wf["nodes"]}


def tiny_ui_workflow(output_name: str = "e2e/tiny_lora", steps: int = 2, resume: bool = False,
                     overwrite: bool = False) -> dict:
    """The shipped UI workflow, pointed at the tiny files and made CPU-sized: CLIP-L through CLIPLoader(sd3) in
    place of DualCLIPLoader (see tiny_flux.py), 256² dataset, a few steps, one 64² sampling step."""
    wf = json.loads(WORKFLOW.read_text())
    for n in wf["nodes"]:
        t, v = n["type"], n["widgets_values"]
        if t == "UNETLoader":
            v[0] = UNET
        elif t == "DualCLIPLoader":
            n["type"] = "CLIPLoader"
            n["widgets_values"] = [CLIP_L, "sd3", "default"]
        elif t == "VAELoader":
            v[0] = VAE
        elif t == "SeedVR2BW_FluxLoraDataset":
            v[0], v[3] = DATASET, 256
        elif t == "SeedVR2BW_FluxLoraSettings":
            # steps, rank, alpha, optimizer, lr, ...; save_every / preview_every off
            v[0], v[1], v[2], v[4] = steps, 4, 4.0, 1e-3
            v[20], v[22] = 0, 0
        elif t == "SeedVR2BW_FluxLoraTrain":
            n["widgets_values"] = [output_name, resume, overwrite]
        elif t == "EmptySD3LatentImage":
            v[0], v[1] = 64, 64
        elif t == "KSampler":
            v[2] = 1
    return wf


def _check_settings_positions(wf_node_types):
    """The widget positions tiny_ui_workflow() writes must be the ones it means (schema order)."""
    from seedvr2bw.nodes.training import FluxLoraSettingsNode
    names = [i.id for i in FluxLoraSettingsNode.GET_SCHEMA().inputs]
    # the frontend adds seed's control widget right after "seed"
    names.insert(names.index("seed") + 1, "control_after_generate")
    assert [names[i] for i in (0, 1, 2, 4, 20, 22)] == ["steps", "rank", "alpha", "learning_rate", "save_every",
                                                         "preview_every"], names


def with_base_branch(prompt: dict) -> dict:
    """Adds a second KSampler -> VAEDecode -> SaveImage on the model without the LoRA, same seed and inputs."""
    p = copy.deepcopy(prompt)
    ks = next(k for k, n in p.items() if n["class_type"] == "KSampler")
    dec = next(k for k, n in p.items() if n["class_type"] == "VAEDecode")
    unet = next(k for k, n in p.items() if n["class_type"] == "UNETLoader")
    p["112"] = copy.deepcopy(p[ks])
    p["112"]["inputs"]["model"] = [unet, 0]
    p["113"] = copy.deepcopy(p[dec])
    p["113"]["inputs"]["samples"] = ["112", 0]
    p["114"] = {"class_type": "SaveImage", "inputs": {"images": ["113", 0], "filename_prefix": "flux_base"}}
    return p


def train_only(prompt: dict) -> dict:
    """The prompt cut down to what the train node needs (it is an output node itself)."""
    keep = {"UNETLoader", "CLIPLoader", "VAELoader", "SeedVR2BW_FluxLoraDataset", "SeedVR2BW_FluxLoraSettings",
            "SeedVR2BW_FluxLoraTrain"}
    return {k: n for k, n in prompt.items() if n["class_type"] in keep}


def _images(out_dir: Path, outputs: dict, node: str) -> np.ndarray:
    from PIL import Image
    it = outputs[node]["images"][0]
    with Image.open(out_dir / it.get("subfolder", "") / it["filename"]) as im:
        return np.asarray(im.convert("RGB"), dtype=np.int16)


def _lora_tensors(path: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(path))


# ------------------------------------------------------------------------------------------ in-process
@pytest.fixture(scope="module")
def rig(comfy_inprocess, tmp_path_factory):
    """Tiny FLUX files registered as ComfyUI's default model folders, the dataset in the input folder."""
    fp = comfy_inprocess.folder_paths
    models = tmp_path_factory.mktemp("flux_models")
    files = write_tiny_flux_files(models / "files")
    for kind, name in (("diffusion_models", "unet"), ("text_encoders", "clip_l"), ("vae", "vae")):
        d = models / kind
        d.mkdir()
        (d / files[name].name).symlink_to(files[name])
    write_dataset(Path(fp.get_input_directory()) / DATASET)
    loras = models / "loras"
    loras.mkdir()

    def use_folders():   # other tests move their own folders to the front; ours go first again
        for kind in ("diffusion_models", "text_encoders", "vae", "loras"):
            fp.add_model_folder_path(kind, str(models / kind), is_default=True)
        return loras
    use_folders()
    _check_settings_positions(None)
    return comfy_inprocess, use_folders


def _api(comfy, wf):
    return ui_to_api(wf, from_node_classes(comfy.node_classes))


def test_training_workflow_runs_in_comfyui_executor(rig, caplog):
    comfy, use_folders = rig
    loras = use_folders()
    prompt = with_base_branch(_api(comfy, tiny_ui_workflow("e2e/tiny_lora")))
    caplog.set_level(logging.WARNING)
    res = comfy.run(prompt)
    assert res.success, (res.status, json.dumps(res.error)[:3000])
    lora = loras / "e2e" / "tiny_lora.safetensors"
    assert lora.is_file() and (loras / "e2e" / "tiny_lora-state.pt").is_file()
    train_id = str(_ids(tiny_ui_workflow())["SeedVR2BW_FluxLoraTrain"])
    assert res.outputs[train_id]["text"] == ["saved e2e/tiny_lora.safetensors (2 steps)"], res.outputs[train_id]
    sd = _lora_tensors(lora)
    assert len([k for k in sd if k.endswith(".lora_down.weight")]) == 13   # 10 Linears per double + 3 per single
    assert not [r.getMessage() for r in caplog.records if "lora key not loaded" in r.getMessage()]
    assert "progress" in res.event_names()
    out_dir = Path(comfy.folder_paths.get_output_directory())
    save_id = str(_ids(tiny_ui_workflow())["SaveImage"])
    with_lora, base = _images(out_dir, res.outputs, save_id), _images(out_dir, res.outputs, "114")
    assert with_lora.shape == base.shape == (64, 64, 3)
    assert np.abs(with_lora - base).max() > 0, "the LoRA did not change the sampler's output"
    # the model ComfyUI holds is usable by the next prompt: the same graph again with new settings
    again = comfy.run(train_only(_api(comfy, tiny_ui_workflow("e2e/tiny_lora_2", steps=1))))
    assert again.success, json.dumps(again.error)[:3000]


def test_resume_in_comfyui_equals_an_uninterrupted_run(rig):
    comfy, use_folders = rig
    loras = use_folders()
    first = comfy.run(train_only(_api(comfy, tiny_ui_workflow("resume/a", steps=2, resume=True))))
    assert first.success, json.dumps(first.error)[:3000]
    cont = comfy.run(train_only(_api(comfy, tiny_ui_workflow("resume/a", steps=4, resume=True))))
    assert cont.success, json.dumps(cont.error)[:3000]
    straight = comfy.run(train_only(_api(comfy, tiny_ui_workflow("resume/b", steps=4, resume=False))))
    assert straight.success, json.dumps(straight.error)[:3000]
    a, b = _lora_tensors(loras / "resume" / "a.safetensors"), _lora_tensors(loras / "resume" / "b.safetensors")
    assert a.keys() == b.keys()
    diff = {k: (a[k].float() - b[k].float()).abs().max().item() for k in a if not (a[k] == b[k]).all()}
    assert not diff, diff


def test_output_name_escape_and_overwrite_through_the_executor(rig, tmp_path):
    comfy, use_folders = rig
    loras = use_folders()
    bad = comfy.run(train_only(_api(comfy, tiny_ui_workflow("../../escaped", steps=1))))
    assert not bad.success and bad.status == "execution_error"
    assert "inside models/loras" in bad.error["exception_message"], bad.error
    assert not list(loras.parent.glob("escaped*")) and not list(loras.parent.parent.glob("escaped*"))
    ok = comfy.run(train_only(_api(comfy, tiny_ui_workflow("ow/x", steps=1))))
    assert ok.success, json.dumps(ok.error)[:3000]
    before = (loras / "ow" / "x.safetensors").read_bytes()
    again = comfy.run(train_only(_api(comfy, tiny_ui_workflow("ow/x", steps=2))))
    assert not again.success and "already exists" in again.error["exception_message"], again.error
    assert (loras / "ow" / "x.safetensors").read_bytes() == before
    replaced = comfy.run(train_only(_api(comfy, tiny_ui_workflow("ow/x", steps=2, overwrite=True))))
    assert replaced.success, json.dumps(replaced.error)[:3000]
    assert (loras / "ow" / "x.safetensors").read_bytes() != before


# ------------------------------------------------------------------------------------------ over HTTP
def _server_models(comfy_server, comfy_inprocess):
    """The tiny files (made with the in-process ComfyUI's classes) linked into the server's own model folders."""
    files = write_tiny_flux_files(comfy_server.workdir / "flux_files")
    d = comfy_server.models_dir
    for kind, name in (("diffusion_models", "unet"), ("text_encoders", "clip_l"), ("vae", "vae")):
        link = d / kind / files[name].name
        if not link.exists():
            link.symlink_to(files[name])
    write_dataset(comfy_server.input_dir / DATASET)
    return d / "loras"


def test_training_workflow_runs_over_http(comfy_server, comfy_inprocess):
    loras = _server_models(comfy_server, comfy_inprocess)
    info = comfy_server.object_info()
    prompt = with_base_branch(ui_to_api(tiny_ui_workflow("http/tiny_lora"), from_object_info(info)))
    entry = comfy_server.run_prompt(prompt, timeout=600)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[:3000]
    assert (loras / "http" / "tiny_lora.safetensors").is_file()
    assert "lora key not loaded" not in comfy_server.log_text()
    with_lora = _images(comfy_server.output_dir, entry["outputs"], str(_ids(tiny_ui_workflow())["SaveImage"]))
    base = _images(comfy_server.output_dir, entry["outputs"], "114")
    assert np.abs(with_lora - base).max() > 0


# ------------------------------------------------------------------------------------------ #29: controls, memory plan
def _node(prompt: dict, class_type: str) -> str:
    return next(k for k, n in prompt.items() if n["class_type"] == class_type)


def test_training_controls_through_the_executor(rig):
    """Caption dropout, EMA, a separate validation dataset with keep-best and regularisation images, set on the
    nodes: the EMA and best files are written beside the LoRA and every file loads."""
    comfy, use_folders = rig
    loras = use_folders()
    prompt = train_only(_api(comfy, tiny_ui_workflow("controls/c", steps=3)))
    st = prompt[_node(prompt, "SeedVR2BW_FluxLoraSettings")]["inputs"]
    st.update(caption_dropout=0.5, ema_decay=0.9, validation_every=1, keep_best=True, reg_weight=0.5)
    ds = _node(prompt, "SeedVR2BW_FluxLoraDataset")
    prompt["120"] = copy.deepcopy(prompt[ds])    # the same images serve as validation and regularisation sets
    train = prompt[_node(prompt, "SeedVR2BW_FluxLoraTrain")]["inputs"]
    train["validation_dataset"], train["reg_dataset"] = ["120", 0], ["120", 0]
    res = comfy.run(prompt)
    assert res.success, json.dumps(res.error)[:3000]
    for name in ("c.safetensors", "c_ema.safetensors", "c-best.safetensors"):
        sd = _lora_tensors(loras / "controls" / name)
        assert len([k for k in sd if k.endswith(".lora_down.weight")]) == 13, name
    from safetensors import safe_open
    with safe_open(str(loras / "controls" / "c-best.safetensors"), "pt") as f:
        assert 1 <= int(f.metadata()["ss_best_step"]) <= 3


def test_a_plan_that_cannot_fit_fails_before_loading(rig):
    comfy, use_folders = rig
    loras = use_folders()
    prompt = train_only(_api(comfy, tiny_ui_workflow("noroom/x", steps=1)))
    prompt[_node(prompt, "SeedVR2BW_FluxLoraSettings")]["inputs"]["vram_budget_gib"] = 0.001
    cache = Path(comfy.folder_paths.get_output_directory()) / "flux_lora_cache"
    before = sorted(cache.glob("*")) if cache.is_dir() else []
    res = comfy.run(prompt)
    assert not res.success and res.status == "execution_error"
    msg = res.error["exception_message"]
    assert "does not fit in 0.0 GiB" in msg and "Fix:" in msg and "blocks swapped" in msg, msg
    assert res.error["exception_type"].endswith("TrainMemoryError")
    assert not (loras / "noroom").exists()
    assert (sorted(cache.glob("*")) if cache.is_dir() else []) == before   # nothing encoded either


@pytest.mark.parametrize("precision", ["fp8", "nvfp4"])
def test_quantized_base_through_the_executor(rig, precision):
    """A quantized base made on the host (the train node no longer loads the model onto the device): the LoRA is
    written with every key, and the model ComfyUI holds samples again afterwards (exact restore: test_training_staging)."""
    comfy, use_folders = rig
    loras = use_folders()
    wf = tiny_ui_workflow(f"quant/{precision}")
    prompt = with_base_branch(_api(comfy, wf))
    prompt[_node(prompt, "SeedVR2BW_FluxLoraSettings")]["inputs"]["base_precision"] = precision
    res = comfy.run(prompt)
    assert res.success, json.dumps(res.error)[:3000]
    sd = _lora_tensors(loras / "quant" / f"{precision}.safetensors")
    assert len([k for k in sd if k.endswith(".lora_down.weight")]) == 13
    need, todo = set(), ["114"]   # the base branch and what it reads, without the train node
    while todo:
        k = todo.pop()
        if k not in need:
            need.add(k)
            todo += [v[0] for v in prompt[k]["inputs"].values() if isinstance(v, list) and len(v) == 2]
    base_only = copy.deepcopy({k: prompt[k] for k in need})
    base_only["112"]["inputs"]["seed"] = 12345   # a new seed: sampled again, not taken from ComfyUI's cache
    again = comfy.run(base_only)
    assert again.success, json.dumps(again.error)[:3000]
    assert _images(Path(comfy.folder_paths.get_output_directory()), again.outputs, "114").shape == (64, 64, 3)
