"""Full-size SeedVR2 DiTs on the meta device against the official key inventories, and detection."""
import json

import pytest
import torch

from conftest import DATA
from seedvr2bw.models.seedvr2.dit import (
    SEEDVR2_3B,
    SEEDVR2_7B,
    DiTCheckpointError,
    build_dit,
    config_from_state_dict,
    detect_variant,
    load_dit,
)

PARAMS = json.loads((DATA / "param_counts.json").read_text())["models"]
_DT = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def meta_state_dict(name: str, dtype=None):
    entries = json.loads((DATA / name).read_text())
    return {e["name"]: torch.empty(e["shape"], dtype=dtype or _DT[e["dtype"]], device="meta") for e in entries}


@pytest.mark.parametrize("variant,keys,config", [("3b", "keys_dit_3b.json", SEEDVR2_3B), ("7b", "keys_dit_7b.json", SEEDVR2_7B)])
def test_full_size_keys(variant, keys, config):
    sd = meta_state_dict(keys)
    model = build_dit(config, device="meta")
    own = model.state_dict()
    assert set(own) == set(sd), (sorted(set(sd) - set(own))[:5], sorted(set(own) - set(sd))[:5])
    for k, v in sd.items():
        assert tuple(own[k].shape) == tuple(v.shape), k
    res = model.load_state_dict(sd, strict=True, assign=True)
    assert not res.missing_keys and not res.unexpected_keys
    info = PARAMS[f"dit_{variant}"]
    assert sum(p.numel() for p in model.parameters()) == info["num_parameters"]
    assert sum(t.numel() for t in model.state_dict().values()) == info["num_state_dict_elements"]
    assert len(model.state_dict()) == info["num_state_dict_entries"]


@pytest.mark.parametrize("variant,keys,config", [("3b", "keys_dit_3b.json", SEEDVR2_3B), ("7b", "keys_dit_7b.json", SEEDVR2_7B)])
def test_detection_and_config_from_shapes(variant, keys, config):
    sd = meta_state_dict(keys)
    assert detect_variant(sd) == variant
    assert config_from_state_dict(sd) == config
    # fp16/bf16 files are detected the same way
    assert config_from_state_dict(meta_state_dict(keys, torch.bfloat16)) == config


def test_detection_with_prefix_and_wrapper():
    from seedvr2bw.models.seedvr2.dit.loader import unwrap_state_dict

    sd = meta_state_dict("keys_dit_7b.json")
    wrapped = {"state_dict": {"model.diffusion_model." + k: v for k, v in sd.items()}}
    assert detect_variant(unwrap_state_dict(wrapped)) == "7b"


def test_vae_is_rejected_with_reason():
    sd = meta_state_dict("keys_vae.json")
    with pytest.raises(DiTCheckpointError) as e:
        detect_variant(sd, source="ema_vae.pth")
    msg = str(e.value)
    assert "ema_vae.pth" in msg and "VAE" in msg and "vid_in.proj.weight" in msg and "encoder." in msg


def test_flux_is_rejected_with_reason():
    sd = {
        "img_in.weight": torch.empty(3072, 64, device="meta"),
        "txt_in.weight": torch.empty(3072, 4096, device="meta"),
        "double_blocks.0.img_attn.qkv.weight": torch.empty(9216, 3072, device="meta"),
        "single_blocks.0.linear1.weight": torch.empty(21504, 3072, device="meta"),
    }
    with pytest.raises(DiTCheckpointError) as e:
        detect_variant(sd, source="flux1-dev.safetensors")
    msg = str(e.value)
    assert "flux1-dev.safetensors" in msg and "FLUX" in msg and "Expected" in msg and "double_blocks" in msg


def test_mixed_layout_is_rejected():
    sd = meta_state_dict("keys_dit_3b.json")
    sd["blocks.0.mlp.vid.proj_in.bias"] = torch.empty(6912, device="meta")
    with pytest.raises(DiTCheckpointError, match="neither SeedVR2-3B nor -7B"):
        detect_variant(sd)


def test_truncated_checkpoint_is_rejected(tmp_path):
    from safetensors.torch import load_file, save_file

    sd = load_file(DATA / "golden" / "dit_7b_tiny_weights.safetensors")
    del sd["blocks.1.mlp.txt.proj_out.bias"]
    path = tmp_path / "broken.safetensors"
    save_file(sd, str(path))
    with pytest.raises(DiTCheckpointError, match="missing"):
        load_dit(path)


def test_half_precision_loads_as_is(tmp_path):
    from safetensors.torch import load_file, save_file

    sd = {k: v.half() for k, v in load_file(DATA / "golden" / "dit_3b_tiny_weights.safetensors").items()}
    path = tmp_path / "tiny_fp16.safetensors"
    save_file(sd, str(path))
    model = load_dit(path)
    assert model.vid_in.proj.weight.dtype == torch.float16
    assert model.blocks[0].attn.rope.freqs.dtype == torch.float32  # constants restored in fp32


def test_pth_loads(tmp_path):
    from safetensors.torch import load_file

    sd = load_file(DATA / "golden" / "dit_7b_tiny_weights.safetensors")
    path = tmp_path / "tiny.pth"
    torch.save(sd, path)
    model = load_dit(path)
    assert model.config.variant == "7b"


def test_fp8_goes_to_replace_linears(tmp_path):
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("torch without float8")
    from safetensors.torch import load_file, save_file

    sd = load_file(DATA / "golden" / "dit_7b_tiny_weights.safetensors")
    sd = {k: (v.to(torch.float8_e4m3fn) if k.endswith("proj_qkv.vid.weight") else v) for k, v in sd.items()}
    path = tmp_path / "tiny_fp8.safetensors"
    save_file(sd, str(path))
    model = load_dit(path)
    assert model.config.variant == "7b"
    qkv = model.blocks[0].attn.proj_qkv.vid
    assert qkv.weight.dtype == torch.float8_e4m3fn, type(qkv)  # stays fp8 in memory
    inp = load_file(DATA / "golden" / "dit_case_image_inputs.safetensors")
    ref = load_file(DATA / "golden" / "dit_7b_case_image_outputs.safetensors")["out"]
    with torch.no_grad():
        out = model(inp["vid"].reshape(-1, 33), inp["txt"], inp["vid_shape"], inp["txt_shape"], inp["timestep"])
    err = float((out.reshape(ref.shape) - ref).norm() / ref.norm())
    assert err < 0.1, err  # fp8 rounding of the video qkv weights only


def test_fp8_everything(tmp_path):
    """numz-style fp8 files may store every tensor (ada vectors, norm weights, biases) in fp8."""
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("torch without float8")
    from safetensors.torch import load_file, save_file

    sd = load_file(DATA / "golden" / "dit_3b_tiny_weights.safetensors")
    sd = {k: (v if k.endswith("rope.freqs") else v.to(torch.float8_e4m3fn)) for k, v in sd.items()}
    path = tmp_path / "tiny_all_fp8.safetensors"
    save_file(sd, str(path))
    model = load_dit(path)
    assert model.run_dtype() == torch.bfloat16
    assert model.blocks[0].ada.vid.attn_scale.dtype == torch.bfloat16
    inp = load_file(DATA / "golden" / "dit_case_image_inputs.safetensors")
    ref = load_file(DATA / "golden" / "dit_3b_case_image_outputs.safetensors")["out"]
    with torch.no_grad():
        out = model(inp["vid"].reshape(-1, 33), inp["txt"], inp["vid_shape"], inp["txt_shape"], inp["timestep"])
    err = float((out.float().reshape(ref.shape) - ref).norm() / ref.norm())
    assert err < 0.3, err  # every tensor rounded to fp8


def test_nvfp4_checkpoint_loads(tmp_path):
    """A ComfyUI-format NVFP4 file (packed uint8 weights + block scales) is detected and loaded."""
    from safetensors.torch import load_file, save_file

    from seedvr2bw.optimization.nvfp4 import surgery

    model = load_dit(DATA / "golden" / "dit_7b_tiny_weights.safetensors", dtype=torch.bfloat16)
    surgery.quantize_model_linears(model, path="reference")
    path = tmp_path / "tiny_nvfp4.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    loaded = load_dit(path, nvfp4_path="reference")
    assert config_from_state_dict(load_file(str(path))).variant == "7b"
    assert type(loaded.blocks[0].attn.proj_qkv.vid).__name__ == "NVFP4Linear"
    inp = load_file(DATA / "golden" / "dit_case_image_inputs.safetensors")
    ref = load_file(DATA / "golden" / "dit_7b_case_image_outputs.safetensors")["out"]
    with torch.no_grad():
        out = loaded(inp["vid"].reshape(-1, 33), inp["txt"], inp["vid_shape"], inp["txt_shape"], inp["timestep"])
    err = float((out.float().reshape(ref.shape) - ref).norm() / ref.norm())
    assert err < 0.15, err  # 4-bit weights on a tiny random model
