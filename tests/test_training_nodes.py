"""The FLUX LoRA nodes (V3) end to end on CPU: dataset -> settings -> train -> ComfyUI's LoraLoader node."""
import logging
import os
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


def test_schemas_and_loraloader_link(nodes_mod):
    """V3 schemas validate, and the train node's lora_name output type-checks into LoraLoader's combo input."""
    N = nodes_mod
    from comfy_execution.validation import validate_node_input
    import nodes
    for cls in N.NODES:
        cls.GET_SCHEMA()
    out_type = N.FluxLoraTrainNode.RETURN_TYPES[0]
    for loader in (nodes.LoraLoader, nodes.LoraLoaderModelOnly):
        combo = loader.INPUT_TYPES()["required"]["lora_name"][0]
        assert validate_node_input(out_type, combo)
    assert N.FluxLoraTrainNode.RETURN_TYPES[2] == "IMAGE"


def test_workflow_file(nodes_mod):
    """workflows/flux_lora_train.json: UI format, known node types, our widget values match our schemas,
    and the LoRA name goes from the train node into ComfyUI's LoraLoader."""
    import json
    import nodes
    N = nodes_mod
    wf = json.loads((Path(__file__).resolve().parents[1] / "workflows" / "flux_lora_train.json").read_text())
    ours = {c.GET_SCHEMA().node_id: c for c in N.NODES}
    byid = {n["id"]: n for n in wf["nodes"]}
    extras = "".join(p.read_text(errors="replace") for p in (Path(nodes.__file__).parent / "comfy_extras").glob("*.py"))
    for n in wf["nodes"]:
        assert (n["type"] in ours or n["type"] in nodes.NODE_CLASS_MAPPINGS
                or f'"{n["type"]}"' in extras), n["type"]  # comfy_extras nodes (FluxGuidance, EmptySD3LatentImage)
        if n["type"] in ours:
            it = ours[n["type"]].INPUT_TYPES()
            widgets = [k for sec in ("required", "optional") for k, v in it.get(sec, {}).items()
                       if isinstance(v[0], list) or v[0] in ("STRING", "INT", "FLOAT", "BOOLEAN", "COMBO")]
            # The frontend gives INT inputs named seed/noise_seed (or asking for it) a control_after_generate widget.
            controls = [k for sec in ("required", "optional") for k, v in it.get(sec, {}).items()
                        if v[0] == "INT" and (k in ("seed", "noise_seed") or (len(v) > 1 and v[1].get("control_after_generate")))]
            assert len(n["widgets_values"]) == len(widgets) + len(controls), (n["type"], len(n["widgets_values"]), len(widgets))
    links = {l[0]: l for l in wf["links"]}
    ll = next(n for n in wf["nodes"] if n["type"] == "LoraLoader")
    name_in = next(i for i in ll["inputs"] if i["name"] == "lora_name")
    src = links[name_in["link"]]
    assert byid[src[1]]["type"] == "SeedVR2BW_FluxLoraTrain" and src[2] == 0


# ---------------------------------------------------------------- inside ComfyUI's inference mode
def _is_inference_model(dm) -> list:
    return [n for n, p in dm.named_parameters() if not p.is_inference()]


def test_train_node_inside_inference_mode(nodes_mod, tmp_path, caplog):
    """ComfyUI's executor runs every node under torch.inference_mode() and builds its models there (inference
    tensors). The train node must train under it, leave the model as it was (inference tensors, same storage,
    requires_grad as before) and a second run and an inference pass with the LoRA must work afterwards."""
    N = nodes_mod
    import folder_paths
    folder_paths.add_model_folder_path("loras", str(tmp_path / "loras"), is_default=True)
    folder_paths.set_output_directory(str(tmp_path / "output"))
    folder = make_image_folder(tmp_path / "ds", n=2)
    with torch.inference_mode():
        mp = tiny_flux_patcher()
        dm = mp.model.diffusion_model
        before = {n: (p.data_ptr(), p.requires_grad) for n, p in dm.named_parameters()}
        assert not _is_inference_model(dm)  # every parameter an inference tensor, as in ComfyUI
        ds = N.FluxLoraDatasetNode.execute(str(folder), "", "sks", 256, True).result[0]
        ds.resolution = 64
        out = N.FluxLoraTrainNode.execute(mp, FakeVAE(), FakeCLIP(), ds, _settings(N, preview_every=2), "inf_lora",
                                          True)
        after = {n: (p.data_ptr(), p.requires_grad) for n, p in dm.named_parameters()}
        assert out.result[0] == "inf_lora.safetensors" and out.result[3].shape[0] == 6  # 3 preview rounds x 2 seeds
        assert after == before and not _is_inference_model(dm)
        assert "forward" not in dm.double_blocks[0].img_attn.qkv.__dict__  # the LoRA forward is gone
        # a second run continues (resume) under inference mode too
        out2 = N.FluxLoraTrainNode.execute(mp, FakeVAE(), FakeCLIP(), ds, _settings(N, steps=8, preview_every=0),
                                           "inf_lora", True)
        import nodes
        caplog.set_level(logging.WARNING)
        m2, _ = nodes.LoraLoader().load_lora(mp, None, out2.result[0], 1.0, 0.0)
        assert not [r for r in caplog.records if "lora key not loaded" in r.getMessage()]
        x = torch.randn(1, 16, 8, 8)
        ctx, y = torch.randn(1, 5, 48), torch.randn(1, 32)
        g = torch.ones(1)
        base = dm(x, torch.full((1,), 0.5), ctx, y=y, guidance=g)
        import comfy.model_management as mm
        mm.load_models_gpu([m2], force_full_load=True)   # as a sampler does: the LoRA patched into the weights
        with_lora = m2.model.diffusion_model(x, torch.full((1,), 0.5), ctx, y=y, guidance=g)
        mm.unload_all_models()
        assert torch.isfinite(with_lora).all() and not torch.equal(base, with_lora)
    from safetensors import safe_open
    assert out.result[1] == out2.result[1]
    with safe_open(out2.result[1], "pt") as f:
        assert f.metadata()["ss_steps"] == "8"


def test_frozen_base_aliases_and_restores():
    from seedvr2bw.training.frozen_base import FrozenBase
    with torch.inference_mode():
        lin = torch.nn.Linear(4, 3)
        lin.register_buffer("b0", torch.ones(2))
        lin.lin2 = lin  # a module reached twice keeps one alias per tensor
    ptrs = (lin.weight.data_ptr(), lin.bias.data_ptr())
    fb = FrozenBase(lin)
    assert fb.aliased == 3 and not lin.weight.is_inference() and not lin.weight.requires_grad
    assert (lin.weight.data_ptr(), lin.bias.data_ptr()) == ptrs  # no copy
    x = torch.randn(2, 4, requires_grad=True)
    lin(x).sum().backward()  # the weight is saved for backward: a normal tensor now
    assert torch.allclose(x.grad, lin.weight.detach().sum(0).expand(2, 4))
    fb.restore()
    assert lin.weight.is_inference() and lin.b0.is_inference() and lin.weight.requires_grad
    assert (lin.weight.data_ptr(), lin.bias.data_ptr()) == ptrs
    normal = torch.nn.Linear(2, 2)
    fb2 = FrozenBase(normal)
    assert fb2.aliased == 0 and not normal.weight.requires_grad
    fb2.restore()
    assert normal.weight.requires_grad and not normal.weight.is_inference()


# ---------------------------------------------------------------- output names and overwriting
@pytest.mark.parametrize("name", ["../../x", "../x", "a/../../x", "/tmp/x", "C:/x", "C:x", "c:\\x", "\\\\server\\x",
                                  "", "sub/", "a//b", "./x", "a:b"])
def test_output_name_outside_loras_is_refused(tmp_path, name):
    from seedvr2bw.training.save import OutputNameError, resolve_output_name
    with pytest.raises(OutputNameError, match="inside models/loras.*'\\.\\.', absolute paths and drive letters"):
        resolve_output_name(str(tmp_path / "loras"), name)


def test_output_name_through_a_link_is_refused(tmp_path):
    from seedvr2bw.training.save import OutputNameError, resolve_output_name
    (tmp_path / "loras").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "loras" / "link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(OutputNameError, match="outside models/loras"):
        resolve_output_name(str(tmp_path / "loras"), "link/x")


@pytest.mark.parametrize("name,folder,base", [("x", "", "x"), ("x.safetensors", "", "x"), ("sub/x", "sub", "x"),
                                              ("a\\b\\c", "a/b", "c"), (" people/alice v2 ", "people", "alice v2")])
def test_output_name_inside_loras(tmp_path, name, folder, base):
    from seedvr2bw.training.save import resolve_output_name
    root = str(tmp_path / "loras")
    d, b = resolve_output_name(root, name)
    assert (os.path.relpath(d, root) if folder else d) == (os.path.join(*folder.split("/")) if folder else root)
    assert b == base


def test_train_node_never_overwrites_silently(nodes_mod, tmp_path):
    N = nodes_mod
    import folder_paths
    loras = tmp_path / "loras"
    folder_paths.add_model_folder_path("loras", str(loras), is_default=True)
    folder_paths.set_output_directory(str(tmp_path / "output"))
    folder = make_image_folder(tmp_path / "ds", n=1)
    ds = N.FluxLoraDatasetNode.execute(str(folder), "", "", 256, True).result[0]
    ds.resolution = 64
    mp = tiny_flux_patcher()
    st = _settings(N, steps=2, preview_every=0)
    with pytest.raises(Exception, match="output_name '../../escape' is refused.*inside models/loras"):
        N.FluxLoraTrainNode.execute(mp, FakeVAE(), FakeCLIP(), ds, st, "../../escape", False)
    assert not list(tmp_path.glob("escape*")) and not list(tmp_path.parent.glob("escape*"))
    out = N.FluxLoraTrainNode.execute(mp, FakeVAE(), FakeCLIP(), ds, st, "keep", False)
    first = Path(out.result[1]).read_bytes()
    # resume off, same name: refused, the file untouched
    with pytest.raises(FileExistsError, match="already exists and resume is off.*overwrite"):
        N.FluxLoraTrainNode.execute(mp, FakeVAE(), FakeCLIP(), ds, _settings(N, steps=3, preview_every=0), "keep",
                                    False)
    assert Path(out.result[1]).read_bytes() == first
    # resume on but no state to resume from: refused too
    (loras / "keep-state.pt").unlink()
    with pytest.raises(FileExistsError, match="has no resume state"):
        N.FluxLoraTrainNode.execute(mp, FakeVAE(), FakeCLIP(), ds, st, "keep", True)
    # overwrite on: replaced
    out3 = N.FluxLoraTrainNode.execute(mp, FakeVAE(), FakeCLIP(), ds, _settings(N, steps=3, preview_every=0), "keep",
                                       False, True)
    from safetensors import safe_open
    with safe_open(out3.result[1], "pt") as f:
        assert f.metadata()["ss_steps"] == "3"


def test_dataset_folder_is_relative_to_the_input_folder(nodes_mod, tmp_path, monkeypatch):
    N = nodes_mod
    import folder_paths
    inp = tmp_path / "input"
    inp.mkdir()
    folder_paths.set_input_directory(str(inp))
    make_image_folder(tmp_path / "cwd" / "mine", n=1)
    monkeypatch.chdir(tmp_path / "cwd")  # a folder of that name relative to the working directory is not used
    with pytest.raises(ValueError, match=f"{str(inp / 'mine')!r} does not exist"):
        N.FluxLoraDatasetNode.execute("mine", "", "", 256, True)
    make_image_folder(inp / "mine", n=1)
    assert N.FluxLoraDatasetNode.execute("mine", "", "", 256, True).result[0].folder == str(inp / "mine")
