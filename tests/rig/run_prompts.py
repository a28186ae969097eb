"""Run API prompts through a ComfyUI's in-process executor (``comfy_inprocess.py``) in a process of their own, for a
ComfyUI that cannot share the test process (another version, with its own venv):

    <that venv's python> tests/rig/run_prompts.py job.json result.json

``job.json``: ``{"comfy_dir", "custom_node_dirs": [...], "output_dir", "input_dir", "temp_dir",
"model_dirs": {kind: folder}, "prompts": [prompt, ...]}``; the model folders are registered first (a LoRA a prompt
writes lands in ``model_dirs["loras"]``). ``result.json``: the ComfyUI version and one entry per prompt with
success, status, error and outputs, as ``RunResult`` has them; prompts run in order, one after the other.
"""
from __future__ import annotations

import json
import os
import sys


def main(job_path: str, result_path: str) -> int:
    with open(job_path) as f:
        job = json.load(f)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from rig.comfy_inprocess import ComfyInProcess
    comfy = ComfyInProcess(job["comfy_dir"], custom_node_dirs=job.get("custom_node_dirs", ()),
                           output_dir=job["output_dir"], input_dir=job["input_dir"], temp_dir=job["temp_dir"])
    for kind, folder in job.get("model_dirs", {}).items():
        comfy.folder_paths.add_model_folder_path(kind, folder, is_default=True)
    import comfyui_version
    out = {"comfyui_version": comfyui_version.__version__, "results": []}
    for prompt in job["prompts"]:
        r = comfy.run(prompt)
        out["results"].append({"success": r.success, "status": r.status, "error": r.error, "outputs": r.outputs,
                               "events": sorted({str(e) for e in r.event_names()}), "seconds": r.seconds})
    with open(result_path + ".tmp", "w") as f:
        json.dump(out, f, default=str)
    os.replace(result_path + ".tmp", result_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
