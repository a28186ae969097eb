"""The full-size SeedVR2 VAE key set (keys_vae.json, from the official class) loads by name on the meta device;
foreign state dicts are rejected with a clear error."""
import json

import pytest
import torch
from safetensors.torch import save_file

from conftest import DATA
from seedvr2bw.models.seedvr2.files import ModelFileError
from seedvr2bw.models.seedvr2.vae import (SEEDVR2_VAE, NotASeedVR2VAE, VideoAutoencoder, build_vae,
                                          config_from_state_dict, load_vae)


def meta_state_dict():
    keys = json.loads((DATA / "keys_vae.json").read_text())
    return {k["name"]: torch.empty(k["shape"], dtype=getattr(torch, k["dtype"]), device="meta") for k in keys}


def test_full_key_set_matches_model():
    sd = meta_state_dict()
    with torch.device("meta"):
        model = VideoAutoencoder(SEEDVR2_VAE)
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert set(own) == set(sd), (sorted(set(sd) - set(own))[:10], sorted(set(own) - set(sd))[:10])
    assert all(own[k] == tuple(sd[k].shape) for k in sd)
    counts = json.loads((DATA / "param_counts.json").read_text())["models"]["vae"]
    assert len(sd) == counts["num_state_dict_entries"]
    assert sum(p.numel() for p in model.parameters()) == counts["num_parameters"] == 250_648_227


def test_full_key_set_loads_on_meta():
    sd = meta_state_dict()
    cfg = config_from_state_dict(sd)
    assert cfg == SEEDVR2_VAE
    model = build_vae(sd)  # strict: every key consumed, none missing, shapes equal (raises otherwise)
    assert model.config == SEEDVR2_VAE
    loaded = model.state_dict()
    assert set(loaded) == set(sd)
    assert all(v.is_meta for v in loaded.values())


def test_missing_and_extra_keys_are_reported():
    sd = meta_state_dict()
    sd.pop("decoder.up_blocks.3.resnets.2.conv2.bias")
    sd["decoder.extra.weight"] = torch.empty(3, device="meta")
    with pytest.raises(NotASeedVR2VAE, match="1 missing.*decoder.up_blocks.3.resnets.2.conv2.bias.*1 unexpected"):
        build_vae(sd)


def test_shape_mismatch_is_reported():
    sd = meta_state_dict()
    sd["encoder.conv_out.weight"] = torch.empty(32, 512, 3, 3, 1, device="meta")
    with pytest.raises(NotASeedVR2VAE, match="shape mismatch.*encoder.conv_out.weight"):
        build_vae(sd)


def test_foreign_state_dict_rejected():
    # An SD/FLUX-style 2-D VAE: same diffusers names in places, but 4-D conv weights and no upscale_conv.
    foreign = {
        "encoder.conv_in.weight": torch.empty(128, 3, 3, 3, device="meta"),
        "encoder.down.0.block.0.conv1.weight": torch.empty(128, 128, 3, 3, device="meta"),
        "decoder.conv_in.weight": torch.empty(512, 16, 3, 3, device="meta"),
        "decoder.conv_out.weight": torch.empty(3, 128, 3, 3, device="meta"),
    }
    with pytest.raises(NotASeedVR2VAE) as e:
        build_vae(foreign, source="flux_ae.safetensors")
    msg = str(e.value)
    assert "flux_ae.safetensors is not a SeedVR2 video VAE" in msg
    assert "decoder.up_blocks.0.upsamplers.0.upscale_conv.weight" in msg    # what was expected
    assert "encoder.down.0.block.0.conv1.weight" in msg                       # what was found
    assert "5-D" in msg
    with pytest.raises(NotASeedVR2VAE, match="no tensors"):
        build_vae({})
    with pytest.raises(NotASeedVR2VAE, match="Found: blocks.0.attn.qkv.weight"):
        build_vae({"blocks.0.attn.qkv.weight": torch.empty(6, 2)})


def _tiny_sd():
    from safetensors.torch import load_file
    return load_file(str(DATA / "golden" / "vae_tiny_weights.safetensors"))


def test_tiny_requires_group_count():
    with pytest.raises(ValueError, match="norm_num_groups"):
        build_vae(_tiny_sd())


def test_load_pth_and_safetensors_with_wrappers(tmp_path):
    sd = _tiny_sd()
    ref = build_vae(sd, norm_num_groups=2)
    # official .pth (weights_only load), nested and prefixed, old diffusers attention names
    old = {}
    for k, v in sd.items():
        k = k.replace("attentions.0.to_q.", "attentions.0.query.").replace("attentions.0.to_out.0.", "attentions.0.proj_attn.")
        old["vae." + k] = v
    torch.save({"state_dict": old}, tmp_path / "ema_vae.pth")
    m1 = load_vae(tmp_path / "ema_vae.pth", norm_num_groups=2)
    save_file({k: v.half() for k, v in sd.items()}, str(tmp_path / "ema_vae_fp16.safetensors"))
    m2 = load_vae(tmp_path / "ema_vae_fp16.safetensors", norm_num_groups=2, dtype=torch.float32)
    for m in (m1, m2):
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(m.state_dict()[k], v, atol=1e-3, rtol=1e-3)
    assert m1.state_dict()["encoder.conv_in.weight"].dtype == torch.float32
    (tmp_path / "x.onnx").write_bytes(b"x")
    with pytest.raises(ModelFileError, match="unknown file type"):
        load_vae(tmp_path / "x.onnx")
