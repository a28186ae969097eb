"""Model files users have that cannot be loaded get an error naming the file, the reason and the fix: a truncated
download, bytes that are not a model, a pickle carrying code (never run), a damaged GGUF file, an unknown type."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from seedvr2bw.models.seedvr2.dit.loader import load_dit  # noqa: E402
from seedvr2bw.models.seedvr2.files import ModelFileError, read_tensors  # noqa: E402
from seedvr2bw.models.seedvr2.vae import load_vae  # noqa: E402


class CarriesCode:
    """Any class the weights-only unpickler does not know stands for a pickle that could run code."""

    def __init__(self):
        self.x = 1


def _good(tmp_path) -> Path:
    p = tmp_path / "good.safetensors"
    save_file({"a": torch.randn(64, 64), "b": torch.randn(128)}, str(p))
    return p


@pytest.mark.parametrize("loader,what", [(load_dit, "SeedVR2 DiT"), (load_vae, "SeedVR2 VAE")])
def test_truncated_safetensors(tmp_path, loader, what):
    data = _good(tmp_path).read_bytes()
    bad = tmp_path / "seedvr2_ema_3b_fp16.safetensors"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFileError) as e:
        loader(str(bad))
    msg = str(e.value)
    assert what in msg and "seedvr2_ema_3b_fp16.safetensors is damaged or is not a model file" in msg, msg
    assert "download it again" in msg and str(bad) in msg


def test_random_bytes_are_not_a_model(tmp_path):
    bad = tmp_path / "ema_vae.safetensors"
    bad.write_bytes(bytes(range(256)) * 64)
    with pytest.raises(ModelFileError, match="ema_vae.safetensors is damaged or is not a model file.*download it"):
        read_tensors(bad, "SeedVR2 VAE")


def test_pickle_with_code_is_refused_without_running_it(tmp_path):
    p = tmp_path / "seedvr2_ema_7b.pth"
    torch.save({"weights": torch.zeros(2), "extra": CarriesCode()}, str(p))
    with pytest.raises(ModelFileError) as e:
        load_dit(str(p))
    msg = str(e.value)
    assert "contains Python code" in msg and "not loaded" in msg and "safetensors version" in msg, msg
    assert "weights_only=False" not in msg


def test_damaged_pth_gguf_and_unknown_types(tmp_path):
    bad = tmp_path / "m.pth"
    bad.write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(ModelFileError, match="m.pth is damaged or is not a model file"):
        read_tensors(bad, "SeedVR2 DiT")
    g = tmp_path / "seedvr2_ema_3b-Q4_K_M.gguf"
    g.write_bytes(b"GGUF")
    with pytest.raises(ModelFileError, match="Q4_K_M.gguf: .*truncated or corrupt.*download it again"):
        load_dit(str(g))
    not_gguf = tmp_path / "renamed.gguf"
    not_gguf.write_bytes(b"<html>404 Not Found</html>")
    with pytest.raises(ModelFileError, match="renamed.gguf: .*not a GGUF file.*text"):
        read_tensors(not_gguf)
    odd = tmp_path / "model.onnx"
    odd.write_bytes(b"x")
    with pytest.raises(ModelFileError, match="unknown file type.*\\.safetensors, \\.gguf or \\.pth"):
        read_tensors(odd)
    with pytest.raises(ModelFileError, match="not found"):
        read_tensors(tmp_path / "missing.safetensors")


def test_good_files_still_load(tmp_path):
    p = _good(tmp_path)
    sd = read_tensors(p)
    assert set(sd) == {"a", "b"}
    q = tmp_path / "w.pth"
    torch.save({"a": torch.ones(3)}, str(q))
    assert torch.equal(read_tensors(q)["a"], torch.ones(3))


# ------------------------------------------------------------------------------- what a file is, from its header
def test_file_kind_from_the_header_alone(tmp_path, monkeypatch):
    import os

    import safetensors.torch

    from conftest import DATA
    from seedvr2bw.models.seedvr2 import files as F

    def no_weights(*args, **kwargs):
        raise AssertionError("file_kind loaded weights")
    monkeypatch.setattr(safetensors.torch, "load_file", no_weights)
    monkeypatch.setattr(torch, "load", no_weights)
    golden = DATA / "golden"
    assert F.file_kind(golden / "dit_3b_tiny_weights.safetensors") == F.KIND_SEEDVR2_DIT
    assert F.file_kind(golden / "dit_7b_tiny_weights.safetensors") == F.KIND_SEEDVR2_DIT
    assert F.file_kind(golden / "vae_tiny_weights.safetensors") == F.KIND_SEEDVR2_VAE
    flux = tmp_path / "flux.safetensors"
    save_file({"double_blocks.0.img_attn.qkv.weight": torch.zeros(3, 2), "txt_in.weight": torch.zeros(2, 2)},
              str(flux))
    assert F.file_kind(flux) == F.KIND_FLUX
    prefixed = tmp_path / "comfy.safetensors"
    names = ("vid_in.proj.weight", "txt_in.weight", "blocks.0.attn.proj_qkv.vid.weight")
    save_file({"model.diffusion_model." + n: torch.zeros(1) for n in names}, str(prefixed))
    assert F.file_kind(prefixed) == F.KIND_SEEDVR2_DIT
    other = _good(tmp_path)
    assert F.file_kind(other) == F.KIND_UNKNOWN
    # the cache follows the file: rewritten (new mtime) it is read again
    save_file({"encoder.conv_in.weight": torch.zeros(1), "decoder.conv_in.weight": torch.zeros(1)}, str(other))
    os.utime(other, ns=(1, 10**18))
    assert F.file_kind(other) == F.KIND_OTHER_VAE
    pth = tmp_path / "x.pth"
    pth.write_bytes(b"PK\x03\x04....")
    assert F.file_kind(pth) is None  # a pickle has no header to read cheaply
    damaged = tmp_path / "cut.safetensors"
    damaged.write_bytes(bytes(range(256)))
    assert F.file_kind(damaged) is None and F.file_kind(tmp_path / "missing.safetensors") is None


def test_dit_in_the_vae_loader_says_use_the_dit_loader(tmp_path):
    from conftest import DATA
    from seedvr2bw.models.seedvr2.vae.loader import NotASeedVR2VAE
    dit = DATA / "golden" / "dit_3b_tiny_weights.safetensors"
    with pytest.raises(NotASeedVR2VAE, match="not a SeedVR2 video VAE: this is a SeedVR2 DiT: use the DiT loader"):
        load_vae(dit)
    pth = tmp_path / "ema_vae.pth"  # a pickle: told from its keys after reading
    torch.save(read_tensors(dit), str(pth))
    with pytest.raises(NotASeedVR2VAE, match="this is a SeedVR2 DiT: use the DiT loader"):
        load_vae(pth)
