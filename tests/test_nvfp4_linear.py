"""NVFP4Linear / FP8Linear, the tensors handed to the FP4 / FP8 GEMMs (checked on CPU), replace_linears,
quantize_model_linears, keep rule."""
import pytest
import torch
import torch.nn.functional as F

from seedvr2bw.optimization.nvfp4 import checkpoint as ckpt
from seedvr2bw.optimization.nvfp4 import dispatch
from seedvr2bw.optimization.nvfp4 import format as fmt
from seedvr2bw.optimization.nvfp4 import surgery
from seedvr2bw.optimization.nvfp4.emulation import expected_output
from seedvr2bw.optimization.nvfp4.fp4_gemm import fp4_gemm_operands
from seedvr2bw.optimization.nvfp4.linear import FP8Linear, NVFP4Linear


def _layer(n, k, bias=True, seed=0, path="reference", input_scale=None):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g) if bias else None
    return NVFP4Linear.from_nvfp4(fmt.quantize_nvfp4(w, return_tensor=True), bias=b, path=path,
                                  input_scale=input_scale), w


def _u8(t):
    return t.view(torch.uint8)


@pytest.mark.parametrize("m,n,k", [(1, 32, 64), (100, 80, 96), (300, 256, 512), (129, 48, 80)])
@pytest.mark.parametrize("static", [False, True])
def test_fp4_gemm_operands_bit_exact(m, n, k, static):
    layer, _ = _layer(n, k, input_scale=torch.tensor(0.01) if static else None)
    x = torch.randn(m, k).to(torch.bfloat16)
    ops = fp4_gemm_operands(layer.padded_input(x.reshape(-1, k)), layer.nvfp4, layer.input_scale)
    kp = fmt.roundup(k, 16)
    # dtypes / shapes / numel the FP4 GEMM checks
    assert ops["a"].dtype == torch.uint8 and ops["a"].shape == (m, kp // 2)
    assert ops["a"].view(torch.float4_e2m1fn_x2).shape == (m, kp // 2)
    assert ops["scale_a"].dtype == torch.float8_e4m3fn
    assert ops["scale_a"].numel() == fmt.roundup(m, 128) * fmt.roundup(kp // 16, 4)
    assert ops["b"].shape == (fmt.roundup(n, 16), kp // 2) and ops["b"].is_contiguous()
    assert ops["scale_b"].numel() == fmt.roundup(fmt.roundup(n, 16), 128) * fmt.roundup(kp // 16, 4)
    assert ops["global_a"].dtype == torch.float32 and ops["global_a"].dim() == 0
    # bit-exact vs the reference quantizer (activation) and the stored weight
    g = torch.tensor(0.01) if static else fmt.global_scale_for(x)
    assert torch.equal(ops["global_a"], g.reshape(()))
    codes, s8 = fmt.quantize_nvfp4_codes(F.pad(x, (0, kp - k)), g)
    assert torch.equal(ops["a"], fmt.pack_fp4(codes))
    assert torch.equal(_u8(fmt.unswizzle_block_scales(ops["scale_a"], m, kp // 16)), _u8(s8))
    # padding of the swizzled scales is zero
    assert _u8(ops["scale_a"]).sum() == _u8(s8).sum()
    # the product of exactly these tensors equals the path's CPU emulation
    a = fmt.dequantize_nvfp4(ops["a"], ops["scale_a"], ops["global_a"], torch.float64)
    b = fmt.dequantize_nvfp4(ops["b"], ops["scale_b"], ops["global_b"], torch.float64)
    y = (a @ b.t())[:, :n] + layer.bias.double()
    want = expected_output(layer, x, "fp4_tensorcore")
    assert torch.allclose(y, want, rtol=1e-9, atol=1e-9)


def test_fp4_forward_hands_scaled_mm_the_documented_arguments(monkeypatch):
    layer, _ = _layer(80, 96, path="fp4_tensorcore")
    x = torch.randn(3, 7, 96).to(torch.bfloat16)
    seen = {}

    def fake_scaled_mm(mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, swizzle_a=None,
                       swizzle_b=None, bias=None, output_dtype=torch.bfloat16, **kw):
        seen.update(a=mat_a, b=mat_b, sa=scale_a, sb=scale_b, ra=scale_recipe_a, rb=scale_recipe_b, wa=swizzle_a,
                    wb=swizzle_b, out=output_dtype)
        a = fmt.dequantize_nvfp4(mat_a.view(torch.uint8), scale_a[0], scale_a[1], torch.float64)
        b = fmt.dequantize_nvfp4(mat_b.t().view(torch.uint8), scale_b[0], scale_b[1], torch.float64)
        return (a @ b.t()).to(output_dtype)

    monkeypatch.setattr(F, "scaled_mm", fake_scaled_mm, raising=False)
    y = layer.run_kernel("fp4_gemm", x.reshape(-1, 96))
    assert seen["a"].dtype == torch.float4_e2m1fn_x2 and seen["b"].dtype == torch.float4_e2m1fn_x2
    assert seen["b"].shape == (48, 80) and seen["b"].stride() == (1, 48)        # TN: B = W^T of a K-major [N,K/2]
    ST, SW = F.ScalingType, F.SwizzleType
    assert seen["ra"] == [ST.BlockWise1x16, ST.TensorWise] and seen["rb"] == [ST.BlockWise1x16, ST.TensorWise]
    assert seen["wa"] == [SW.SWIZZLE_32_4_4, SW.NO_SWIZZLE] and seen["wb"] == [SW.SWIZZLE_32_4_4, SW.NO_SWIZZLE]
    assert seen["sa"][0].dtype == torch.float8_e4m3fn and seen["sa"][0].dim() == 1
    assert seen["sa"][1].dim() == 0 and seen["sb"][1].dim() == 0
    want = expected_output(layer, x, "fp4_tensorcore").reshape(-1, 80)
    assert ((y.double() - want).norm() / want.norm()) < 1e-2


def test_fp8_forward_hands_scaled_mm_rowwise_arguments(monkeypatch):
    layer, _ = _layer(64, 128, path="fp8_speed")
    x = torch.randn(10, 128).to(torch.bfloat16)
    seen = {}

    def fake(a, b, scale_a, scale_b, out_dtype, bias=None, use_fast_accum=False):
        seen.update(a=a, b=b, sa=scale_a, sb=scale_b, out=out_dtype, bias=bias)
        y = (a.double() * scale_a.double()) @ (b.double() * scale_b.double())
        return (y + bias.double()).to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", fake)
    y = layer.run_kernel("fp8_rowwise", x)
    assert seen["a"].dtype == torch.float8_e4m3fn and seen["a"].shape == (10, 128)
    assert seen["b"].dtype == torch.float8_e4m3fn and seen["b"].shape == (128, 64) and seen["b"].stride() == (1, 128)
    assert seen["sa"].shape == (10, 1) and seen["sb"].shape == (1, 64) and seen["sa"].dtype == torch.float32
    want = expected_output(layer, x, "fp8_speed")
    assert ((y.double() - want).norm() / want.norm()) < 1e-2


def test_reference_path_and_shapes():
    layer, w = _layer(70, 96)
    x = torch.randn(2, 5, 96)
    y = layer(x)
    assert y.shape == (2, 5, 70)
    want = F.linear(x, layer.nvfp4.dequantize(), layer.bias.float())
    assert torch.allclose(y, want, atol=1e-5)
    # NVFP4's own error on a Gaussian weight
    assert 0.08 < ((layer.nvfp4.dequantize() - w).norm() / w.norm()).item() < 0.11


def test_path_resolution_and_overrides(monkeypatch):
    cpu = dispatch.Site(cuda=False)
    assert dispatch.decide("nvfp4", "auto", 1, cpu).path == "reference"
    assert dispatch.decide("nvfp4", "fidelity", 1, cpu).path == "reference"
    with pytest.raises(ValueError):
        dispatch.decide("nvfp4", "nope", 1, cpu)
    layer, _ = _layer(32, 64, path="fidelity")
    assert layer.decision(torch.zeros(3, 64)).path == "reference"


def test_state_dict_is_comfyui_format_and_roundtrips():
    layer, _ = _layer(70, 96, input_scale=torch.tensor(0.02))
    sd = layer.state_dict()
    assert sd["weight"].dtype == torch.uint8 and sd["weight"].shape == (80, 48)
    assert sd["weight_scale"].dtype == torch.float8_e4m3fn and sd["weight_scale"].shape == (128, 8)
    assert sd["weight_scale_2"].shape == () and sd["input_scale"].shape == ()
    assert ckpt.read_comfy_quant(sd["comfy_quant"])["format"] == "nvfp4"
    other = NVFP4Linear(96, 70)
    other.load_state_dict(sd)
    assert torch.equal(other.weight, layer.weight) and other.input_scale.item() == pytest.approx(0.02)


class Block(torch.nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.attn_qkv = torch.nn.Linear(d, 3 * d)
        self.attn_out = torch.nn.Linear(d, d, bias=False)
        self.mlp_in = torch.nn.Linear(d, 4 * d)
        self.mlp_out = torch.nn.Linear(4 * d, d)
        self.ada = torch.nn.Linear(d, 6 * d)
        self.odd = torch.nn.Linear(40, d)        # K % 16 != 0 -> always kept

    def forward(self, x):
        h = self.norm(x)
        h = self.attn_out(self.attn_qkv(h)[..., :64])
        return self.mlp_out(torch.relu(self.mlp_in(h))) + self.ada(x)[..., :64]


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.vid_in = torch.nn.Linear(32, 64)
        self.emb_in = torch.nn.Linear(64, 64)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.vid_out = torch.nn.Linear(64, 32)

    def forward(self, x):
        h = self.vid_in(x) + self.emb_in(torch.ones(64))
        for b in self.blocks:
            h = b(h)
        return self.vid_out(h)


def test_default_keep_rule_names():
    rule = surgery.make_keep_rule()
    lin = torch.nn.Linear(64, 64)
    kept = ["vid_in.proj", "vid_out.proj", "txt_in", "emb_in.proj_hid", "blocks.3.ada.vid", "x_embedder",
            "double_blocks.0.img_mod.lin", "single_blocks.2.modulation.lin", "final_layer.linear",
            "time_in.in_layer", "guidance_in.out_layer", "blocks.0.norm_q", "img_in", "pos_embed.proj",
            "blocks.1.adaLN_modulation.1"]
    quant = ["blocks.0.attn.proj_qkv.vid", "blocks.0.mlp.vid.proj_out", "blocks.0.mlp.txt.proj_in_gate",
             "double_blocks.0.img_attn.qkv", "double_blocks.0.txt_mlp.0", "single_blocks.0.linear1",
             "blocks.0.attn.proj_out.vid", "model.diffusion_model.blocks.0.mlp.vid.proj_in"]
    for n in kept:
        assert rule(n, lin), n
    for n in quant:
        assert not rule(n, lin), n
    assert rule("blocks.0.mlp.x", torch.nn.Linear(40, 64))           # K % 16
    custom = surgery.make_keep_rule([r"mlp_out"])
    assert custom("blocks.0.mlp_out", lin) and not custom("vid_in", lin)


def test_quantize_model_linears_and_state_dict_roundtrip():
    torch.manual_seed(0)
    model = Toy()
    x = torch.randn(4, 32)
    ref = model(x)
    report = surgery.quantize_model_linears(model)
    assert set(report["kept"]) == {"vid_in", "emb_in", "vid_out", "blocks.0.ada", "blocks.1.ada",
                                   "blocks.0.odd", "blocks.1.odd"}
    assert "blocks.0.mlp_in" in report["quantized"] and isinstance(model.blocks[0].mlp_in, NVFP4Linear)
    y = model(x)
    assert ((y - ref).norm() / ref.norm()).item() < 0.2
    sd = model.state_dict()
    assert ckpt.detect_layer_format(sd, "blocks.0.mlp_in") == "nvfp4"
    # a fresh bf16 model gets the same layers back from the state dict
    fresh = Toy()
    rep = surgery.replace_linears(fresh, sd, path="reference", load_rest=True, dtype=torch.float32)
    assert set(rep["nvfp4"]) == set(report["quantized"])
    assert torch.equal(fresh.blocks[1].mlp_out.weight, model.blocks[1].mlp_out.weight)
    assert torch.allclose(fresh(x), y, atol=1e-5)


def test_replace_linears_mixed_formats_and_keep():
    torch.manual_seed(1)
    src = Toy()
    sd = {k: v.detach().clone() for k, v in src.state_dict().items()}
    # blocks.0.mlp_in -> NVFP4 (ComfyUI format), blocks.0.mlp_out -> FP8, blocks.0.ada -> NVFP4 but kept
    t = fmt.quantize_nvfp4(sd.pop("blocks.0.mlp_in.weight"), return_tensor=True)
    sd.update(ckpt.nvfp4_layer_entries("blocks.0.mlp_in", t, bias=sd.pop("blocks.0.mlp_in.bias")))
    w8, s = fmt.quantize_fp8_per_tensor(sd.pop("blocks.0.mlp_out.weight"))
    sd.update(ckpt.fp8_layer_entries("blocks.0.mlp_out", w8, s, bias=sd.pop("blocks.0.mlp_out.bias")))
    ta = fmt.quantize_nvfp4(sd.pop("blocks.0.ada.weight"), return_tensor=True)
    sd.update(ckpt.nvfp4_layer_entries("blocks.0.ada", ta, bias=sd.pop("blocks.0.ada.bias")))
    model = Toy()
    rep = surgery.replace_linears(model, sd, dtype=torch.float32, load_rest=True,
                            keep_high_precision="default")
    assert rep["nvfp4"] == ["blocks.0.mlp_in"] and rep["fp8"] == ["blocks.0.mlp_out"]
    assert rep["kept"] == ["blocks.0.ada"] and not rep["missing"]
    assert isinstance(model.blocks[0].mlp_in, NVFP4Linear) and isinstance(model.blocks[0].mlp_out, FP8Linear)
    assert model.blocks[0].mlp_out.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(model.blocks[0].ada.weight, ta.dequantize())
    assert torch.equal(model.blocks[1].mlp_in.weight, src.blocks[1].mlp_in.weight)
    x = torch.randn(3, 32)
    assert ((model(x) - src(x)).norm() / src(x).norm()).item() < 0.2


def test_fp8_linear_cast_mode():
    lin = torch.nn.Linear(64, 32)
    m = FP8Linear.from_linear(lin, dtype=torch.float32)
    x = torch.randn(5, 64)
    w = m.weight.float() * m.weight_scale
    assert torch.allclose(m(x), F.linear(x, w, m.bias), atol=1e-6)
    assert m.weight.dtype == torch.float8_e4m3fn
    sd = m.state_dict()
    assert ckpt.read_comfy_quant(sd["comfy_quant"]) == {"format": "float8_e4m3fn"}
    m2 = FP8Linear(64, 32, dtype=torch.float32)
    m2.load_state_dict(sd)
    assert torch.equal(m2(x), m(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("per_row", [False, True])
def test_fp8_dequantize_into_a_shared_buffer_is_bit_identical(dtype, per_row):
    """The cast path on CUDA dequantizes into the device's one scratch buffer (no per-call weight copies to fragment
    a tight budget): the same bits as a fresh tensor, whatever the buffer held before."""
    m = FP8Linear.from_linear(torch.nn.Linear(64, 48), dtype=dtype)
    if per_row:
        m.weight_scale = torch.rand(48) + 0.5
    buf = torch.full((48, 64), float("nan"), dtype=dtype)
    got = m.dequantize_weight(dtype, out=buf)
    assert got.data_ptr() == buf.data_ptr()
    assert torch.equal(got, m.dequantize_weight(dtype))
    # what the plan counts: a bf16 [N, K] buffer on CUDA in cast mode, nothing on the CPU or for scaled_mm
    assert m.scratch_bytes("cuda") == 2 * 48 * 64 and m.scratch_bytes("cpu") == 0
    m.mode = "scaled_mm"
    assert m.scratch_bytes("cuda") == 0
    # off CUDA (and whenever autograd keeps the weight) the layer takes a fresh buffer
    assert m.scratch_weight(torch.randn(2, 64), dtype) is None
