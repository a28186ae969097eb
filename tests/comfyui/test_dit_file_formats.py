"""Every SeedVR2 DiT file layout users have, and every file error of issue #28, through the ComfyUI nodes in both
rigs: ComfyUI 0.3.75 (in-process executor, this process) and ComfyUI 0.19.3 (its in-process executor in a process of
its own with its venv, ``tests/rig/run_prompts.py``; skipped with the reason where ../shared has no 0.19.3).

The example image workflow (workflows/seedvr2_image_upscale.json) runs once per DiT file through
``SeedVR2BW_LoadDiT``: the tiny golden 3B written as fp32 / fp16 / bf16 safetensors, the official ``.pth``, numz's
fp8 e4m3fn with its last block fp16 and GGUF Q8_0 / Q4_0, ComfyUI's fp16 file with the conditioning baked in and its
``comfy_quant`` nvfp4 / mxfp8 / int8 ConvRot layers (tests/dit_files.py writes them). Each output image must have the
size asked for and be close to the fp32 file's output of the same rig within its format's error.

Measured (CPU, the 20x12 input upscaled to 40x24 in one step; |difference| to the fp32 file's PNG in 8-bit levels,
mean / max; the same to the level in both rigs): .pth 0 / 0, fp16 0.037 / 1, ComfyUI fp16 0.037 / 1, bf16
0.25 / 2, int8 ConvRot 0.45 / 3, GGUF Q8_0 0.68 / 6, fp8 mixed 1.25 / 9, mxfp8 1.42 / 13, nvfp4 4.41 / 35, GGUF
Q4_0 7.54 / 70. The order follows each format's DiT error (tests/test_dit_comfy_layouts.py, tests/test_dit_gguf.py);
``MEAN_DIFF`` / ``MAX_DIFF`` are these with about half again as room.

Then each file error a user meets, checked on the message the executor reports (what the error panel shows):
a truncated .safetensors, random bytes, a pickle carrying code (which must not run), a DiT in the VAE loader, a FLUX
file in the DiT loader, an unsupported ``comfy_quant`` format, and a .gguf where the `gguf` package is missing
(hidden from the process: ``sys.modules`` in 0.3.75, a ``gguf`` that raises ImportError on 0.19.3's PYTHONPATH).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from .conftest import REPO
from .ui_to_api import from_node_classes, ui_to_api

IMAGE_WF = REPO / "workflows" / "seedvr2_image_upscale.json"
IN_W, IN_H = 20, 12
RESOLUTION = 24
OUT_SIZE = (40, 24)          # shortest edge 12 -> 24
INPUT_NAME = "dit_formats_input.png"
VAE_NAME = "ema_vae_formats.safetensors"
REFERENCE = "fp32"

FORMATS_FP32 = "seedvr2_formats_3b_fp32.safetensors"
# format -> DiT file name; the builders are in _build_files
FORMATS = {
    "fp32": FORMATS_FP32,
    "fp16": "seedvr2_formats_3b_fp16.safetensors",
    "bf16": "seedvr2_formats_3b_bf16.safetensors",
    "pth": "seedvr2_formats_3b_official.pth",
    "fp8_mixed": "seedvr2_formats_3b_fp8_e4m3fn_mixed_last_block_fp16.safetensors",
    "gguf_q8_0": "seedvr2_formats_3b-Q8_0.gguf",
    "gguf_q4_0": "seedvr2_formats_3b-Q4_0.gguf",
    "comfy_fp16": "seedvr2_formats_3b_comfy_fp16_conditioning.safetensors",
    "nvfp4": "seedvr2_formats_3b_nvfp4.safetensors",
    "mxfp8": "seedvr2_formats_3b_mxfp8.safetensors",
    "int8_convrot": "seedvr2_formats_3b_int8_convrot.safetensors",
}
# the largest |difference| to the fp32 file's output allowed, in 8-bit levels (module docstring: measured)
MAX_DIFF = {"fp32": 0, "pth": 0, "fp16": 2, "bf16": 4, "comfy_fp16": 2, "fp8_mixed": 14, "gguf_q8_0": 9,
            "gguf_q4_0": 100, "mxfp8": 20, "int8_convrot": 5, "nvfp4": 50}
MEAN_DIFF = {"fp32": 0.0, "pth": 0.0, "fp16": 0.1, "bf16": 0.4, "comfy_fp16": 0.1, "fp8_mixed": 2.0,
             "gguf_q8_0": 1.0, "gguf_q4_0": 11.0, "mxfp8": 2.2, "int8_convrot": 0.7, "nvfp4": 6.5}

# The file errors of issue #28: (case, loader, file name, what the message must say, what it must not say)
ERRORS = {
    "truncated_safetensors": ("dit", "seedvr2_formats_truncated_3b.safetensors",
                              ["SeedVR2 DiT file seedvr2_formats_truncated_3b.safetensors is damaged or is not a model "
                               "file", "download it again"], []),
    "random_bytes": ("vae", "ema_vae_formats_random_bytes.safetensors",
                     ["ema_vae_formats_random_bytes.safetensors is damaged or is not a model file",
                      "download it again"], []),
    "pickle_with_code": ("dit", "seedvr2_formats_carries_code_3b.pth",
                         ["seedvr2_formats_carries_code_3b.pth contains Python code", "not loaded",
                          "safetensors version"], ["weights_only"]),
    "dit_in_vae_loader": ("vae", "ema_vae_formats_really_a_dit.pth",
                          ["not a SeedVR2 video VAE", "this is a SeedVR2 DiT: use the DiT loader"], []),
    # a .safetensors DiT is not in the VAE list (its header says DiT): ComfyUI 0.19.3 checks combo values and
    # refuses it before any node runs, naming the value; 0.3.75 does not check V3 combos and the loader says what it is
    "dit_safetensors_in_vae_loader": ("vae", FORMATS_FP32,
                                      ["not a SeedVR2 video VAE", "this is a SeedVR2 DiT: use the DiT loader"], []),
    "flux_in_dit_loader": ("dit", "seedvr2_formats_really_flux.pth", ["FLUX", "not a SeedVR2 DiT"], []),
    "unsupported_comfy_quant": ("dit", "seedvr2_formats_w4a4_3b.safetensors",
                                ["seedvr2_formats_w4a4_3b.safetensors", "blocks.0.attn.proj_out.vid",
                                 "quantization format 'convrot_w4a4'"], []),
}
NODE_TYPE = {"dit": "SeedVR2BW_LoadDiT", "vae": "SeedVR2BW_LoadVAE"}
# a copy of the Q8_0 file under its own name (the 0.3.75 executor caches the loader's output per file name)
GGUF_NO_PACKAGE = "seedvr2_formats_3b-Q8_0_without_gguf.gguf"


# ----------------------------------------------------------------------------------------- files and prompts
def _build_files(folder: Path, scratch: Path, marker: Path) -> None:
    import torch
    from dit_files import (golden_weights, write_comfy_layout_dit, write_fp8_dit, write_gguf_dit, write_int8_dit,
                           write_pickle_with_code, write_plain_dit, write_unknown_comfy_quant_dit)
    from make_tiny_models import make_tiny_models
    from safetensors.torch import load_file
    from seedvr2bw.optimization.nvfp4.convert import convert_file
    import gguf

    tiny = make_tiny_models(scratch, flux=True)
    shutil.copy(tiny["vae"], folder / VAE_NAME)
    for kind in ("pos", "neg"):
        shutil.copy(tiny[kind], folder / Path(tiny[kind]).name)
    write_plain_dit(folder / FORMATS["fp32"], "3b", torch.float32)
    write_plain_dit(folder / FORMATS["fp16"], "3b", torch.float16)
    write_plain_dit(folder / FORMATS["bf16"], "3b", torch.bfloat16)
    write_plain_dit(folder / FORMATS["pth"], "3b", torch.float32)
    write_fp8_dit(folder / FORMATS["fp8_mixed"], "3b", keep_last_block=True)
    write_gguf_dit(folder / FORMATS["gguf_q8_0"], "3b", gguf.GGMLQuantizationType.Q8_0)
    write_gguf_dit(folder / FORMATS["gguf_q4_0"], "3b", gguf.GGMLQuantizationType.Q4_0)
    shutil.copy(folder / FORMATS["gguf_q8_0"], folder / GGUF_NO_PACKAGE)
    # baked: the same text embeddings as pos_emb.pt / neg_emb.pt beside the other files, so outputs compare
    write_comfy_layout_dit(folder / FORMATS["comfy_fp16"], torch.load(tiny["pos"]), torch.load(tiny["neg"]))
    for fmt in ("nvfp4", "mxfp8"):
        convert_file(str(golden_weights("3b")), str(folder / FORMATS[fmt]), target=fmt)
    write_int8_dit(folder / FORMATS["int8_convrot"], "3b")
    # the broken ones
    data = (folder / FORMATS["fp16"]).read_bytes()
    (folder / ERRORS["truncated_safetensors"][1]).write_bytes(data[: len(data) // 2])
    (folder / ERRORS["random_bytes"][1]).write_bytes(np.random.default_rng(7).bytes(64 * 1024))
    write_pickle_with_code(folder / ERRORS["pickle_with_code"][1], marker)
    torch.save(load_file(str(golden_weights("3b"))), str(folder / ERRORS["dit_in_vae_loader"][1]))
    torch.save(load_file(str(tiny["flux"])), str(folder / ERRORS["flux_in_dit_loader"][1]))
    write_unknown_comfy_quant_dit(folder / FORMATS["int8_convrot"], folder / ERRORS["unsupported_comfy_quant"][1])


def _write_input(input_dir: Path) -> None:
    from PIL import Image
    arr = (np.random.default_rng(0).random((IN_H, IN_W, 3)) * 255).astype(np.uint8)
    Image.fromarray(arr).save(input_dir / INPUT_NAME)


def _ids(wf: dict) -> dict:
    return {n["type"]: str(n["id"]) for n in wf["nodes"]}


def _prompt(node_classes, dit: str, vae: str = VAE_NAME, prefix: str = "formats") -> tuple[dict, str]:
    """The image workflow as an API prompt on ``dit`` and ``vae``; returns it and the SaveImage node's id."""
    wf = json.loads(IMAGE_WF.read_text())
    ids = _ids(wf)
    prompt = ui_to_api(wf, from_node_classes(node_classes))
    prompt[ids["LoadImage"]]["inputs"]["image"] = INPUT_NAME
    prompt[ids["SeedVR2BW_LoadDiT"]]["inputs"]["model"] = dit
    prompt[ids["SeedVR2BW_LoadVAE"]]["inputs"]["model"] = vae
    prompt[ids["SeedVR2BW_Upscale"]]["inputs"]["resolution"] = RESOLUTION
    prompt[ids["SaveImage"]]["inputs"]["filename_prefix"] = prefix
    return prompt, ids["SaveImage"]


def _format_prompt(node_classes, fmt: str, rig: str):
    return _prompt(node_classes, FORMATS[fmt], prefix=f"{rig}_{fmt}")


def _error_prompt(node_classes, case: str, rig: str):
    loader, name, _says, _not = ERRORS[case]
    if loader == "dit":
        return _prompt(node_classes, name, prefix=f"{rig}_{case}")
    return _prompt(node_classes, FORMATS[REFERENCE], vae=name, prefix=f"{rig}_{case}")


def _image(output_dir: Path, outputs: dict, save_id: str) -> np.ndarray:
    """The one image SaveImage wrote (int16 RGB, height x width x 3)."""
    from PIL import Image
    items = outputs[save_id]["images"]
    assert len(items) == 1, items
    with Image.open(output_dir / items[0].get("subfolder", "") / items[0]["filename"]) as im:
        return np.asarray(im.convert("RGB")).astype(np.int16)


def _message(error: dict | None) -> str:
    err = error or {}
    return f"{err.get('exception_type', '')}: {err.get('exception_message', '')}"


# ----------------------------------------------------------------------------------------- the two rigs
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    pytest.importorskip("gguf", reason="the `gguf` package (requirements-test.txt) writes the GGUF files")
    base = tmp_path_factory.mktemp("dit_formats")
    folder = base / "SEEDVR2"
    folder.mkdir()
    marker = base / "the_pickle_ran_code"
    _build_files(folder, base / "scratch", marker)
    return folder, marker


@pytest.fixture(scope="module")
def rig_0375(comfy_inprocess, files):
    """Every format and error prompt through ComfyUI 0.3.75's executor: {key: (RunResult, image or None)}."""
    folder, _ = files
    fp = comfy_inprocess.folder_paths
    fp.add_model_folder_path("seedvr2", str(folder))
    _write_input(Path(fp.get_input_directory()))
    out_dir = Path(fp.get_output_directory())
    results = {}
    try:
        for fmt in FORMATS:
            prompt, save = _format_prompt(comfy_inprocess.node_classes, fmt, "r0375")
            res = comfy_inprocess.run(prompt)
            results[fmt] = (res, _image(out_dir, res.outputs, save) if res.success else None)
        for case in ERRORS:
            prompt, _ = _error_prompt(comfy_inprocess.node_classes, case, "r0375")
            results[case] = (comfy_inprocess.run(prompt), None)
    finally:
        fp.folder_names_and_paths["seedvr2"][0].remove(str(folder))
    return results


def _run_0193(next_rig, pack_parent, folder: Path, work: Path, prompts: list, env: dict | None = None) -> list:
    """``prompts`` through ComfyUI 0.19.3's executor in one process of its own (run_prompts.py): its result entries."""
    import os
    tree, python = next_rig
    for d in ("output", "input", "temp"):
        (work / d).mkdir(parents=True)
    _write_input(work / "input")
    job = {"comfy_dir": str(tree), "custom_node_dirs": [str(pack_parent)], "output_dir": str(work / "output"),
           "input_dir": str(work / "input"), "temp_dir": str(work / "temp"), "model_dirs": {"seedvr2": str(folder)},
           "prompts": prompts}
    (work / "job.json").write_text(json.dumps(job))
    r = subprocess.run([str(python), str(REPO / "tests" / "rig" / "run_prompts.py"), str(work / "job.json"),
                        str(work / "result.json")], cwd=str(tree), capture_output=True, text=True, timeout=1200,
                       env={**os.environ, **(env or {})})
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    res = json.loads((work / "result.json").read_text())
    assert res["comfyui_version"] == "0.19.3"
    return res["results"]


@pytest.fixture(scope="module")
def rig_0193(next_rig, pack_parent, comfy_inprocess, files, tmp_path_factory):
    """The same prompts through ComfyUI 0.19.3's executor, all in one process of its own."""
    folder, _ = files
    work = tmp_path_factory.mktemp("dit_formats_0193")
    keys = list(FORMATS) + list(ERRORS)
    prompts = [_format_prompt(comfy_inprocess.node_classes, k, "r0193") for k in FORMATS] + \
              [_error_prompt(comfy_inprocess.node_classes, k, "r0193") for k in ERRORS]
    entries = _run_0193(next_rig, pack_parent, folder, work, [p for p, _ in prompts])
    results = {}
    for key, (_, save), entry in zip(keys, prompts, entries):
        ok = key in FORMATS and entry["success"]
        results[key] = (entry, _image(work / "output", entry["outputs"], save) if ok else None)
    return results


def _entry(rig, key):
    """(success, status, error, node_errors, image) of one prompt, from either rig."""
    if isinstance(rig[key][0], dict):   # 0.19.3: run_prompts.py's result entries
        entry, image = rig[key]
        return entry["success"], entry["status"], entry["error"], entry["node_errors"], image
    res, image = rig[key]
    return res.success, res.status, res.error, res.node_errors, image


@pytest.fixture(params=["0.3.75", "0.19.3"])
def rig(request):
    return request.getfixturevalue("rig_0375" if request.param == "0.3.75" else "rig_0193")


# ----------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_dit_format_upscales_close_to_fp32(rig, fmt):
    ok, status, error, node_errors, image = _entry(rig, fmt)
    assert ok, (status, _message(error), node_errors)
    ref = _entry(rig, REFERENCE)[4]
    assert ref is not None, "the fp32 file's run failed"
    assert image.shape == ref.shape == (OUT_SIZE[1], OUT_SIZE[0], 3), image.shape
    diff = np.abs(image - ref)
    print(f"{fmt}: |diff| to fp32 mean {diff.mean():.3f} max {diff.max()} (8-bit levels)")
    assert diff.max() <= MAX_DIFF[fmt] and diff.mean() <= MEAN_DIFF[fmt], (fmt, diff.mean(), diff.max())
    if fmt not in ("fp32", "pth"):
        assert diff.max() > 0, f"{fmt}: the very same image as fp32 (were the file's weights used?)"


def test_both_rigs_give_the_same_fp32_image(rig_0375, rig_0193):
    a, b = _entry(rig_0375, REFERENCE)[4], _entry(rig_0193, REFERENCE)[4]
    assert np.abs(a - b).max() <= 1


@pytest.mark.parametrize("case", list(ERRORS))
def test_file_error_message(rig, files, case):
    loader, name, says, never = ERRORS[case]
    ok, status, error, node_errors, _ = _entry(rig, case)
    assert not ok
    if status == "invalid":
        # a ComfyUI that checks combo values (0.19.3) refuses a file the list does not offer before any node runs;
        # every other case is offered (pickles by their name)
        assert case == "dit_safetensors_in_vae_loader", f"{case}: {name} not offered by the {loader} list: {error}"
        assert "Value not in list" in str(node_errors) and name in str(node_errors), node_errors
        return
    assert status == "execution_error", status
    assert error["node_type"] == NODE_TYPE[loader], error
    text = _message(error)
    for s in says:
        assert s in text, f"{case}: {s!r} not in the message: {text}"
    for s in never:
        assert s not in text, f"{case}: {s!r} in the message: {text}"
    assert not files[1].exists(), "unpickling the file ran the code it carries"


def _check_gguf_missing(ok, status, error) -> None:
    assert not ok and status == "execution_error", (status, error)
    assert error["node_type"] == "SeedVR2BW_LoadDiT", error
    text = _message(error)
    for s in (f"SeedVR2 DiT file {GGUF_NO_PACKAGE} is a GGUF file", "needs the `gguf` package, which is not installed",
              "pip install gguf"):
        assert s in text, f"{s!r} not in the message: {text}"


def test_gguf_without_the_package_0375(comfy_inprocess, files, monkeypatch):
    """`import gguf` fails as it does where the package is not installed (the pack imports it when it reads a file)."""
    folder, _ = files
    fp = comfy_inprocess.folder_paths
    fp.add_model_folder_path("seedvr2", str(folder))
    monkeypatch.setitem(sys.modules, "gguf", None)
    try:
        res = comfy_inprocess.run(_prompt(comfy_inprocess.node_classes, GGUF_NO_PACKAGE, prefix="r0375_nogguf")[0])
    finally:
        fp.folder_names_and_paths["seedvr2"][0].remove(str(folder))
    _check_gguf_missing(res.success, res.status, res.error)


def test_gguf_without_the_package_0193(next_rig, pack_parent, comfy_inprocess, files, tmp_path):
    """0.19.3 in a process where a `gguf` on PYTHONPATH raises ImportError, as a missing package does."""
    folder, _ = files
    shadow = tmp_path / "no_gguf"
    (shadow / "gguf").mkdir(parents=True)
    (shadow / "gguf" / "__init__.py").write_text('raise ImportError("No module named \'gguf\'")\n')
    prompt = _prompt(comfy_inprocess.node_classes, GGUF_NO_PACKAGE, prefix="r0193_nogguf")[0]
    entry, = _run_0193(next_rig, pack_parent, folder, tmp_path / "run", [prompt], env={"PYTHONPATH": str(shadow)})
    _check_gguf_missing(entry["success"], entry["status"], entry["error"])
