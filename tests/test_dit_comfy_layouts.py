"""ComfyUI-native quantized DiT files (per-layer ``comfy_quant``: ``nvfp4``, ``mxfp8``, ``int8_tensorwise`` with
ConvRot) through ``load_dit``: the tiny golden models written in each layout, checked against the fp32 golden output.

The files are made as Comfy-Org's are: every block linear quantized, ``emb_in``, ``txt_in``, ``vid_in``, ``vid_out``,
norms and modulation kept (our converter's default keep rule); NVFP4 and MXFP8 by our converter (bit-identical with
comfy-kitchen: tests/test_nvfp4_ck_identity.py, tests/test_comfy_layouts.py), INT8 ConvRot by comfy-kitchen where it
imports, else by ours (the same bytes). The tiny model's K is 64 or 256, so ConvRot uses groups of 64 here (256 in
the real files; the group size is read from each layer's ``comfy_quant``).

Measured rel-L2 of ``out`` against the fp32 golden output (3B / 7B, image and video cases, CPU, fp32 activations):
mxfp8 0.025-0.026 / 0.020, int8 ConvRot 0.0086-0.0087 / 0.0065-0.0066, nvfp4 0.091-0.093 / 0.068-0.070. Those are
the formats' own errors: the rel-L2 of the quantized block weights themselves is mxfp8 0.027 (E4M3's 3 mantissa bits
under power-of-two block scales), int8 0.006 (per channel, after the rotation; the activations' int8 adds to it in
the output), nvfp4 0.095; and the MXFP8 model equals its dequantized dense twin to 1e-6.
"""

import pytest
import torch
from safetensors.torch import load_file

from dit_files import INT8_GROUP as GROUP
from dit_files import golden_weights, write_int8_dit
from dit_files import rel_l2
from dit_files import run_golden_case as run
from seedvr2bw.models.seedvr2.dit import load_dit
from seedvr2bw.models.seedvr2.dit.loader import DiTCheckpointError
from seedvr2bw.optimization.nvfp4 import checkpoint as ckpt
from seedvr2bw.optimization.nvfp4.convert import convert_file
from seedvr2bw.optimization.nvfp4.int8 import Int8Linear
from seedvr2bw.optimization.nvfp4.linear import NVFP4Linear
from seedvr2bw.optimization.nvfp4.mxfp8 import MXFP8Linear

# the measured error (module docstring) with some room
TOLERANCE = {"mxfp8": 0.035, "int8": 0.012, "nvfp4": 0.12}
LAYER = {"mxfp8": MXFP8Linear, "int8": Int8Linear, "nvfp4": NVFP4Linear}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("comfy_layouts")
    made = {}
    for variant in ("3b", "7b"):
        for layout in ("nvfp4", "mxfp8"):
            p = made[(variant, layout)] = d / f"{variant}_{layout}.safetensors"
            convert_file(str(golden_weights(variant)), str(p), target=layout)
        made[(variant, "int8")] = d / f"{variant}_int8.safetensors"
        write_int8_dit(made[(variant, "int8")], variant)
    return made


@pytest.mark.parametrize("variant", ["3b", "7b"])
@pytest.mark.parametrize("layout", ["mxfp8", "int8", "nvfp4"])
def test_dit_output_within_the_layouts_quantization_error(files, variant, layout):
    model = load_dit(files[(variant, layout)], dtype=torch.float32, nvfp4_path="reference")
    layers = [m for m in model.modules() if isinstance(m, LAYER[layout])]
    blocks = [n for n, m in model.named_modules() if n.startswith("blocks.") and isinstance(m, torch.nn.Linear)]
    assert layers and not blocks, f"{layout}: block linears left unquantized: {blocks[:4]}"
    assert isinstance(model.vid_in.proj, torch.nn.Linear)            # kept, as in Comfy-Org's files
    for case in ("image", "video"):
        out, ref = run(model, variant, case)
        err = rel_l2(out, ref)
        print(f"{variant}/{case}/{layout}: out rel-L2 {err:.4f}")
        assert 1e-4 < err <= TOLERANCE[layout], f"{variant}/{case}/{layout}: rel-L2 {err:.4f}"


@pytest.mark.parametrize("layout", ["mxfp8", "int8"])
def test_layers_carry_the_files_layout(files, layout):
    model = load_dit(files[("7b", layout)], dtype=torch.float32)
    layer = model.blocks[0].attn.proj_qkv.vid
    assert isinstance(layer, LAYER[layout])
    if layout == "int8":
        assert layer.convrot_group == GROUP and tuple(layer.weight_scale.shape) == (layer.out_features, 1)
    sd = load_file(files[("7b", layout)])
    # the layer saves exactly what the file holds (ComfyUI's keys, the stored bytes)
    saved = layer.state_dict()
    for name in ("weight", "weight_scale"):
        assert torch.equal(saved[name].view(torch.uint8), sd[f"blocks.0.attn.proj_qkv.vid.{name}"].view(torch.uint8))
    assert ckpt.read_comfy_quant(saved["comfy_quant"]) == ckpt.read_comfy_quant(
        sd["blocks.0.attn.proj_qkv.vid.comfy_quant"])


def test_mxfp8_dit_equals_its_dequantized_twin(files):
    """The MXFP8 error is the weights' alone: the dense model with the dequantized weights gives the same output."""
    model = load_dit(files[("3b", "mxfp8")], dtype=torch.float32)
    dense = {}
    for name, m in model.named_modules():
        if isinstance(m, MXFP8Linear):
            dense[f"{name}.weight"] = m.dequantize_weight()
            if m.bias is not None:
                dense[f"{name}.bias"] = m.bias
    full = {k: v for k, v in load_file(golden_weights("3b")).items()}
    full.update(dense)
    twin = load_dit(full, dtype=torch.float32)
    a, _ = run(model, "3b", "image")
    b, _ = run(twin, "3b", "image")
    assert rel_l2(a, b) < 1e-6


def test_unknown_layout_names_the_file_and_layer(files, tmp_path):
    sd = load_file(files[("3b", "int8")])
    sd["blocks.0.attn.proj_out.vid.comfy_quant"] = ckpt.comfy_quant_tensor({"format": "convrot_w4a4"})
    bad = tmp_path / "w4a4.safetensors"
    ckpt.save_state_dict(str(bad), sd)
    with pytest.raises(DiTCheckpointError, match=r"w4a4\.safetensors: blocks\.0\.attn\.proj_out\.vid: "
                                                 r"quantization format 'convrot_w4a4'"):
        load_dit(bad)
