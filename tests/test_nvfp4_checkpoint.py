"""Checkpoints: streaming writer, converter, ComfyUI's NVFP4 format both ways, ModelOpt exports.

ComfyUI's loader for NVFP4 (current Comfy-Org/ComfyUI) reads `L.comfy_quant` ({"format": "nvfp4"}),
`L.weight` (uint8), `L.weight_scale_2` (global) and `L.weight_scale` (viewed as float8_e4m3fn) into
comfy_kitchen's TensorCoreNVFP4Layout and dequantizes with comfy_kitchen: the tests below replay exactly that
with the installed comfy-kitchen. The rig's ComfyUI 0.3.75 has no NVFP4 (its QUANT_ALGOS holds only
float8_e4m3fn); the test that loads through the rig's own `comfy.ops` skips with that reason until it does.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from seedvr2bw.optimization.nvfp4 import checkpoint as ckpt
from seedvr2bw.optimization.nvfp4 import format as fmt
from seedvr2bw.optimization.nvfp4.convert import convert_file
from seedvr2bw.optimization.nvfp4.linear import FP8Linear, NVFP4Linear
from seedvr2bw.optimization.nvfp4.surgery import replace_linears
from nvfp4_refs import NVFP4QTensor, QuantizedTensor, TensorCoreNVFP4Layout, comfy_kitchen, needs_ck, needs_mo

ROOT = Path(__file__).resolve().parents[1]


def _u8(t):
    return t.view(torch.uint8)


# ---------------------------------------------------------------- streaming writer
def test_streaming_writer_roundtrip(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.tensor(2.5),
               "d": torch.randn(4, 4).to(torch.float8_e4m3fn), "e": torch.arange(10, dtype=torch.uint8),
               "f": torch.randn(2, 3).half(), "g": torch.zeros(0, 4)}
    p = tmp_path / "x.safetensors"
    ckpt.save_state_dict(str(p), tensors, {"k": "v"})
    with safe_open(str(p), framework="pt") as f:
        assert f.metadata() == {"k": "v"}
        for k, v in tensors.items():
            got = f.get_tensor(k)
            assert got.dtype == v.dtype and got.shape == v.shape
            assert torch.equal(_u8(got.reshape(-1)) if got.numel() else got, _u8(v.reshape(-1)) if v.numel() else v)
    assert not (tmp_path / "x.safetensors.tmp").exists()


def test_streaming_writer_is_atomic(tmp_path):
    p = tmp_path / "y.safetensors"
    save_file({"old": torch.ones(2)}, str(p))
    plan = [("a", torch.float32, (2,)), ("b", torch.float32, (3,))]
    with pytest.raises(ValueError):
        with ckpt.StreamingSafetensorsWriter(str(p), plan) as w:
            w.write("a", torch.ones(2))
            w.write("c", torch.ones(3))             # out of plan -> abort
    with safe_open(str(p), framework="pt") as f:     # old file untouched, temp removed
        assert list(f.keys()) == ["old"]
    assert not (tmp_path / "y.safetensors.tmp").exists()
    with pytest.raises(RuntimeError):
        with ckpt.StreamingSafetensorsWriter(str(p), plan) as w:
            w.write("a", torch.ones(2))
            raise RuntimeError("interrupted")
    assert not (tmp_path / "y.safetensors.tmp").exists()


# ---------------------------------------------------------------- converter
def _seedvr2_like(path, dtype=torch.bfloat16, blocks=1, d=256):
    g = torch.Generator().manual_seed(0)
    sd = {"vid_in.proj.weight": torch.randn(d, 132, generator=g), "vid_in.proj.bias": torch.randn(d, generator=g),
          "txt_in.weight": torch.randn(d, 320, generator=g), "emb_in.proj_in.weight": torch.randn(d, 256, generator=g),
          "vid_out.proj.weight": torch.randn(64, d, generator=g), "vid_out_norm.weight": torch.ones(d)}
    for i in range(blocks):
        p = f"blocks.{i}."
        sd[p + "attn.proj_qkv.vid.weight"] = torch.randn(3 * d, d, generator=g) * 0.02
        sd[p + "attn.proj_out.vid.weight"] = torch.randn(d, d, generator=g) * 0.02
        sd[p + "attn.proj_out.vid.bias"] = torch.randn(d, generator=g)
        sd[p + "mlp.vid.proj_in.weight"] = torch.randn(4 * d, d, generator=g) * 0.02
        sd[p + "mlp.vid.proj_out.weight"] = torch.randn(d, 4 * d, generator=g) * 0.02
        sd[p + "attn.norm_q.vid.weight"] = torch.ones(128)
        sd[p + "ada.vid.attn_shift"] = torch.randn(d, generator=g)
        sd[p + "conv.weight"] = torch.randn(8, 4, 3, 3, generator=g)
    sd = {k: v.to(dtype) for k, v in sd.items()}
    save_file(sd, str(path), metadata={"model": "toy"})
    return sd


QUANTIZED = ["blocks.0.attn.proj_qkv.vid", "blocks.0.attn.proj_out.vid", "blocks.0.mlp.vid.proj_in",
             "blocks.0.mlp.vid.proj_out"]


def test_converter_writes_comfyui_nvfp4_format(tmp_path):
    src, dst = tmp_path / "m.safetensors", tmp_path / "m_nvfp4.safetensors"
    sd = _seedvr2_like(src)
    steps = []
    s = convert_file(str(src), str(dst), progress=lambda i, n, k: steps.append((i, n)))
    assert sorted(s.quantized) == sorted(QUANTIZED)
    assert set(s.kept) == {"vid_in.proj", "txt_in", "emb_in.proj_in", "vid_out.proj"}
    assert steps[-1][0] == steps[-1][1] and s.bytes_after < s.bytes_before
    out, meta = ckpt.load_state_dict(str(dst))
    layers = json.loads(meta["_quantization_metadata"])["layers"]
    assert set(layers) == set(QUANTIZED) and all(v == {"format": "nvfp4"} for v in layers.values())
    assert json.loads(meta[ckpt.PACK_METADATA_KEY])["nibble_order"] == "hi_first" and meta["model"] == "toy"
    for L in QUANTIZED:
        w = sd[L + ".weight"]
        n, k = w.shape
        assert out[L + ".weight"].dtype == torch.uint8 and out[L + ".weight"].shape == (n, k // 2)
        assert out[L + ".weight_scale"].dtype == torch.float8_e4m3fn
        assert out[L + ".weight_scale"].shape == fmt.swizzled_scale_shape(n, k // 16)
        assert out[L + ".weight_scale_2"].dtype == torch.float32 and out[L + ".weight_scale_2"].shape == ()
        assert ckpt.read_comfy_quant(out[L + ".comfy_quant"])["format"] == "nvfp4"
        p, sc, g = fmt.quantize_nvfp4(w)
        assert torch.equal(out[L + ".weight"], p) and torch.equal(_u8(out[L + ".weight_scale"]), _u8(sc))
    # untouched tensors are copied bit for bit
    for k in ("vid_in.proj.weight", "blocks.0.attn.proj_out.vid.bias", "blocks.0.conv.weight",
              "blocks.0.ada.vid.attn_shift", "vid_out_norm.weight"):
        assert torch.equal(out[k], sd[k])


def test_converter_script_cli_and_summary(tmp_path):
    src, dst = tmp_path / "m.safetensors", tmp_path / "o.safetensors"
    _seedvr2_like(src)
    js = tmp_path / "s.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "convert_to_nvfp4.py"), str(src), str(dst),
                        "--device", "cpu", "--keep", "mlp", "--json", str(js)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "layers quantized" in r.stdout and "GiB" in r.stdout
    s = json.loads(js.read_text())
    assert sorted(s["quantized"]) == ["blocks.0.attn.proj_out.vid", "blocks.0.attn.proj_qkv.vid"]


def test_converter_from_fp8_sources(tmp_path):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(128, 256, generator=g) * 0.05
    w8, s = fmt.quantize_fp8_per_tensor(w)
    # ComfyUI fp8 format (marker + weight_scale) and the legacy scaled_fp8 one (scale_weight)
    src1 = {"blocks.0.mlp.fc.weight": w8, "blocks.0.mlp.fc.weight_scale": s,
            "blocks.0.mlp.fc.comfy_quant": ckpt.comfy_quant_tensor({"format": "float8_e4m3fn"}),
            "blocks.0.mlp.fc.bias": torch.randn(128, generator=g)}
    src2 = {"blocks.0.mlp.fc.weight": w8, "blocks.0.mlp.fc.scale_weight": s, "scaled_fp8": torch.zeros(2)}
    for i, sd in enumerate((src1, src2)):
        p, q = tmp_path / f"f{i}.safetensors", tmp_path / f"f{i}_nv.safetensors"
        save_file(sd, str(p))
        convert_file(str(p), str(q))
        out, meta = ckpt.load_state_dict(str(q))
        assert "scaled_fp8" not in out and "blocks.0.mlp.fc.scale_weight" not in out
        d = ckpt.load_nvfp4_layer(out, "blocks.0.mlp.fc", 128, 256)["weight"]
        want = fmt.quantize_nvfp4(w8.float() * s, return_tensor=True)
        assert torch.equal(d.packed, want.packed)


def test_converter_peak_memory_is_about_one_tensor(tmp_path):
    src, dst = tmp_path / "big.safetensors", tmp_path / "big_nv.safetensors"
    g = torch.Generator().manual_seed(0)
    save_file({f"blocks.{i}.mlp.proj_in.weight": (torch.randn(2048, 2048, generator=g) * 0.02).to(torch.bfloat16)
               for i in range(24)}, str(src))       # 24 x 8 MiB = 192 MiB of bf16
    code = (
        "import sys, threading, time; sys.path.insert(0, %r)\n"
        "from pack_import import import_pack; import_pack()\n"
        "import torch\n"
        "from seedvr2bw.optimization.nvfp4.convert import convert_file\n"
        "def anon():\n"
        "    for line in open('/proc/self/status'):\n"
        "        if line.startswith('RssAnon:'):\n"
        "            return int(line.split()[1]) * 1024\n"
        "base = anon(); peak = [base]; done = []\n"
        "def watch():\n"
        "    while not done:\n"
        "        peak[0] = max(peak[0], anon()); time.sleep(0.002)\n"
        "t = threading.Thread(target=watch); t.start()\n"
        "convert_file(%r, %r)\n"
        "done.append(1); t.join()\n"
        "print(base, peak[0])\n" % (str(ROOT), str(src), str(dst)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    base, peak = map(int, r.stdout.split())
    model = os.path.getsize(src)
    # anonymous memory (file pages of the memory-mapped source are page cache, not copies)
    assert peak - base < 0.5 * model, (peak - base, model)       # well under two model copies


# ---------------------------------------------------------------- ComfyUI format: our file -> ComfyUI loader
@needs_ck
def test_our_file_loads_through_comfyui_nvfp4_layout(tmp_path):
    """Replays current ComfyUI's MixedPrecisionOps nvfp4 branch with comfy-kitchen (CPU eager)."""
    src, dst = tmp_path / "m.safetensors", tmp_path / "m_nv.safetensors"
    sd = _seedvr2_like(src, dtype=torch.float32)
    convert_file(str(src), str(dst))
    out, meta = ckpt.load_state_dict(str(dst))
    for L in QUANTIZED:
        conf = json.loads(out[L + ".comfy_quant"].numpy().tobytes())
        assert conf["format"] == "nvfp4"
        n, k = sd[L + ".weight"].shape
        params = TensorCoreNVFP4Layout.Params(scale=out[L + ".weight_scale_2"],
                                              block_scale=out[L + ".weight_scale"].view(torch.float8_e4m3fn),
                                              orig_dtype=torch.float32, orig_shape=(n, k))
        qt = QuantizedTensor(out[L + ".weight"].to(torch.uint8), "TensorCoreNVFP4Layout", params)
        with comfy_kitchen.registry.use_backend("eager"):
            comfy_w = qt.dequantize()[:n, :k]
        ours = ckpt.load_nvfp4_layer(out, L, n, k)["weight"].dequantize(torch.float32)
        assert torch.equal(comfy_w, ours), L


def _rig_quant_algos():
    rig = ROOT / ".comfyui"
    if not (rig / "comfy" / "quant_ops.py").exists():
        return None, "the rig's ComfyUI is not installed at .comfyui"
    text = (rig / "comfy" / "quant_ops.py").read_text()
    if '"nvfp4"' not in text:
        return None, "the rig's ComfyUI (.comfyui) has no NVFP4 support: QUANT_ALGOS has no 'nvfp4' (0.3.75)"
    return rig, ""


def test_rig_comfyui_loads_our_file_when_it_supports_nvfp4(tmp_path):
    rig, why = _rig_quant_algos()
    if rig is None:
        pytest.skip(why)
    code = (
        "import sys, json, torch; sys.path.insert(0, %r)\n"
        "import comfy.cli_args; comfy.cli_args.args.cpu = True\n"
        "import comfy.utils, comfy.ops\n"
        "sd, meta = comfy.utils.load_torch_file(%r, return_metadata=True)\n"
        "ops = comfy.ops.mixed_precision_ops({}, torch.float32, full_precision_mm=True)\n"
        "lin = ops.Linear(256, 1024, bias=False, device='cpu')\n"
        "pre = 'blocks.0.mlp.vid.proj_in.'\n"
        "sub = {k[len(pre):]: v for k, v in sd.items() if k.startswith(pre)}\n"
        "lin.load_state_dict(sub, strict=False)\n"
        "w = lin.weight.dequantize() if hasattr(lin.weight, 'dequantize') else lin.weight\n"
        "torch.save(w.float(), %r)\n")
    src, dst, wout = tmp_path / "m.safetensors", tmp_path / "n.safetensors", tmp_path / "w.pt"
    _seedvr2_like(src, dtype=torch.float32)
    convert_file(str(src), str(dst))
    r = subprocess.run([sys.executable, "-c", code % (str(rig), str(dst), str(wout))], capture_output=True,
                       text=True, cwd=str(rig))
    assert r.returncode == 0, r.stderr[-3000:]
    out, _ = ckpt.load_state_dict(str(dst))
    ours = ckpt.load_nvfp4_layer(out, "blocks.0.mlp.vid.proj_in", 1024, 256)["weight"].dequantize()
    assert torch.equal(torch.load(wout)[:1024, :256], ours)


def test_rig_comfyui_fp8_loader_reads_our_fp8_file(tmp_path):
    """The rig's ComfyUI 0.3.75 does support float8_e4m3fn through _quantization_metadata: load an FP8 file
    written by our converter through its own MixedPrecisionOps."""
    rig = ROOT / ".comfyui"
    if not (rig / "comfy" / "ops.py").exists():
        pytest.skip("the rig's ComfyUI is not installed at .comfyui")
    src, dst, wout = tmp_path / "m.safetensors", tmp_path / "f8.safetensors", tmp_path / "w.pt"
    _seedvr2_like(src, dtype=torch.float32)
    convert_file(str(src), str(dst), target="fp8")
    code = (
        "import sys, json, torch; sys.path.insert(0, %r)\n"
        "import comfy.cli_args; comfy.cli_args.args.cpu = True\n"
        "import comfy.utils, comfy.ops, comfy.model_detection as md\n"
        "sd, meta = comfy.utils.load_torch_file(%r, return_metadata=True)\n"
        "layers = md.detect_layer_quantization(dict(meta))\n"
        "ops = comfy.ops.mixed_precision_ops(layers, torch.float32)\n"
        "lin = ops.Linear(256, 1024, bias=False, device='cpu')\n"
        "pre = 'blocks.0.mlp.vid.proj_in.'\n"
        "lin._load_from_state_dict({k: v for k, v in sd.items() if k.startswith(pre) and not k.endswith('comfy_quant')},"
        " pre, {}, False, [], [], [])\n"
        "torch.save(lin.weight.dequantize().float(), %r)\n")
    r = subprocess.run([sys.executable, "-c", code % (str(rig), str(dst), str(wout))], capture_output=True,
                       text=True, cwd=str(rig))
    if r.returncode != 0 and "ModuleNotFoundError" in r.stderr:
        pytest.skip("the rig's ComfyUI needs packages this env lacks: " + r.stderr.strip().splitlines()[-1])
    assert r.returncode == 0, r.stderr[-3000:]
    out, _ = ckpt.load_state_dict(str(dst))
    want = out["blocks.0.mlp.vid.proj_in.weight"].float() * out["blocks.0.mlp.vid.proj_in.weight_scale"]
    assert torch.equal(torch.load(wout), want)


# ---------------------------------------------------------------- ComfyUI / ModelOpt files -> ours
@needs_ck
def test_comfyui_quantized_file_loads_in_ours_identically(tmp_path):
    """A file as ComfyUI writes it (comfy-kitchen TensorCoreNVFP4Layout.quantize + state_dict_tensors)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(100, 200, generator=g)                # ragged: padded to 112 x 208 by ComfyUI
    with comfy_kitchen.registry.use_backend("eager"):
        qdata, params = TensorCoreNVFP4Layout.quantize(w)
    sd = {f"layer.weight{suffix}": t for suffix, t in TensorCoreNVFP4Layout.state_dict_tensors(qdata, params).items()}
    sd["layer.comfy_quant"] = ckpt.comfy_quant_tensor({"format": "nvfp4"})
    sd["layer.bias"] = torch.randn(100, generator=g)
    p = tmp_path / "c.safetensors"
    save_file(sd, str(p))
    sd2, meta = ckpt.load_state_dict(str(p))
    model = torch.nn.Sequential()
    model.add_module("layer", torch.nn.Linear(200, 100))
    rep = replace_linears(model, sd2, path="reference", dtype=torch.float32, metadata=meta)
    assert rep["nvfp4"] == ["layer"]
    ours = model.layer.dequantize_weight(torch.float32)
    with comfy_kitchen.registry.use_backend("eager"):
        theirs = QuantizedTensor(qdata, "TensorCoreNVFP4Layout", params).dequantize().float()[:100, :200]
    assert torch.equal(ours, theirs)


@needs_mo
@pytest.mark.parametrize("names", ["hf", "trtllm"])
def test_modelopt_export_loads_in_ours_identically(tmp_path, names):
    g = torch.Generator().manual_seed(6)
    w = torch.randn(96, 160, generator=g)
    qt, s, g2 = NVFP4QTensor.quantize(w.clone(), 16)
    keys = {"hf": ("weight_scale", "weight_scale_2", "input_scale"),
            "trtllm": ("weights_scaling_factor", "weights_scaling_factor_2", "activation_scaling_factor")}[names]
    sd = {"blk.fc.weight": qt._quantized_data, f"blk.fc.{keys[0]}": s, f"blk.fc.{keys[1]}": g2,
          f"blk.fc.{keys[2]}": torch.tensor(0.05)}
    p = tmp_path / "mo.safetensors"
    save_file(sd, str(p))
    sd2, meta = ckpt.load_state_dict(str(p))
    assert ckpt.detect_nvfp4_source(sd2, "blk.fc", meta) == "modelopt"
    model = torch.nn.Module()
    model.blk = torch.nn.Module()
    model.blk.fc = torch.nn.Linear(160, 96, bias=False)
    rep = replace_linears(model, sd2, path="reference", dtype=torch.float32)
    assert rep["nvfp4"] == ["blk.fc"]
    ours = model.blk.fc.dequantize_weight(torch.float32)
    theirs = qt.dequantize(dtype=torch.float32, scale=s, double_scale=g2, block_sizes={-1: 16})
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=0)
    assert torch.equal(ours, fmt.dequantize_nvfp4(qt._quantized_data, s, g2, torch.float32, nibble_order="lo_first",
                                                  swizzled=False))
    assert model.blk.fc.input_scale.item() == pytest.approx(0.05)
    # converted to the internal convention: hi_first, padded, swizzled
    assert model.blk.fc.weight.shape == (96, 80)
    assert torch.equal(model.blk.fc.weight, fmt.swap_nibbles(qt._quantized_data))


def test_modelopt_swizzled_export_with_override():
    w = torch.randn(64, 64)
    p, s, g = fmt.quantize_nvfp4(w, recipe="modelopt", nibble_order="lo_first", swizzle=True)
    sd = {"fc.weight": p, "fc.weight_scale": s, "fc.weight_scale_2": g}
    d = ckpt.load_nvfp4_layer(sd, "fc", 64, 64, source="modelopt_swizzled")["weight"]
    assert torch.equal(d.dequantize(), fmt.dequantize_nvfp4(p, s, g, nibble_order="lo_first"))


def test_fp8_checkpoint_layer_loads_as_fp8_linear():
    w = torch.randn(32, 64)
    w8, s = fmt.quantize_fp8_per_tensor(w)
    sd = ckpt.fp8_layer_entries("fc", w8, s, bias=torch.zeros(32))
    model = torch.nn.Module()
    model.fc = torch.nn.Linear(64, 32)
    rep = replace_linears(model, sd, dtype=torch.float32)
    assert rep["fp8"] == ["fc"] and isinstance(model.fc, FP8Linear)
    assert torch.equal(model.fc.dequantize_weight(torch.float32), w8.float() * s)
    assert isinstance(NVFP4Linear(16, 16), torch.nn.Module)
