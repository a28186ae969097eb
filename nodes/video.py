"""SeedVR2 video nodes: upscale ComfyUI's VIDEO (core's Load Video) or a video file, file to file, with the
streaming upscale (models/seedvr2/video): one chunk in memory at a time, the audio copied, resumable. The output is a
VIDEO backed by the written file (Save Video and Preview take it) and the file's path.

The file goes to ComfyUI's output folder as ``<filename_prefix>_<counter>_.<ext>``. A run that stopped (cancel,
crash) left its work folder there; running the same job again continues it, into the same file name.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import io as _io
import logging
import os
import sys
from pathlib import Path

import numpy as np
import torch
from comfy_api.latest import InputImpl, io

from ..models.seedvr2 import pipeline as P
from ..models.seedvr2.video.container import CODECS, VideoFileError, available_codecs, probe
from ..models.seedvr2.video.stream import StreamSettings, job_key, upscale_video
from ..models.seedvr2.video.workdir import file_id, unfinished_output
from ..models.seedvr2.video.workers import PARALLEL_MODES, PoolJob, WorkerPool, devices_from_spec
from .seedvr2 import upscale_inputs, upscale_settings
from .staging import ModelStager, plan_run
from .types import CATEGORY, SeedVR2DiT, SeedVR2VAE


def _codec_options() -> list[str]:
    ok = [k for k, v in available_codecs().items() if v] if _has_av() else list(CODECS)
    return ok or list(CODECS)


def _has_av() -> bool:
    return importlib.util.find_spec("av") is not None


def _video_inputs() -> list:
    return [
        SeedVR2DiT.Input("dit"),
        SeedVR2VAE.Input("vae"),
        *upscale_inputs(batch_size=21, temporal_overlap=4),
        io.Combo.Input("codec", options=_codec_options(), default="h264",
                       tooltip="h264: 8-bit .mp4; h265: 10-bit .mp4; prores: 10-bit .mov; ffv1: 16-bit lossless "
                               ".mkv; png16: a folder of 16-bit PNG frames."),
        io.String.Input("filename_prefix", default="seedvr2/video",
                        tooltip="Output file name inside ComfyUI's output folder (sub-folders allowed)."),
        io.Float.Input("scene_threshold", default=0.12, min=0.0, max=1.0, step=0.01,
                       tooltip="Scene-cut sensitivity: chunks never span a cut (0 = no scene detection)."),
        io.String.Input("gpus", default="", optional=True,
                        tooltip="Several GPUs for one video: 'all' or a list such as 0,1,2 (empty: ComfyUI's GPU). "
                                "Each runs a worker process with its own copy of the models, loaded once and kept "
                                "for the next runs; a faster GPU takes more chunks. 'cpu' entries run CPU workers."),
        io.Combo.Input("multi_gpu", options=list(PARALLEL_MODES), default="chunks", optional=True,
                       tooltip="With several gpus: 'chunks' gives each GPU whole chunks (long videos); 'sequence' "
                               "puts every GPU on every chunk, splitting the DiT's windows and the VAE's rows (for "
                               "chunks too large or too slow for one GPU; the models stay on each GPU)."),
    ]


_log = logging.getLogger(__name__)
WORKER = Path(__file__).resolve().parents[1] / "scripts" / "seedvr2_worker.py"
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _worker_pool(dit, vae, devices: list[str], parallel: str = "chunks") -> WorkerPool:
    """The DiT handle's pool for these devices and this VAE (a new one when they changed); it lives as long as
    ComfyUI keeps the handle cached ("free model and node cache" closes it with the handle)."""
    key = (tuple(devices), vae.path, dit.dtype, vae.dtype, parallel)
    if dit.workers is not None:
        old_key, pool = dit.workers
        if old_key == key and pool.alive:
            return pool
        pool.close()
        dit.workers = None
    if not dit.path or not vae.path:
        raise VideoFileError("several GPUs need the model files: load the DiT and VAE with the SeedVR2 loaders. "
                             "Fix: connect SeedVR2 Load DiT / Load VAE, or leave gpus empty.")
    argv = [sys.executable, str(WORKER), "--dit", dit.path, "--vae", vae.path,
            "--dtype", _DTYPE_NAMES.get(dit.dtype, "bf16"), "--parallel", parallel]
    pool = WorkerPool(devices, argv)
    dit.workers = (key, pool)
    return pool


def _source_path(video) -> str:
    """A file path for ComfyUI's VIDEO: its own file, or (uploaded bytes / frames in memory) a temporary copy."""
    import folder_paths
    src = video.get_stream_source() if hasattr(video, "get_stream_source") else None
    if isinstance(src, str):
        return src
    tmp_dir = os.path.join(folder_paths.get_temp_directory(), "seedvr2bw_video")
    os.makedirs(tmp_dir, exist_ok=True)
    if isinstance(src, _io.BytesIO):
        data = src.getvalue()
        path = os.path.join(tmp_dir, hashlib.sha1(data).hexdigest()[:16] + ".mkv")
        if not os.path.exists(path):
            with open(path + ".partial", "wb") as f:
                f.write(data)
            os.replace(path + ".partial", path)
        return path
    path = os.path.join(tmp_dir, f"components_{id(video):x}.mp4")
    video.save_to(path)
    return path


def _model_key(dit, vae, settings: P.UpscaleSettings) -> str:
    return (f"dit={file_id(dit.path)} vae={file_id(vae.path)} dtype={dit.dtype}/{vae.dtype} seed={settings.seed} "
            f"res={settings.resolution} scale={settings.scale_factor} max={settings.max_resolution} "
            f"cc={settings.color_correction}")


def _output_path(prefix: str, ext: str, key: dict) -> str:
    """An unfinished job with this key resumes into its file; otherwise the next free counter."""
    import folder_paths
    out_dir = folder_paths.get_output_directory()
    full_dir, name, counter, _sub, _ = folder_paths.get_save_image_path(prefix, out_dir)
    again = unfinished_output(full_dir, name + "_", key)
    if again is not None:
        return again
    while True:
        path = os.path.join(full_dir, f"{name}_{counter:05}_{ext}")
        if not os.path.exists(path) and not os.path.exists(os.path.join(full_dir, f".{name}_{counter:05}_{ext}"
                                                                                   ".seedvr2-work")):
            return path
        counter += 1


def run_video(src_path: str, dit, vae, seed, size_mode, resolution, scale_factor, max_resolution, batch_size,
              temporal_overlap, color_correction, codec, filename_prefix, scene_threshold, node_id=None, gpus="",
              multi_gpu="chunks"):
    import comfy.model_management as mm
    import comfy.utils
    device = mm.get_torch_device()
    settings = upscale_settings(seed, size_mode, resolution, scale_factor, max_resolution, batch_size, 0,
                                color_correction, vae.tiling)
    stream = StreamSettings(batch_size=batch_size, overlap=temporal_overlap, codec=codec,
                            scene_threshold=scene_threshold, resume=True)
    stream.validate()   # settings and the input file are checked before any model is touched
    devices = devices_from_spec(gpus)
    if multi_gpu not in PARALLEL_MODES:
        raise VideoFileError(f"multi_gpu {multi_gpu!r}: one of {', '.join(PARALLEL_MODES)}.")
    info = probe(src_path)
    target = P.compute_target_size(info.height, info.width, settings.resolution, settings.scale_factor,
                                   settings.max_resolution)
    spec = CODECS[codec]
    ext = "" if spec.sequence() else spec.container
    key = job_key(info, stream, target, _model_key(dit, vae, settings))
    out_path = _output_path(filename_prefix, ext, key)
    bar = comfy.utils.ProgressBar(info.frames, node_id=node_id)
    server = _prompt_server()

    def progress(done, total, fps, left):
        bar.update_absolute(done, total)
        if server is not None and node_id is not None:
            server.send_progress_text(f"{done}/{total} frames  {fps:.2f} frames/s  {left:.0f} s left", node_id)

    if devices:
        for d in {d for d in devices if d.startswith("cuda")}:
            mm.free_memory(1e30, torch.device(d))   # the workers need these GPUs: ComfyUI's models leave them
        pool = _worker_pool(dit, vae, devices, multi_gpu)
        return pool.run(PoolJob(src_path, out_path, target, stream, key["model"],
                                {"settings": dataclasses.asdict(settings)}),
                        progress=progress, should_stop=mm.throw_exception_if_processing_interrupted)
    memory = plan_run(dit, vae, device, (batch_size, info.height, info.width, 3), settings)
    stager = ModelStager(dit, vae, device, memory)

    def upscale_chunk(frames: np.ndarray) -> torch.Tensor:   # on the device: the stream takes pixels to the host
        out = P.upscale(torch.from_numpy(frames), dit.model, vae.model, dit.embeddings.positive, settings,
                        device=device, dit_dtype=dit.dtype, vae_dtype=vae.dtype,
                        offload_device=mm.unet_offload_device(), output_device=device,
                        should_stop=mm.throw_exception_if_processing_interrupted, hooks=stager.hooks(),
                        memory=memory)
        return out

    res = upscale_video(src_path, out_path, upscale_chunk, lambda h, w: target, stream, model_key=key["model"],
                        progress=progress, should_stop=mm.throw_exception_if_processing_interrupted)
    mm.soft_empty_cache()
    return res


def _prompt_server():
    try:
        from server import PromptServer
        return PromptServer.instance
    except Exception:  # noqa: BLE001 - outside a running ComfyUI
        return None


def _video_output(res):
    if os.path.isdir(res.out_path):   # a PNG sequence: no VIDEO to hand on
        return None
    return InputImpl.VideoFromFile(res.out_path)


class SeedVR2UpscaleVideo(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SeedVR2BW_UpscaleVideo",
            display_name="SeedVR2 Upscale Video (SeedVR2-BW)",
            category=CATEGORY,
            description="Upscales a VIDEO of any length file to file: one chunk in memory at a time, audio kept, "
                        "scene cuts respected, resumable after a cancel or crash (run it again).",
            inputs=[io.Video.Input("video", tooltip="From Load Video (or any node giving a VIDEO)."),
                    *_video_inputs()],
            outputs=[io.Video.Output(display_name="video"), io.String.Output(display_name="path")],
            hidden=[io.Hidden.unique_id],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, video, dit, vae, seed, size_mode, resolution, scale_factor, max_resolution, batch_size,
                temporal_overlap, color_correction, codec, filename_prefix, scene_threshold,
                gpus="", multi_gpu="chunks") -> io.NodeOutput:
        return _node_output(cls, run_video(_source_path(video), dit, vae, seed, size_mode, resolution, scale_factor,
                                           max_resolution, batch_size, temporal_overlap, color_correction, codec,
                                           filename_prefix, scene_threshold, _node_id(cls), gpus,
                                           multi_gpu))


class SeedVR2UpscaleVideoFile(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SeedVR2BW_UpscaleVideoFile",
            display_name="SeedVR2 Upscale Video File (SeedVR2-BW)",
            category=CATEGORY,
            description="As SeedVR2 Upscale Video, from a file path (absolute, or relative to ComfyUI's input "
                        "folder): for videos too long to load as frames.",
            inputs=[io.String.Input("path", default="", tooltip="Video file: absolute, or relative to ComfyUI's "
                                    "input folder."),
                    *_video_inputs()],
            outputs=[io.Video.Output(display_name="video"), io.String.Output(display_name="path")],
            hidden=[io.Hidden.unique_id],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, path, dit, vae, seed, size_mode, resolution, scale_factor, max_resolution, batch_size,
                temporal_overlap, color_correction, codec, filename_prefix, scene_threshold,
                gpus="", multi_gpu="chunks") -> io.NodeOutput:
        import folder_paths
        p = (path or "").strip().strip('"')
        if not p:
            raise VideoFileError("no video file given. Fix: enter the path of a video file (absolute, or relative "
                                 "to ComfyUI's input folder).")
        if not os.path.isabs(p):
            p = os.path.join(folder_paths.get_input_directory(), p)
        return _node_output(cls, run_video(p, dit, vae, seed, size_mode, resolution, scale_factor, max_resolution,
                                           batch_size, temporal_overlap, color_correction, codec, filename_prefix,
                                           scene_threshold, _node_id(cls), gpus, multi_gpu))


def _node_id(cls):
    return getattr(getattr(cls, "hidden", None), "unique_id", None)


def _node_output(cls, res) -> io.NodeOutput:
    """The VIDEO (None for a PNG sequence) and the path, with a summary line under the node."""
    text = (f"wrote {res.out_path}: {res.frames} frames in {res.chunks} chunks ({res.resumed_chunks} resumed), "
            f"{res.fps:.2f} frames/s")
    return io.NodeOutput(_video_output(res), res.out_path, ui={"text": [text]})


NODES = [SeedVR2UpscaleVideo, SeedVR2UpscaleVideoFile]
