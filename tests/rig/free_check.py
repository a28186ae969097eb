"""What ComfyUI's "free model and node cache" (POST /free ``{"unload_models": true, "free_memory": true}``) leaves of
the pack's models, in a ComfyUI of its own process (e.g. 0.19.3 with its venv):

    <that venv's python> tests/rig/free_check.py job.json result.json

``job.json``: what ``run_prompts.py`` takes; its first prompt runs, then ComfyUI's model manager is read
(``comfy.model_management.current_loaded_models``: which of its models are the pack's, their patcher class, whether
Dynamic VRAM manages them), weak references are taken to the pack's patchers and torch modules, and the two steps
ComfyUI's prompt worker (``main.py``) takes for those /free flags run: ``comfy.model_management.unload_all_models()``
(``unload_models``), then the executor's ``reset()`` (``free_memory``: the node output cache), then ``gc.collect()``
and ``soft_empty_cache()``. Then: which weak references still live (something still holds the model), what the model
manager still lists, and the same prompt again (the models load anew).

``result.json``: ``{"comfyui_version", "dynamic_vram", "before": [...], "after": [...], "alive_after_unload": [names
alive after the unload alone: the node cache still holds the loaders' outputs], "alive_after": [names],
"results": [first run, run after the free]}``; a model entry is ``{"class", "module_class", "patcher_class",
"is_dynamic", "device"}``.
"""
from __future__ import annotations

import gc
import inspect
import os
import sys
import weakref

import run_prompts

PACK_ROOT = os.path.realpath(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _is_pack_object(obj) -> bool:
    try:
        path = inspect.getfile(type(obj))
    except TypeError:
        return False
    return os.path.realpath(path).startswith(PACK_ROOT + os.sep)


def _inner(patcher):
    """The torch module a patcher holds: the pack's patchers hold a host module whose one child is the model."""
    children = list(patcher.model.children())
    return children[0] if len(children) == 1 else patcher.model


def pack_models(mm) -> list:
    """(LoadedModel, patcher) of every model ComfyUI's model manager holds that the pack made."""
    out = []
    for lm in mm.current_loaded_models:
        patcher = lm.model
        if patcher is not None and (_is_pack_object(patcher.model) or _is_pack_object(_inner(patcher))):
            out.append((lm, patcher))
    return out


def describe(lm, patcher) -> dict:
    return {"class": type(patcher.model).__name__, "module_class": type(_inner(patcher)).__name__,
            "patcher_class": type(patcher).__name__, "is_dynamic": bool(patcher.is_dynamic()),
            "device": str(lm.device)}


def weak_refs(held) -> dict:
    """Weak references to each model's patcher and torch module (a function of its own: no local name outlives it)."""
    refs = {}
    for _, patcher in held:
        name = type(_inner(patcher)).__name__
        refs[f"{name} patcher"] = weakref.ref(patcher)
        refs[f"{name} module"] = weakref.ref(_inner(patcher))
    return refs


def main(job_path: str, result_path: str) -> int:
    job = run_prompts.load_job(job_path)
    rig = run_prompts.boot(job)
    import comfy.memory_management
    import comfy.model_management as mm
    out = {"comfyui_version": run_prompts.comfyui_version(),
           "dynamic_vram": bool(comfy.memory_management.aimdo_enabled), "results": []}
    prompt = job["prompts"][0]
    out["results"] += run_prompts.run_all(rig, [prompt])
    held = pack_models(mm)
    out["before"] = [describe(lm, p) for lm, p in held]
    refs = weak_refs(held)
    del held
    # main.py's prompt worker for {"unload_models": true, "free_memory": true}
    mm.unload_all_models()
    gc.collect()
    out["alive_after_unload"] = sorted(name for name, r in refs.items() if r() is not None)  # the node cache's
    rig.executor.reset()
    gc.collect()
    mm.soft_empty_cache()
    out["after"] = [describe(lm, p) for lm, p in pack_models(mm)]
    out["alive_after"] = sorted(name for name, r in refs.items() if r() is not None)
    out["results"] += run_prompts.run_all(rig, [prompt])
    run_prompts.write_result(result_path, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
