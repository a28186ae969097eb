"""Run API prompts through a ComfyUI's in-process executor (``comfy_inprocess.py``) in a process of their own, for a
ComfyUI that cannot share the test process (another version, with its own venv):

    <that venv's python> tests/rig/run_prompts.py job.json result.json

``job.json``: ``{"comfy_dir", "custom_node_dirs": [...], "output_dir", "input_dir", "temp_dir",
"model_dirs": {kind: folder}, "prompts": [prompt, ...]}``; the model folders are registered first (a LoRA a prompt
writes lands in ``model_dirs["loras"]``). ``result.json``: the ComfyUI version and one entry per prompt with
success, status, error, node_errors and outputs, as ``RunResult`` has them; prompts run in order, one after the other.

``boot(job)``, ``run_all(comfy, prompts)`` and ``write_result(path, out)`` are what the other scripts of this kind
(``load_quantized.py``, ``free_check.py``) share.
"""
from __future__ import annotations

import json
import os
import sys


def load_job(job_path: str) -> dict:
    with open(job_path) as f:
        return json.load(f)


def boot(job: dict):
    """The ComfyUI of ``job["comfy_dir"]`` in this process, with the job's custom nodes and model folders."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from rig.comfy_inprocess import ComfyInProcess
    comfy = ComfyInProcess(job["comfy_dir"], custom_node_dirs=job.get("custom_node_dirs", ()),
                           output_dir=job["output_dir"], input_dir=job["input_dir"], temp_dir=job["temp_dir"])
    for kind, folder in job.get("model_dirs", {}).items():
        comfy.folder_paths.add_model_folder_path(kind, folder, is_default=True)
    return comfy


def comfyui_version() -> str:
    import comfyui_version as v
    return v.__version__


def run_all(comfy, prompts: list) -> list[dict]:
    out = []
    for prompt in prompts:
        r = comfy.run(prompt)
        out.append({"success": r.success, "status": r.status, "error": r.error, "node_errors": r.node_errors,
                    "outputs": r.outputs,
                    "events": sorted({str(e) for e in r.event_names()}), "seconds": r.seconds})
    return out


def write_result(result_path: str, out: dict) -> None:
    with open(result_path + ".tmp", "w") as f:
        json.dump(out, f, default=str)
    os.replace(result_path + ".tmp", result_path)


def main(job_path: str, result_path: str) -> int:
    job = load_job(job_path)
    comfy = boot(job)
    write_result(result_path, {"comfyui_version": comfyui_version(), "results": run_all(comfy, job["prompts"])})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
