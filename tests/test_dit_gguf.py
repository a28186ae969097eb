"""GGUF DiT files (numz's SeedVR2 GGUFs) through ``load_dit``: the tiny golden models written with the `gguf`
package's writer and quantizer, checked against the fp32 golden output.

Measured on the tiny models (rel-L2 of ``out`` against the fp32 golden output, image and video cases; every linear
whose K is a multiple of 32 quantized, the rest F32): Q8_0 0.0073-0.0087, Q5_1 0.050-0.066, Q4_0 0.12-0.14.
Those errors are the quantization's alone: the same model with the dequantized weights loaded as dense fp32
linears gives the GGUF model's output to 1e-6.
"""
import shutil

import pytest
import torch

from dit_files import rel_l2, write_gguf_dit
from dit_files import run_golden_case as run
from seedvr2bw.models.seedvr2.dit import load_dit
from seedvr2bw.models.seedvr2.files import ModelFileError
from seedvr2bw.optimization.gguf import GGUFLinear, dequantize

gguf = pytest.importorskip("gguf", reason="the `gguf` package (requirements-test.txt) writes the test files")

GT = gguf.GGMLQuantizationType
# the measured error (module docstring) with some room, per GGML type
TOLERANCE = {GT.Q8_0: 0.015, GT.Q5_1: 0.1, GT.Q4_0: 0.2}


@pytest.mark.parametrize("variant", ["3b", "7b"])
@pytest.mark.parametrize("qtype", [GT.Q8_0, GT.Q5_1, GT.Q4_0], ids=lambda q: q.name)
def test_gguf_dit_matches_fp32_within_quantization_error(tmp_path, variant, qtype):
    path = tmp_path / f"seedvr2_ema_{variant}-{qtype.name}.gguf"
    write_gguf_dit(path, variant, qtype)
    model = load_dit(path, dtype=torch.float32)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, GGUFLinear)}
    assert "blocks.0.attn.proj_qkv.vid" in linears and "blocks.0.mlp.vid.proj_out" in linears, sorted(linears)[:8]
    assert all(m.qtype == qtype and m.weight.dtype == torch.uint8 for m in linears.values())
    for case in ("image", "video"):
        out, ref = run(model, variant, case)
        err = rel_l2(out, ref)
        print(f"{variant} {qtype.name} {case}: out rel-L2 {err:.4e}")
        assert err <= TOLERANCE[qtype], f"{variant} {qtype.name} {case}: rel-L2 {err:.4e} > {TOLERANCE[qtype]}"


def test_gguf_error_is_the_quantization_alone(tmp_path):
    """The GGUF model equals a dense fp32 model holding the dequantized weights: per-layer dequantization adds
    nothing."""
    path = tmp_path / "q8.gguf"
    sd = write_gguf_dit(path, "3b", GT.Q8_0)
    model = load_dit(path, dtype=torch.float32)
    dense_sd = dict(sd)
    for name, m in model.named_modules():
        if isinstance(m, GGUFLinear):
            dense_sd[name + ".weight"] = dequantize(m.weight, m.qtype, (m.out_features, m.in_features), torch.float32)
    dense = load_dit(dense_sd)
    for case in ("image", "video"):
        got, _ = run(model, "3b", case)
        want, _ = run(dense, "3b", case)
        assert rel_l2(got, want) < 1e-6


def test_gguf_found_by_content_and_half_precision_default(tmp_path):
    """A GGUF file under a .safetensors name loads as GGUF; without ``dtype`` the model computes in bf16 (the
    file's F32 tensors are a converter's habit, not a precision choice)."""
    path = tmp_path / "q8.gguf"
    write_gguf_dit(path, "7b", GT.Q8_0)
    renamed = tmp_path / "seedvr2_ema_7b_q8.safetensors"
    shutil.copy(path, renamed)
    model = load_dit(renamed)
    assert isinstance(model.blocks[0].attn.proj_qkv.vid, GGUFLinear)
    assert model.run_dtype() == torch.bfloat16
    assert model.blocks[0].attn.norm_q.vid.weight.dtype == torch.bfloat16
    out, ref = run(model, "7b", "image")
    assert out.dtype == torch.bfloat16 and rel_l2(out.float(), ref) < 0.05


def test_gguf_keep_rule_loads_dense(tmp_path):
    path = tmp_path / "q8.gguf"
    write_gguf_dit(path, "3b", GT.Q8_0)
    model = load_dit(path, dtype=torch.float32, keep_high_precision=[r"\.mlp\."])
    assert isinstance(model.blocks[0].attn.proj_qkv.vid, GGUFLinear)
    mlp = model.blocks[0].mlp.vid.proj_in
    assert type(mlp) is torch.nn.Linear and mlp.weight.dtype == torch.float32


def test_damaged_gguf_names_file_and_fix(tmp_path):
    path = tmp_path / "q8.gguf"
    write_gguf_dit(path, "3b", GT.Q8_0)
    data = path.read_bytes()
    cut = tmp_path / "seedvr2_ema_3b-Q8_0.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFileError) as e:
        load_dit(cut)
    msg = str(e.value)
    assert "SeedVR2 DiT file seedvr2_ema_3b-Q8_0.gguf" in msg and "download it again" in msg, msg
