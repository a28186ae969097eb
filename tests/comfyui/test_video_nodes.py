"""The video nodes through ComfyUI's executor (in-process) with the tiny SeedVR2 models: core Load Video ->
SeedVR2 Upscale Video -> the VIDEO output into core nodes; the file-path node; a 1,000-frame clip with audio in
bounded host memory; a cancelled run resumes into the same file."""
from __future__ import annotations

import os
import resource
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("av", reason="PyAV (ComfyUI's video library) is not installed")

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from video_clips import audio_seconds, clip_frames, write_clip  # noqa: E402


@pytest.fixture(scope="module")
def rig(comfy_inprocess, tmp_path_factory):
    from make_tiny_models import make_tiny_models
    models = tmp_path_factory.mktemp("video_models")
    make_tiny_models(models)
    comfy_inprocess.folder_paths.add_model_folder_path("seedvr2", str(models / "SEEDVR2"))
    return comfy_inprocess


def _loaders():
    return {
        "1": {"class_type": "SeedVR2BW_LoadDiT", "inputs": {"model": "seedvr2_tiny_3b.safetensors",
                                                            "compute_dtype": "auto", "attention": "auto"}},
        "2": {"class_type": "SeedVR2BW_LoadVAE", "inputs": {"model": "ema_vae_tiny.safetensors", "dtype": "auto",
                                                            "encode_tiling": "auto", "encode_tile_size": 512,
                                                            "decode_tiling": "auto", "decode_tile_size": 512}},
    }


def _settings(prefix, **kw):
    s = {"dit": ["1", 0], "vae": ["2", 0], "seed": 42, "size_mode": "shortest_edge", "resolution": 48,
         "scale_factor": 2.0, "max_resolution": 0, "batch_size": 9, "temporal_overlap": 2,
         "color_correction": "wavelet", "codec": "h264", "filename_prefix": prefix, "scene_threshold": 0.12}
    s.update(kw)
    return s


def _fix_loader_inputs(comfy, prompt):
    """Fill the loader widgets from the registered schemas (their defaults), keeping what the prompt sets."""
    for nid in ("1", "2"):
        cls = comfy.node_classes[prompt[nid]["class_type"]]
        spec = cls.INPUT_TYPES()
        for sec in ("required",):
            for name, entry in spec.get(sec, {}).items():
                if name not in prompt[nid]["inputs"]:
                    opts = entry[1] if len(entry) > 1 and isinstance(entry[1], dict) else {}
                    if "default" in opts:
                        prompt[nid]["inputs"][name] = opts["default"]
                    elif isinstance(entry[0], list) and entry[0]:
                        prompt[nid]["inputs"][name] = entry[0][0]
        prompt[nid]["inputs"] = {k: v for k, v in prompt[nid]["inputs"].items()
                                 if k in spec.get("required", {}) or k in spec.get("optional", {})}
    return prompt


def _out_file(comfy, res, node):
    return Path(res.outputs[node]["text"][0].split("wrote ", 1)[1].split(":")[0])


def test_load_video_to_upscale_video_to_core_nodes(rig):
    comfy = rig
    inp = Path(comfy.folder_paths.get_input_directory())
    write_clip(str(inp / "clip.mp4"), clip_frames([20, 13], 24, 40), codec="h264")
    prompt = _loaders()
    prompt["3"] = {"class_type": "LoadVideo", "inputs": {"file": "clip.mp4"}}
    prompt["4"] = {"class_type": "SeedVR2BW_UpscaleVideo", "inputs": {"video": ["3", 0], **_settings("t/v")}}
    prompt["5"] = {"class_type": "GetVideoComponents", "inputs": {"video": ["4", 0]}}
    prompt["6"] = {"class_type": "PreviewAny", "inputs": {"source": ["5", 2]}}   # the fps, through core nodes
    res = comfy.run(_fix_loader_inputs(comfy, prompt))
    assert res.success, (res.status, res.error)
    out = _out_file(comfy, res, "4")
    from seedvr2bw.models.seedvr2.video.container import probe
    info = probe(str(out))
    assert info.frames == 33 and (info.width, info.height) == (80, 48) and info.has_audio
    assert abs(audio_seconds(str(out)) - audio_seconds(str(inp / "clip.mp4"))) < 1e-6
    assert out.parent == Path(comfy.folder_paths.get_output_directory()) / "t"
    assert float(res.outputs["6"]["text"][0]) == pytest.approx(24.0)
    assert "progress" in res.event_names()


def test_file_node_thousand_frames_bounded_memory(rig):
    comfy = rig
    inp = Path(comfy.folder_paths.get_input_directory())
    write_clip(str(inp / "c100.mp4"), clip_frames([60, 40], 24, 40), codec="h264")
    write_clip(str(inp / "c1000.mp4"), clip_frames([400, 350, 250], 24, 40), codec="h264")

    def run(name, prefix):
        prompt = _loaders()
        prompt["4"] = {"class_type": "SeedVR2BW_UpscaleVideoFile", "inputs": {"path": name, **_settings(prefix)}}
        peak = [0]
        stop = threading.Event()

        def watch():   # this process's current RSS while the node runs
            while not stop.is_set():
                with open("/proc/self/statm") as f:
                    peak[0] = max(peak[0], int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
                time.sleep(0.02)
        th = threading.Thread(target=watch, daemon=True)
        th.start()
        try:
            res = comfy.run(_fix_loader_inputs(comfy, prompt))
        finally:
            stop.set()
            th.join()
        assert res.success, (res.status, res.error)
        return res, peak[0]
    run("c100.mp4", "warm/x")   # the first run loads code and models
    _, small = run("c100.mp4", "rss/small")
    res, big = run("c1000.mp4", "rss/big")
    out = _out_file(comfy, res, "4")
    from seedvr2bw.models.seedvr2.video.container import probe
    assert probe(str(out)).frames == 1000
    assert abs(audio_seconds(str(out)) - audio_seconds(str(inp / "c1000.mp4"))) < 1e-6
    assert big <= 1.10 * small, f"RSS peak {big / 2**20:.0f} MiB for 1,000 frames vs {small / 2**20:.0f} MiB for 100"


def test_cancelled_run_resumes_into_the_same_file(rig):
    comfy = rig
    inp = Path(comfy.folder_paths.get_input_directory())
    write_clip(str(inp / "c60.mp4"), clip_frames([60], 24, 40), codec="h264")
    prompt = _fix_loader_inputs(comfy, {**_loaders(), "4": {"class_type": "SeedVR2BW_UpscaleVideoFile",
                                                            "inputs": {"path": "c60.mp4", **_settings("cancel/x")}}})
    th, box = comfy.run_in_thread(prompt)
    out_dir = Path(comfy.folder_paths.get_output_directory()) / "cancel"
    t0 = time.time()
    while time.time() - t0 < 120:
        works = list(out_dir.glob(".*.seedvr2-work")) if out_dir.exists() else []
        if works and len(list(works[0].glob("body_*[0-9].nut"))) >= 2:
            break
        time.sleep(0.02)
    comfy.interrupt()
    th.join(timeout=120)
    res = box["result"]
    assert res.status == "execution_interrupted", (res.status, res.error)
    assert not list(out_dir.glob("x_*.mp4")), "a partial output under the final name"
    again = comfy.run(prompt)
    assert again.success, again.error
    text = again.outputs["4"]["text"][0]
    assert "resumed)" in text and "(0 resumed)" not in text, text
    from seedvr2bw.models.seedvr2.video.container import probe
    assert probe(str(_out_file(comfy, again, "4"))).frames == 60


def test_long_video_workflow_runs(rig):
    """workflows/seedvr2_long_video.json converted as the frontend does, pointed at the tiny models."""
    import json
    from .ui_to_api import from_node_classes, ui_to_api
    comfy = rig
    inp = Path(comfy.folder_paths.get_input_directory())
    write_clip(str(inp / "wf.mp4"), clip_frames([15], 24, 40), codec="h264")
    wf = json.loads((REPO / "workflows" / "seedvr2_long_video.json").read_text())
    prompt = ui_to_api(wf, from_node_classes(comfy.node_classes))
    ids = {n["type"]: str(n["id"]) for n in wf["nodes"]}
    prompt[ids["LoadVideo"]]["inputs"]["file"] = "wf.mp4"
    prompt[ids["SeedVR2BW_LoadDiT"]]["inputs"]["model"] = "seedvr2_tiny_3b.safetensors"
    prompt[ids["SeedVR2BW_LoadVAE"]]["inputs"]["model"] = "ema_vae_tiny.safetensors"
    prompt[ids["SeedVR2BW_UpscaleVideo"]]["inputs"].update({"resolution": 48, "batch_size": 9, "temporal_overlap": 2,
                                                           "filename_prefix": "wf/long"})
    res = comfy.run(prompt)
    assert res.success, (res.status, res.error)
    path = res.outputs[ids["PreviewAny"]]["text"][0]
    from seedvr2bw.models.seedvr2.video.container import probe
    assert probe(path).frames == 15


def _worker_processes() -> list[int]:
    """This process's running children started from scripts/seedvr2_worker.py."""
    me, out = os.getpid(), []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if ppid == me and b"seedvr2_worker.py" in cmd:
            out.append(int(pid))
    return out


def test_file_node_on_two_workers_equals_one_process_and_keeps_them(rig, caplog):
    """``gpus`` through the executor, with two CPU workers: the same frames as this process makes, the workers
    started once for two runs, and gone once ComfyUI lets go of the loaded DiT."""
    import logging

    import numpy as np
    from seedvr2bw.models.seedvr2.video import container as C
    comfy = rig
    inp = Path(comfy.folder_paths.get_input_directory())
    write_clip(str(inp / "pool.mkv"), clip_frames([20, 13], 24, 40))
    frames = {}
    with caplog.at_level(logging.INFO):
        for name, gpus in (("one", ""), ("pool1", "cpu,cpu"), ("pool2", "cpu,cpu")):
            prompt = _loaders()
            prompt["4"] = {"class_type": "SeedVR2BW_UpscaleVideoFile",
                           "inputs": {"path": "pool.mkv", **_settings(f"pool/{name}", codec="ffv1", gpus=gpus)}}
            res = comfy.run(_fix_loader_inputs(comfy, prompt))
            assert res.success, (res.status, res.error)
            frames[name] = np.stack(list(C.read_frames(str(_out_file(comfy, res, "4")))))
            if gpus:
                assert len(_worker_processes()) == 2
    assert np.array_equal(frames["pool1"], frames["one"]) and np.array_equal(frames["pool2"], frames["one"])
    assert sum("worker pool: 2 process(es)" in r.getMessage() for r in caplog.records) == 1
    # another DiT: ComfyUI drops the cached handle, and its workers with it
    prompt = _loaders()
    prompt["1"]["inputs"]["compute_dtype"] = "fp32"
    prompt["4"] = {"class_type": "SeedVR2BW_UpscaleVideoFile",
                   "inputs": {"path": "pool.mkv", **_settings("pool/after", codec="ffv1")}}
    assert comfy.run(_fix_loader_inputs(comfy, prompt)).success
    deadline = time.time() + 15
    while _worker_processes() and time.time() < deadline:
        time.sleep(0.2)
    assert _worker_processes() == []


def test_file_node_sequence_parallel_on_two_workers(rig):
    """``multi_gpu: sequence`` through the executor with two CPU workers: every worker on every chunk (the tiny
    models' DiT windows and VAE rows split over gloo), the frames within 16-bit rounding of this process's."""
    import numpy as np
    from seedvr2bw.models.seedvr2.video import container as C
    comfy = rig
    inp = Path(comfy.folder_paths.get_input_directory())
    write_clip(str(inp / "seq.mkv"), clip_frames([11], 24, 40))
    frames = {}
    for name, extra in (("one", {}), ("seq", {"gpus": "cpu,cpu", "multi_gpu": "sequence"})):
        prompt = _loaders()
        prompt["4"] = {"class_type": "SeedVR2BW_UpscaleVideoFile",
                       "inputs": {"path": "seq.mkv", **_settings(f"seq/{name}", codec="ffv1", **extra)}}
        res = comfy.run(_fix_loader_inputs(comfy, prompt))
        assert res.success, (res.status, res.error)
        frames[name] = np.stack(list(C.read_frames(str(_out_file(comfy, res, "4"))))).astype(np.int64)
        if extra:
            workers = _worker_processes()
            assert len(workers) == 2
            for pid in workers:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    assert b"--parallel\x00sequence" in f.read()
    assert frames["seq"].shape == frames["one"].shape
    assert np.abs(frames["seq"] - frames["one"]).max() <= 1     # levels of 65535


def test_gpus_setting_names_what_is_wrong(rig):
    comfy = rig
    prompt = _loaders()
    prompt["4"] = {"class_type": "SeedVR2BW_UpscaleVideoFile",
                   "inputs": {"path": "pool.mkv", **_settings("pool/bad", gpus="7")}}
    res = comfy.run(_fix_loader_inputs(comfy, prompt))
    assert not res.success
    assert "gpus '7'" in res.error["exception_message"] and "Fix:" in res.error["exception_message"]
