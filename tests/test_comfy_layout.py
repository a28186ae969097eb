"""ComfyUI-layout SeedVR2 DiT files (Comfy-Org's converted files): the text conditioning is baked in as the tensors
``positive_conditioning`` / ``negative_conditioning``. ``load_dit`` accepts them and ``load_text_embeddings`` takes
the embeddings from there, else from pos_emb.pt beside the file."""
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import DATA
from dit_files import write_comfy_layout_dit, write_gguf_dit
from seedvr2bw.models.seedvr2.dit import load_dit
from seedvr2bw.models.seedvr2.embeddings import MissingEmbeddingError, load_text_embeddings

TXT_DIM = 24  # the tiny models' text input dim


def conditioning(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(58, TXT_DIM, generator=g).half(), torch.randn(64, TXT_DIM, generator=g).half()


def comfy_file(path, prefix: str = ""):
    """The tiny 3B DiT in fp16 with the conditioning baked in, as ComfyUI's converter writes it."""
    pos, neg = conditioning(0)
    write_comfy_layout_dit(path, pos, neg, prefix=prefix)
    return pos, neg


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_comfy_layout_loads_with_its_embeddings(tmp_path, prefix):
    path = tmp_path / "seedvr2_ema_3b_fp16.safetensors"
    pos, neg = comfy_file(path, prefix)
    model = load_dit(path)
    assert model.config.variant == "3b" and model.vid_in.proj.weight.dtype == torch.float16
    emb = load_text_embeddings(str(path), expected_dim=model.config.txt_in_dim)
    assert torch.equal(emb.positive, pos.float()) and torch.equal(emb.negative, neg.float())
    assert emb.positive.dtype == torch.float32
    assert "positive_conditioning" in emb.positive_path and str(path) in emb.positive_path


def test_baked_conditioning_wins_over_files_beside_it(tmp_path):
    path = tmp_path / "dit.safetensors"
    pos, _ = comfy_file(path)
    torch.save(torch.zeros(58, TXT_DIM, dtype=torch.bfloat16), tmp_path / "pos_emb.pt")
    assert torch.equal(load_text_embeddings(str(path)).positive, pos.float())


def test_files_beside_a_plain_dit_still_used(tmp_path):
    path = tmp_path / "dit.safetensors"
    save_file({k: v.half() for k, v in load_file(DATA / "golden" / "dit_3b_tiny_weights.safetensors").items()},
              str(path))
    with pytest.raises(MissingEmbeddingError, match="pos_emb.pt.*positive_conditioning"):
        load_text_embeddings(str(path))
    want = torch.randn(58, TXT_DIM).bfloat16()
    torch.save(want, tmp_path / "pos_emb.pt")
    emb = load_text_embeddings(str(path))
    assert torch.equal(emb.positive, want.float()) and emb.negative is None
    assert emb.positive_path == str(tmp_path / "pos_emb.pt")


def test_only_positive_baked_takes_negative_from_beside(tmp_path):
    path = tmp_path / "dit.safetensors"
    sd = {k: v.half() for k, v in load_file(DATA / "golden" / "dit_3b_tiny_weights.safetensors").items()}
    pos, neg = conditioning(1)
    sd["positive_conditioning"] = pos
    save_file(sd, str(path))
    torch.save(neg, tmp_path / "neg_emb.pt")
    emb = load_text_embeddings(str(path))
    assert torch.equal(emb.positive, pos.float()) and torch.equal(emb.negative, neg.float())


def test_wrong_dim_names_the_file_and_tensor(tmp_path):
    path = tmp_path / "dit.safetensors"
    comfy_file(path)
    with pytest.raises(ValueError, match="positive_conditioning.*dim 24 does not match.*5120"):
        load_text_embeddings(str(path), expected_dim=5120)


def test_gguf_with_baked_conditioning(tmp_path):
    pytest.importorskip("gguf", reason="the `gguf` package (requirements-test.txt) writes the test file")
    path = tmp_path / "seedvr2_ema_3b-Q8_0.gguf"
    pos, neg = conditioning(2)
    write_gguf_dit(path, "3b", None, extra={"positive_conditioning": pos, "negative_conditioning": neg})
    assert load_dit(path, dtype=torch.float32).config.variant == "3b"
    emb = load_text_embeddings(str(path))
    assert torch.equal(emb.positive, pos.float()) and torch.equal(emb.negative, neg.float())
