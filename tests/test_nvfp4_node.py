"""The converter node, run in a subprocess against the rig's ComfyUI (CPU), on a small model file."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
RIG = ROOT / ".comfyui"

CODE = r"""
import sys, json
sys.path.insert(0, %(root)r); sys.path.insert(0, %(rig)r)
import comfy.cli_args; comfy.cli_args.args.cpu = True
import folder_paths
folder_paths.add_model_folder_path("diffusion_models", %(models)r)
from pack_import import import_pack; import_pack()
from seedvr2bw.nodes.nvfp4 import ConvertToNVFP4, NODES
schema = ConvertToNVFP4.define_schema()
assert "diffusion_models/toy.safetensors" in schema.inputs[0].options, schema.inputs[0].options
out = ConvertToNVFP4.execute(model="diffusion_models/toy.safetensors", output_name="", format="nvfp4",
                             keep_patterns="proj_out", use_default_keep=True, device="cpu", overwrite=False)
print(json.dumps({"text": out.result[0], "n": len(NODES)}))
"""


@pytest.mark.skipif(not (RIG / "comfy_api").exists(), reason="the rig's ComfyUI is not installed at .comfyui")
def test_convert_node_in_comfyui(tmp_path):
    g = torch.Generator().manual_seed(0)
    save_file({"blocks.0.mlp.proj_in.weight": torch.randn(256, 128, generator=g).to(torch.bfloat16),
               "blocks.0.mlp.proj_out.weight": torch.randn(128, 256, generator=g).to(torch.bfloat16),
               "blocks.0.norm.weight": torch.ones(128)}, str(tmp_path / "toy.safetensors"))
    r = subprocess.run([sys.executable, "-c", CODE % {"root": str(ROOT), "rig": str(RIG), "models": str(tmp_path)}],
                       capture_output=True, text=True, cwd=str(RIG), timeout=300)
    if r.returncode != 0 and "ModuleNotFoundError" in r.stderr:
        pytest.skip("the rig's ComfyUI needs packages this env lacks: " + r.stderr.strip().splitlines()[-1])
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert "1 layers quantized" in res["text"] and "blocks.0.mlp.proj_out" in res["text"]
    assert (tmp_path / "toy_nvfp4.safetensors").exists()
