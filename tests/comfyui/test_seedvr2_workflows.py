"""The example SeedVR2 workflows (workflows/seedvr2_*.json, UI format) run end to end in a real ComfyUI on
CPU with the tiny checkpoints (tests/make_tiny_models.py), converted to API prompts by ui_to_api.py."""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from .ui_to_api import WorkflowConversionError, from_node_classes, ui_to_api

REPO = Path(__file__).resolve().parents[2]
WORKFLOWS = REPO / "workflows"
IMAGE_WF = WORKFLOWS / "seedvr2_image_upscale.json"
VIDEO_WF = WORKFLOWS / "seedvr2_video_upscale.json"
PACK_NODES = {"SeedVR2BW_LoadDiT", "SeedVR2BW_LoadVAE", "SeedVR2BW_Upscale"}
IN_W, IN_H = 40, 24   # input image size (landscape)


def _node_id(wf: dict, ctype: str) -> int:
    return next(n["id"] for n in wf["nodes"] if n["type"] == ctype)


@pytest.fixture(scope="module")
def tiny(comfy_inprocess, tmp_path_factory):
    """Tiny models in a SEEDVR2 folder registered with folder_paths, and an input image example.png."""
    import sys
    sys.path.insert(0, str(REPO / "tests"))
    from make_tiny_models import make_tiny_models
    models = tmp_path_factory.mktemp("models")
    paths = make_tiny_models(models, flux=True)
    fp = comfy_inprocess.folder_paths
    fp.add_model_folder_path("seedvr2", str(models / "SEEDVR2"))
    from PIL import Image
    rng = np.random.default_rng(0)
    arr = (rng.random((IN_H, IN_W, 3)) * 255).astype(np.uint8)
    Image.fromarray(arr).save(os.path.join(fp.get_input_directory(), "example.png"))
    rgba = np.concatenate([arr, np.full((IN_H, IN_W, 1), 200, np.uint8)], axis=-1)
    Image.fromarray(rgba, "RGBA").save(os.path.join(fp.get_input_directory(), "example_rgba.png"))
    return paths


def _convert(comfy, path, overrides=None):
    wf = json.loads(Path(path).read_text())
    return wf, ui_to_api(wf, from_node_classes(comfy.node_classes), overrides)


def _tiny_overrides(wf, **upscale):
    return {
        _node_id(wf, "SeedVR2BW_LoadDiT"): {"model": "seedvr2_tiny_3b.safetensors"},
        _node_id(wf, "SeedVR2BW_LoadVAE"): {"model": "ema_vae_tiny.safetensors"},
        _node_id(wf, "SeedVR2BW_Upscale"): upscale,
    }


def _output_files(comfy, outputs, node_id, key="images"):
    out_dir = Path(comfy.folder_paths.get_output_directory())
    items = outputs[str(node_id)][key]
    return [out_dir / it.get("subfolder", "") / it["filename"] for it in items]


# ----------------------------------------------------------------------------------------- static checks
@pytest.mark.parametrize("path", [IMAGE_WF, VIDEO_WF], ids=["image", "video"])
def test_workflow_is_ui_format_and_matches_schemas(comfy_inprocess, tiny, path):
    wf = json.loads(path.read_text())
    assert wf["version"] == 0.4 and wf["links"] and wf["nodes"]
    for n in wf["nodes"]:
        assert {"id", "type", "pos", "size", "inputs", "outputs", "widgets_values"} <= set(n), n["type"]
    types = {n["type"] for n in wf["nodes"]} - {"Note"}
    missing = [t for t in types if t not in comfy_inprocess.node_classes]
    assert not missing, f"node types not registered: {missing}"
    assert PACK_NODES <= types
    prompt = ui_to_api(wf, from_node_classes(comfy_inprocess.node_classes))  # raises on widget mismatch
    ok, err, _outs, node_errors = comfy_inprocess.validate(_tiny_prompt_for_validation(comfy_inprocess, wf, prompt))
    assert ok, (err, node_errors)


def _tiny_prompt_for_validation(comfy, wf, prompt):
    for nid, ch in _tiny_overrides(wf).items():
        prompt[str(nid)]["inputs"].update(ch)
    return prompt


def test_converter_rejects_wrong_widget_count(comfy_inprocess):
    wf = json.loads(IMAGE_WF.read_text())
    up = next(n for n in wf["nodes"] if n["type"] == "SeedVR2BW_Upscale")
    up["widgets_values"] = up["widgets_values"][:-1]
    with pytest.raises(WorkflowConversionError, match="widget"):
        ui_to_api(wf, from_node_classes(comfy_inprocess.node_classes))


def _options(comfy, node_id: str) -> list[str]:
    return comfy.node_classes[node_id].INPUT_TYPES()["required"]["model"][1]["options"]


def test_model_lists_show_tiny_files(comfy_inprocess, tiny):
    dit, vae = _options(comfy_inprocess, "SeedVR2BW_LoadDiT"), _options(comfy_inprocess, "SeedVR2BW_LoadVAE")
    assert "seedvr2_tiny_3b.safetensors" in dit and "seedvr2_tiny_7b.safetensors" in dit
    assert "ema_vae_tiny.safetensors" in vae and "ema_vae_tiny.safetensors" not in dit
    assert not any(n.startswith(("pos_emb", "neg_emb")) for n in dit + vae)


def test_model_lists_show_only_files_of_their_kind(comfy_inprocess, tiny, tmp_path):
    """Decided from each file's header: the VAE list has no DiT, the DiT list no FLUX or VAE file, whatever their
    names; a GGUF DiT is offered; a pickle (no cheap header) is placed by its name."""
    folder = Path(tiny["dit_3b"]).parent
    shutil.copy(tiny["vae"], folder / "seedvr2_named_like_a_dit.safetensors")
    shutil.copy(tiny["dit_7b"], folder / "vae_named_like_a_vae.safetensors")
    pytest.importorskip("gguf", reason="the `gguf` package writes the GGUF file")
    from dit_files import write_gguf_dit
    write_gguf_dit(folder / "seedvr2_tiny_3b-F32.gguf", "3b", None)   # the tiny 3B's golden weights, all F32
    try:
        dit, vae = _options(comfy_inprocess, "SeedVR2BW_LoadDiT"), _options(comfy_inprocess, "SeedVR2BW_LoadVAE")
        assert "flux_tiny.safetensors" not in dit + vae
        assert "seedvr2_tiny_3b.safetensors" not in vae and "seedvr2_tiny_7b.safetensors" not in vae
        assert "vae_named_like_a_vae.safetensors" in dit and "vae_named_like_a_vae.safetensors" not in vae
        assert "seedvr2_named_like_a_dit.safetensors" in vae and "seedvr2_named_like_a_dit.safetensors" not in dit
        assert "seedvr2_tiny_3b-F32.gguf" in dit and "seedvr2_tiny_3b-F32.gguf" not in vae
        wf, prompt = _run_with(comfy_inprocess)
        prompt[str(_node_id(wf, "SeedVR2BW_LoadDiT"))]["inputs"]["model"] = "seedvr2_tiny_3b-F32.gguf"
        res = comfy_inprocess.run(prompt)
        assert res.success, _error_text(res)
    finally:
        for name in ("seedvr2_named_like_a_dit.safetensors", "vae_named_like_a_vae.safetensors",
                     "seedvr2_tiny_3b-F32.gguf"):
            (folder / name).unlink()


# ----------------------------------------------------------------------------------------- end to end
def test_image_workflow_runs(comfy_inprocess, tiny):
    wf, prompt = _convert(comfy_inprocess, IMAGE_WF)
    for nid, ch in _tiny_overrides(wf, resolution=32).items():
        prompt[str(nid)]["inputs"].update(ch)
    res = comfy_inprocess.run(prompt)
    assert res.success, res.error
    from PIL import Image
    files = _output_files(comfy_inprocess, res.outputs, _node_id(wf, "SaveImage"))
    assert len(files) == 1
    with Image.open(files[0]) as im:
        assert im.size == (53, 32)  # 40x24 -> shortest edge 32 -> 53.33 -> 53
    assert "progress" in res.event_names()


def test_image_workflow_scale_factor_rgba_7b(comfy_inprocess, tiny):
    wf, prompt = _convert(comfy_inprocess, IMAGE_WF)
    ov = _tiny_overrides(wf, size_mode="scale_factor", scale_factor=1.5, color_correction="lab")
    ov[_node_id(wf, "SeedVR2BW_LoadDiT")] = {"model": "seedvr2_tiny_7b.safetensors"}
    ov[_node_id(wf, "LoadImage")] = {"image": "example_rgba.png"}
    for nid, ch in ov.items():
        prompt[str(nid)]["inputs"].update(ch)
    res = comfy_inprocess.run(prompt)
    assert res.success, res.error
    from PIL import Image
    with Image.open(_output_files(comfy_inprocess, res.outputs, _node_id(wf, "SaveImage"))[0]) as im:
        assert im.size == (60, 36)


def test_video_workflow_runs(comfy_inprocess, tiny):
    wf, prompt = _convert(comfy_inprocess, VIDEO_WF)
    ov = _tiny_overrides(wf, resolution=16, batch_size=5, temporal_overlap=1)
    ov[_node_id(wf, "RepeatImageBatch")] = {"amount": 7}
    for nid, ch in ov.items():
        prompt[str(nid)]["inputs"].update(ch)
    res = comfy_inprocess.run(prompt)
    assert res.success, res.error
    from PIL import Image
    files = _output_files(comfy_inprocess, res.outputs, _node_id(wf, "SaveAnimatedWEBP"))
    with Image.open(files[0]) as im:
        assert im.size == (27, 16)  # 40x24 -> 16 x 26.67 -> 27
        assert getattr(im, "n_frames", 1) == 7


def test_models_registered_with_comfy_and_freed(comfy_inprocess, tiny):
    """After a run the models are in ComfyUI's loaded-model list; 'Unload models' (/free) releases them."""
    from seedvr2bw.nodes import seedvr2 as nodes_mod  # noqa: F401  (same classes ComfyUI loaded)
    wf, prompt = _convert(comfy_inprocess, IMAGE_WF)
    for nid, ch in _tiny_overrides(wf, resolution=24).items():
        prompt[str(nid)]["inputs"].update(ch)
    res = comfy_inprocess.run(prompt)
    assert res.success, res.error
    mm = comfy_inprocess.model_management

    def ours():
        return [lm for lm in mm.current_loaded_models
                if lm.model is not None and type(lm.model.model).__name__ == "_Host"]
    assert ours(), "the SeedVR2 models were not loaded through comfy.model_management"
    mm.unload_all_models()
    assert not ours()
    again = comfy_inprocess.run(prompt)  # cached loader outputs, models reloaded after the unload
    assert again.success, again.error


def test_blockswap_socket_accepts_the_blockswap_node(comfy_inprocess, tiny):
    wf, prompt = _run_with(comfy_inprocess)
    prompt["99"] = {"class_type": "SeedVR2BW_BlockSwap",
                    "inputs": {"blocks_to_swap": 2, "prefetch": 1, "buffers": 2, "swap_io_components": False,
                               "pinned_cap_gb": 0.0, "reserve_gb": 0.0}}
    prompt[str(_node_id(wf, "SeedVR2BW_LoadDiT"))]["inputs"]["blockswap"] = ["99", 0]
    res = comfy_inprocess.run(prompt)
    assert res.success, res.error


# ----------------------------------------------------------------------------------------- errors
def _run_with(comfy, **upscale):
    wf, prompt = _convert(comfy, IMAGE_WF)
    for nid, ch in _tiny_overrides(wf, resolution=24, **upscale).items():
        prompt[str(nid)]["inputs"].update(ch)
    return wf, prompt


def _run_from_folder(comfy, folder, dit_name):
    """The image workflow with ``folder`` as the only SEEDVR2 model folder and ``dit_name`` in the DiT loader."""
    paths = comfy.folder_paths.folder_names_and_paths["seedvr2"][0]
    saved = list(paths)
    paths[:] = [str(folder)]
    try:
        wf, prompt = _run_with(comfy)
        prompt[str(_node_id(wf, "SeedVR2BW_LoadDiT"))]["inputs"]["model"] = dit_name
        return comfy.run(prompt)
    finally:
        paths[:] = saved


def _error_text(res) -> str:
    err = res.error or {}
    return f"{err.get('exception_type', '')}: {err.get('exception_message', '')} {err}"


@pytest.fixture()
def pickled(tiny):
    """Write ``name`` (.pth) into the tiny SEEDVR2 folder holding the tensors of the tiny file ``kind``: a pickle
    has no header to read cheaply, so the lists place it by its name and the loader meets the wrong kind."""
    import torch
    from safetensors.torch import load_file
    written = []

    def write(name: str, kind: str) -> str:
        path = Path(tiny["dit_3b"]).parent / name
        torch.save(load_file(str(tiny[kind])), str(path))
        written.append(path)
        return name
    yield write
    for path in written:
        path.unlink()


def test_flux_file_in_dit_loader_is_rejected_cleanly(comfy_inprocess, tiny, pickled):
    wf, prompt = _run_with(comfy_inprocess)
    prompt[str(_node_id(wf, "SeedVR2BW_LoadDiT"))]["inputs"]["model"] = pickled("flux_tiny.pth", "flux")
    res = comfy_inprocess.run(prompt)
    assert not res.success
    text = _error_text(res)
    assert "FLUX" in text and "not a SeedVR2 DiT" in text, text
    assert res.error.get("node_type") == "SeedVR2BW_LoadDiT"


def test_vae_file_in_dit_loader_is_rejected(comfy_inprocess, tiny, pickled):
    wf, prompt = _run_with(comfy_inprocess)
    prompt[str(_node_id(wf, "SeedVR2BW_LoadDiT"))]["inputs"]["model"] = pickled("ema_tiny.pth", "vae")
    res = comfy_inprocess.run(prompt)
    assert not res.success
    text = _error_text(res)
    assert "not a SeedVR2 DiT" in text and "load it with the VAE loader" in text, text


@pytest.mark.parametrize("kind,says", [("flux", "this is a FLUX transformer"),
                                       ("dit_3b", "this is a SeedVR2 DiT: use the DiT loader")])
def test_wrong_file_in_vae_loader_is_rejected(comfy_inprocess, tiny, pickled, kind, says):
    wf, prompt = _run_with(comfy_inprocess)
    prompt[str(_node_id(wf, "SeedVR2BW_LoadVAE"))]["inputs"]["model"] = pickled(f"vae_mixup_{kind}.pth", kind)
    res = comfy_inprocess.run(prompt)
    assert not res.success
    assert res.error.get("node_type") == "SeedVR2BW_LoadVAE"
    text = _error_text(res)
    assert "not a SeedVR2 video VAE" in text and says in text, text


def test_dit_not_offered_but_named_in_the_vae_loader(comfy_inprocess, tiny):
    """A DiT the VAE list does not offer, named by an old workflow: a ComfyUI that checks combo values refuses it,
    one that does not (0.3.75 skips V3 combos) runs the loader, which tells from the header what the file is."""
    wf, prompt = _run_with(comfy_inprocess)
    prompt[str(_node_id(wf, "SeedVR2BW_LoadVAE"))]["inputs"]["model"] = "seedvr2_tiny_3b.safetensors"
    res = comfy_inprocess.run(prompt)
    assert not res.success
    if res.status == "invalid":
        assert "seedvr2_tiny_3b.safetensors" in str(res.node_errors), res.node_errors
    else:
        assert "this is a SeedVR2 DiT: use the DiT loader" in _error_text(res), _error_text(res)


def test_bad_batch_size_is_a_clear_error(comfy_inprocess, tiny):
    _wf, prompt = _run_with(comfy_inprocess, batch_size=4)
    res = comfy_inprocess.run(prompt)
    assert not res.success
    assert "4n+1" in _error_text(res)
    # the panel prints the type as module.name: short and stable, not the pack's folder path (nodes/errors.py)
    assert res.error["exception_type"] == "seedvr2bw.SeedVR2InputError", res.error["exception_type"]


def test_output_larger_than_the_widgets_allow_is_refused_before_work(comfy_inprocess, tiny):
    _wf, prompt = _run_with(comfy_inprocess, size_mode="scale_factor", scale_factor=16.0)
    wf, _ = _convert(comfy_inprocess, IMAGE_WF)
    load = [n for n in wf["nodes"] if n["type"] == "LoadImage"]
    assert load, "the image workflow starts from LoadImage"
    prompt[str(load[0]["id"])] = {"class_type": "EmptyImage",
                                  "inputs": {"width": 2048, "height": 2048, "batch_size": 1, "color": 0}}
    t0 = time.perf_counter()
    res = comfy_inprocess.run(prompt)
    assert not res.success
    text = _error_text(res)
    assert "32768x32768" in text and "16384" in text and "scale_factor" in text, text
    assert time.perf_counter() - t0 < 30


def test_the_pack_leaves_process_wide_torch_settings_alone(comfy_inprocess, tiny):
    """cuDNN autotuning, TF32 and matmul precision are the user's: loading and running the nodes must not change
    them (the pack scopes its own choices to its model calls)."""
    import torch

    def settings():
        return (torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32,
                torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision(),
                torch.backends.cudnn.deterministic)
    before = settings()
    wf, prompt = _convert(comfy_inprocess, IMAGE_WF)
    for nid, ch in _tiny_overrides(wf, resolution=32).items():
        prompt[str(nid)]["inputs"].update(ch)
    res = comfy_inprocess.run(prompt)
    assert res.success, res.error
    assert settings() == before


def test_missing_embeddings_error_names_file_and_folder(comfy_inprocess, tiny, tmp_path):
    """A DiT whose folder has no pos_emb (and no SEEDVR2 folder has one): the error names file and folder."""
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    shutil.copy(tiny["dit_3b"], lonely / "seedvr2_lonely_3b.safetensors")
    shutil.copy(tiny["vae"], lonely / "ema_vae_tiny.safetensors")
    res = _run_from_folder(comfy_inprocess, lonely, "seedvr2_lonely_3b.safetensors")
    assert not res.success
    text = _error_text(res)
    assert "pos_emb.pt" in text and str(lonely) in text, text


def test_interrupt_stops_the_upscaler_between_chunks(comfy_inprocess, tiny):
    import time
    wf, prompt = _convert(comfy_inprocess, VIDEO_WF)
    ov = _tiny_overrides(wf, resolution=16, batch_size=1, temporal_overlap=0, seed=1234)
    ov[_node_id(wf, "RepeatImageBatch")] = {"amount": 200}
    for nid, ch in ov.items():
        prompt[str(nid)]["inputs"].update(ch)
    th, box = comfy_inprocess.run_in_thread(prompt)
    t0 = time.time()
    while time.time() - t0 < 120 and not any(e == "progress" for e, _ in comfy_inprocess.events_so_far()):
        time.sleep(0.02)
    comfy_inprocess.interrupt()
    th.join(timeout=60)
    assert not th.is_alive(), "the upscaler did not stop within 60 s of the interrupt"
    res = box["result"]
    assert res.status == "execution_interrupted", (res.status, res.error)
    assert res.error["node_type"] == "SeedVR2BW_Upscale"
    steps = [d for e, d in res.events if e == "progress"]
    assert steps and steps[-1]["max"] == 600 and steps[-1]["value"] < 600


# ----------------------------------------------------------------------------------------- real server
@pytest.fixture(scope="module")
def seedvr2_server(comfy_dir, pack_parent, tmp_path_factory):
    """A ComfyUI server whose extra_model_paths.yaml has a `seedvr2:` entry with the tiny models."""
    import sys
    sys.path.insert(0, str(REPO / "tests"))
    from make_tiny_models import make_tiny_models
    from rig.server import ComfyServer
    work = tmp_path_factory.mktemp("seedvr2_server")
    models = work / "models"
    make_tiny_models(models)
    yaml = work / "seedvr2_paths.yaml"
    yaml.write_text(f"seedvr2_tiny:\n    seedvr2: {models / 'SEEDVR2'}\n")
    srv = ComfyServer(comfy_dir, custom_node_dirs=[pack_parent], workdir=work / "srv",
                      extra_args=["--extra-model-paths-config", str(yaml)])
    srv.start()
    from PIL import Image
    srv.input_dir.mkdir(parents=True, exist_ok=True)
    arr = (np.random.default_rng(1).random((IN_H, IN_W, 3)) * 255).astype(np.uint8)
    Image.fromarray(arr).save(srv.input_dir / "example.png")
    yield srv
    alive = srv.alive()
    srv.stop()
    assert alive, srv.log_tail()


def test_image_workflow_through_http_and_free(seedvr2_server):
    from .ui_to_api import from_object_info
    srv = seedvr2_server
    info = srv.object_info()
    assert "seedvr2_tiny_3b.safetensors" in info["SeedVR2BW_LoadDiT"]["input"]["required"]["model"][1]["options"]
    wf = json.loads(IMAGE_WF.read_text())
    prompt = ui_to_api(wf, from_object_info(info), _tiny_overrides(wf, resolution=32))
    entry = srv.run_prompt(prompt, timeout=300)
    assert entry["status"]["status_str"] == "success", srv.log_tail()
    item = entry["outputs"][str(_node_id(wf, "SaveImage"))]["images"][0]
    from PIL import Image
    with Image.open(srv.output_dir / item.get("subfolder", "") / item["filename"]) as im:
        assert im.size == (53, 32)
    status, _ = srv.request("POST", "/free", {"unload_models": True, "free_memory": True})
    assert status == 200
    prompt[str(_node_id(wf, "SaveImage"))]["inputs"]["filename_prefix"] = "SeedVR2_after_free"
    entry = srv.run_prompt(prompt, timeout=300)
    assert entry["status"]["status_str"] == "success", srv.log_tail()


# ----------------------------------------------------------------------------------------- real frontend
def test_frontend_conversion_matches_ui_to_api_and_runs(seedvr2_server, tmp_path):
    """The real frontend (headless Chromium) loads the shipped workflows, its graphToPrompt gives the same
    API prompt as ui_to_api (so the widget order matches the schemas), and Run executes the image workflow."""
    from rig.ui_check import Browser, ComfyFrontend, find_chromium

    from .conftest import need
    from .ui_to_api import from_object_info
    chromium = find_chromium()
    need(chromium is not None, "no Chromium: apt-get install -y chromium (the frontend tests need it)")
    try:
        import websocket  # noqa: F401
    except ImportError:
        need(False, "websocket-client missing: pip install -r requirements-test.txt")
    srv = seedvr2_server
    info = srv.object_info()
    with Browser(chromium) as browser:
        fe = ComfyFrontend(browser, srv.url)
        fe.open()
        for path in (IMAGE_WF, VIDEO_WF):
            wf = json.loads(path.read_text())
            fe.load_workflow(wf, path.name)
            api = fe.b.js("app.graphToPrompt().then(p => p.output)")
            ours = ui_to_api(wf, from_object_info(info))
            assert set(api) == set(ours), (path.name, sorted(api), sorted(ours))
            for nid, node in ours.items():
                assert api[nid]["class_type"] == node["class_type"]
                theirs = {k: v for k, v in api[nid]["inputs"].items()}
                assert theirs == node["inputs"], (path.name, nid, theirs, node["inputs"])
        # Run the image workflow through the frontend with the tiny models.
        wf = json.loads(IMAGE_WF.read_text())
        for n in wf["nodes"]:
            if n["type"] == "SeedVR2BW_LoadDiT":
                n["widgets_values"][0] = "seedvr2_tiny_3b.safetensors"
            elif n["type"] == "SeedVR2BW_LoadVAE":
                n["widgets_values"][0] = "ema_vae_tiny.safetensors"
            elif n["type"] == "SeedVR2BW_Upscale":
                n["widgets_values"][3] = 32  # [seed, control, size_mode, resolution, ...]
        fe.load_workflow(wf, "tiny.json")
        entry = fe.queue_current(timeout=300)
        assert entry["status"]["status_str"] == "success", srv.log_tail()
        item = entry["outputs"][str(_node_id(wf, "SaveImage"))]["images"][0]
        from PIL import Image
        with Image.open(srv.output_dir / item.get("subfolder", "") / item["filename"]) as im:
            assert im.size == (53, 32)


def test_comfy_layout_dit_runs_without_pos_emb(comfy_inprocess, tiny, tmp_path):
    """A ComfyUI-layout DiT (conditioning baked in as positive_/negative_conditioning) in a folder without
    pos_emb.pt loads and upscales: the loader node takes the embedding from the file."""
    import torch
    from dit_files import write_comfy_layout_dit
    folder = tmp_path / "comfy_layout"
    folder.mkdir()
    write_comfy_layout_dit(folder / "seedvr2_comfy_layout_3b.safetensors", torch.load(tiny["pos"]).half(),
                           torch.load(tiny["neg"]).half())
    shutil.copy(tiny["vae"], folder / "ema_vae_tiny.safetensors")
    res = _run_from_folder(comfy_inprocess, folder, "seedvr2_comfy_layout_3b.safetensors")
    assert res.success, _error_text(res)
