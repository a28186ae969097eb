"""The FLUX LoRA nodes (V3) end to end on CPU: dataset -> settings -> train -> ComfyUI's LoraLoader node."""
import logging
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_training_helpers import FakeCLIP, FakeVAE, make_image_folder, require_comfy, tiny_flux_patcher  # noqa: E402


@pytest.fixture(scope="module")
def nodes_mod():
    torch.set_num_threads(1)
    require_comfy()
    import importlib
    return importlib.import_module("seedvr2bw.nodes.training")


def _settings(N, **kw):
    base = dict(steps=6, rank=4, alpha=4.0, optimizer="adamw", learning_rate=3e-3, lr_scheduler="constant",
                warmup_steps=0, batch_size=1, grad_accumulation=1, max_grad_norm=1.0, timestep_sampling="sigmoid",
                shift=3.1582, guidance=1.0, base_precision="auto", gradient_checkpointing=True, double_blocks="all",
                single_blocks="all", per_type_ranks="", seed=42, save_every=0, keep_last=3, preview_every=3,
                preview_seeds="1,2", tensorboard=False, blocks_to_swap=0)
    base.update(kw)
    return N.FluxLoraSettingsNode.execute(**base).result[0]


def test_nodes_train_then_loraloader(nodes_mod, tmp_path, caplog):
    N = nodes_mod
    import folder_paths
    folder_paths.add_model_folder_path("loras", str(tmp_path / "loras"), is_default=True)
    folder_paths.set_output_directory(str(tmp_path / "output"))
    assert [n.define_schema().node_id for n in N.NODES] == [
        "SeedVR2BW_FluxLoraDataset", "SeedVR2BW_FluxLoraSettings", "SeedVR2BW_FluxLoraTrain"]
    folder = make_image_folder(tmp_path / "ds", n=2)
    ds = N.FluxLoraDatasetNode.execute(str(folder), "", "sks", 256, True).result[0]
    ds.resolution = 64  # tiny model: 64 px images
    st = _settings(N)
    mp = tiny_flux_patcher()
    out = N.FluxLoraTrainNode.execute(mp, FakeVAE(), FakeCLIP(), ds, st, "sub/my_lora", True)
    lora_name, lora_path, plot, previews = out.result
    assert lora_name == "sub/my_lora.safetensors" and Path(lora_path).is_file()
    assert plot.shape[0] == 1 and plot.shape[-1] == 3
    assert previews.shape[0] == 4  # 2 preview rounds x 2 seeds
    import nodes
    caplog.set_level(logging.WARNING)
    m2, _ = nodes.LoraLoader().load_lora(mp, None, lora_name, 1.0, 0.0)
    assert not [r for r in caplog.records if "lora key not loaded" in r.getMessage()]
    assert len(m2.patches) == 26
    # resume: a second run with more steps continues from the saved state
    st2 = _settings(N, steps=8, preview_every=0)
    out2 = N.FluxLoraTrainNode.execute(mp, FakeVAE(), FakeCLIP(), ds, st2, "sub/my_lora", True)
    from safetensors import safe_open
    with safe_open(out2.result[1], "pt") as f:
        assert f.metadata()["ss_steps"] == "8"


def test_node_errors(nodes_mod, tmp_path):
    N = nodes_mod
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="holds no images"):
        N.FluxLoraDatasetNode.execute(str(empty), "", "", 1024, True)
    with pytest.raises(ValueError, match="no folder and no images"):
        N.FluxLoraDatasetNode.execute("", "", "", 1024, True)
    with pytest.raises(ValueError, match="rank must be at least 1"):
        _settings(N, rank=0)
    with pytest.raises(ValueError, match="per-type ranks.*Fix"):
        _settings(N, per_type_ranks="img_mod")

    class NotFlux:
        class model:
            diffusion_model = torch.nn.Linear(2, 2)
    folder = make_image_folder(tmp_path / "ds", n=1)
    ds = N.FluxLoraDatasetNode.execute(str(folder), "", "", 256, True).result[0]
    with pytest.raises(TypeError, match="needs a FLUX model.*Fix"):
        N.FluxLoraTrainNode.execute(NotFlux(), FakeVAE(), FakeCLIP(), ds, _settings(N), "x", True)
