"""The SeedVR2 image workflow on the GPU through ComfyUI's own executor (the in-process rig on the ComfyUI source
at ``$COMFYUI_DIR`` or ``.comfy_src``, tiny models): it runs on CUDA, leaves torch's process-wide settings alone,
and ComfyUI's "free model and node cache" (unload, then the node cache's reset) gives back every GPU byte and every
pinned host byte the run took. Skipped without CUDA or without the ComfyUI source."""
from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_staging_gpu import gpu_bytes_in_use, settings_now

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    comfy_dir = os.environ.get("COMFYUI_DIR", str(REPO / ".comfy_src"))
    if not os.path.isfile(os.path.join(comfy_dir, "comfy", "model_management.py")):
        pytest.skip(f"ComfyUI source not at {comfy_dir} (carry .comfy_src: scripts/device/prepare_carry.sh)")
    for p in (REPO / "tests", REPO / "scripts"):
        sys.path.insert(0, str(p))
    import bench_flux_lora
    bench_flux_lora.setup_comfy(comfy_dir, cpu=False)     # the GPU image lacks av / torchsde: import-time stubs
    from make_tiny_models import make_tiny_models
    from rig.comfy_inprocess import ComfyInProcess
    from rig.server import make_pack_folder
    work = tmp_path_factory.mktemp("gpu_rig")
    for sub in ("output", "input", "temp", "custom_nodes", "models"):
        (work / sub).mkdir()
    comfy = ComfyInProcess.get(comfy_dir, custom_node_dirs=[make_pack_folder(REPO, work / "custom_nodes")],
                               output_dir=work / "output", input_dir=work / "input", temp_dir=work / "temp",
                               cpu=False)
    make_tiny_models(work / "models")
    comfy.folder_paths.add_model_folder_path("seedvr2", str(work / "models" / "SEEDVR2"))
    from PIL import Image
    arr = (np.random.default_rng(0).random((24, 40, 3)) * 255).astype(np.uint8)
    Image.fromarray(arr).save(os.path.join(comfy.folder_paths.get_input_directory(), "example.png"))
    return comfy


def test_image_workflow_on_cuda_and_freed_by_comfyui(rig):
    from comfyui.test_seedvr2_workflows import IMAGE_WF, _convert, _tiny_overrides
    from seedvr2bw.optimization.blockswap.backend import CudaBackend
    mm = rig.model_management
    assert mm.get_torch_device().type == "cuda"
    wf, prompt = _convert(rig, IMAGE_WF)
    for nid, ch in _tiny_overrides(wf, resolution=32).items():
        prompt[str(nid)]["inputs"].update(ch)
    before, pinned0, flags = gpu_bytes_in_use(), CudaBackend.registered_bytes(), settings_now()
    for _ in range(2):                          # the second run reuses the cached loaders' models
        res = rig.run(prompt)
        assert res.success, res.error
    assert settings_now() == flags
    ours = [lm for lm in mm.current_loaded_models if lm.model is not None and type(lm.model.model).__name__ == "_Host"]
    assert ours and all(lm.device.type == "cuda" for lm in ours), [str(lm.device) for lm in ours]
    # main.py's prompt worker for POST /free {"unload_models": true, "free_memory": true}
    del ours
    mm.unload_all_models()
    rig.executor.reset()
    gc.collect()
    mm.soft_empty_cache()
    left = gpu_bytes_in_use() - before
    print(f"after ComfyUI's free: {left} GPU bytes, {CudaBackend.registered_bytes() - pinned0} pinned bytes left")
    assert left <= 0, f"{left} bytes still on the GPU"
    assert CudaBackend.registered_bytes() == pinned0
