"""ComfyUI's other quantized layouts: ``mxfp8`` (TensorCoreMXFP8Layout) and ``int8_tensorwise`` with ConvRot
(TensorWiseINT8Layout), bit-exact with comfy-kitchen on CPU; the kernel decision for them; the converter's MXFP8
output read back.

Compared with comfy-kitchen's eager backend where it imports, and always with the bytes it produced once
(tests/data/ck_reference.safetensors, tests/make_ck_reference.py). The DiT-level checks are in
tests/test_dit_comfy_layouts.py.
"""
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import DATA
from seedvr2bw.optimization.nvfp4 import checkpoint as ckpt
from seedvr2bw.optimization.nvfp4 import dispatch
from seedvr2bw.optimization.nvfp4 import int8 as I8
from seedvr2bw.optimization.nvfp4 import mxfp8 as MX
from seedvr2bw.optimization.nvfp4.convert import convert_file
from seedvr2bw.optimization.nvfp4.surgery import replace_linears
from seedvr2bw.optimization.runtime import device, policy

from nvfp4_refs import comfy_kitchen, needs_ck
from test_nvfp4_dispatch import site_for

REF = load_file(DATA / "ck_reference.safetensors")
MX_CASES = sorted({k.split(".")[1] for k in REF if k.startswith("mxfp8.")})
INT8_CASES = sorted({k.split(".")[1] for k in REF if k.startswith("int8.")})


def _u8(t):
    return t.view(torch.uint8)


def _group(name):
    return int(name.rsplit("_g", 1)[1])


# ---------------------------------------------------------------- MXFP8 format
@pytest.mark.parametrize("name", MX_CASES)
def test_mxfp8_quantize_matches_comfy_kitchen_bytes(name):
    q, s = MX.quantize_mxfp8(REF[f"mxfp8.{name}.x"])
    assert torch.equal(_u8(q), REF[f"mxfp8.{name}.qdata"]) and torch.equal(s, REF[f"mxfp8.{name}.scale"]), name


@pytest.mark.parametrize("name", MX_CASES)
def test_mxfp8_dequantize_is_exact(name):
    x = REF[f"mxfp8.{name}.x"]
    q, s = MX.quantize_mxfp8(x)
    d = MX.dequantize_mxfp8(q, s, shape=tuple(x.shape))
    e = MX.block_exponents(s, *q.shape).to(torch.int32)
    want = q.float().reshape(q.shape[0], -1, 32) * torch.exp2(e.float() - 127).unsqueeze(-1)
    assert torch.equal(d, want.reshape(q.shape)[: x.shape[0], : x.shape[1]])
    assert torch.equal(MX.dequantize_mxfp8(q, s, torch.bfloat16).float(), MX.dequantize_mxfp8(q, s))  # exact in bf16
    # the quantization error: at most half an E4M3 step (2^-4 relative) of each block's largest value
    err = (d - x.float()).abs().reshape(x.shape[0], -1, 32) if x.shape[1] % 32 == 0 else None
    if err is not None:
        amax = x.float().abs().reshape(x.shape[0], -1, 32).amax(-1, keepdim=True)
        assert bool((err <= amax * 2 ** -4 + 1e-30).all())


@needs_ck
@pytest.mark.parametrize("name", MX_CASES)
def test_mxfp8_matches_installed_comfy_kitchen(name):
    from comfy_kitchen.tensor import QuantizedTensor, get_layout_class
    x = REF[f"mxfp8.{name}.x"]
    with comfy_kitchen.registry.use_backend("eager"):
        qdata, scale = get_layout_class("TensorCoreMXFP8Layout").get_plain_tensors(
            QuantizedTensor.from_float(x, "TensorCoreMXFP8Layout"))
        theirs = comfy_kitchen.dequantize_mxfp8(qdata, scale, torch.float32)
    q, s = MX.quantize_mxfp8(x)
    assert torch.equal(_u8(q), _u8(qdata)) and torch.equal(s, _u8(scale))
    assert torch.equal(MX.dequantize_mxfp8(q, s), theirs)


def test_e8m0_zero_block_and_extremes():
    w = torch.zeros(32, 64)
    w[0, :32] = 448.0 * 2.0 ** 10          # an exact power of two times 448 keeps its exponent (no clamp)
    w[1, 32:] = 1e-3
    q, s = MX.quantize_mxfp8(w)
    e = MX.block_exponents(s, 32, 64)
    assert e[0, 0] == 127 + 10 and e[2, 0] == 0 and e[0, 1] == 0            # zero blocks store exponent 0
    assert torch.equal(MX.dequantize_mxfp8(q, s)[0, :32], w[0, :32])


def test_mxfp8_fp8_rowwise_weight_is_exact_for_close_block_scales():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 256, generator=g) * 0.02                           # block scales within 2-3 octaves
    q, s = MX.quantize_mxfp8(w)
    w8, rs = MX.mxfp8_to_fp8_rowwise(q, s, (64, 256))
    exact = MX.dequantize_mxfp8(q, s)
    got = w8.float() * rs.reshape(-1, 1)
    # measured: 99.99% of the elements exact (max error 3e-6 of the amax); the rest fell below E4M3's subnormals
    same = (got == exact).float().mean().item()
    assert same > 0.99, same
    assert (got - exact).abs().max() <= exact.abs().amax() * 2 ** -9


# ---------------------------------------------------------------- INT8 ConvRot format
def test_hadamard_is_symmetric_orthogonal_and_checks_its_size():
    for n in (4, 16, 64, 256):
        h = I8.hadamard(n)
        assert torch.equal(h, h.t()) and torch.allclose(h @ h, torch.eye(n), atol=1e-6)
        assert set((h * n ** 0.5).round().unique().tolist()) == {-1.0, 1.0}
    with pytest.raises(ValueError, match="power of 4"):
        I8.hadamard(128)


@pytest.mark.parametrize("name", INT8_CASES)
def test_int8_convrot_matches_comfy_kitchen_bytes(name):
    q, s = I8.quantize_int8_convrot(REF[f"int8.{name}.w"], _group(name))
    assert torch.equal(q, REF[f"int8.{name}.qdata"]) and torch.equal(s, REF[f"int8.{name}.scale"])
    y = I8.int8_linear(REF[f"int8.{name}.x"], q, s, None, _group(name))
    assert y.dtype == REF[f"int8.{name}.y"].dtype and torch.equal(y, REF[f"int8.{name}.y"]), name


@needs_ck
@pytest.mark.parametrize("name", INT8_CASES)
def test_int8_convrot_matches_installed_comfy_kitchen(name):
    from comfy_kitchen.tensor import QuantizedTensor, get_layout_class
    w, x, g = REF[f"int8.{name}.w"], REF[f"int8.{name}.x"], _group(name)
    bias = torch.randn(w.shape[0]).to(x.dtype)
    with comfy_kitchen.registry.use_backend("eager"):
        qt = QuantizedTensor.from_float(w, "TensorWiseINT8Layout", is_weight=True, per_channel=True, convrot=True,
                                        convrot_groupsize=g)
        qdata, scale = get_layout_class("TensorWiseINT8Layout").get_plain_tensors(qt)
        y_ck = comfy_kitchen.int8_linear(x, qdata, scale, bias, x.dtype, convrot=True, convrot_groupsize=g)
        w_ck = qt.dequantize()
    q, s = I8.quantize_int8_convrot(w, g)
    assert torch.equal(q, qdata) and torch.equal(s, scale)
    assert torch.equal(I8.int8_linear(x, q, s, bias, g), y_ck)
    assert torch.allclose(I8.dequantize_int8(q, s, g, w.dtype).float(), w_ck.float(), rtol=2 ** -7, atol=1e-7)


def test_int8_layer_round_trips_comfyui_keys():
    lin = torch.nn.Linear(128, 24)
    layer = I8.Int8Linear.from_linear(lin, convrot_group=64, dtype=torch.float32)
    sd = layer.state_dict()
    assert ckpt.read_comfy_quant(sd["comfy_quant"]) == {"format": "int8_tensorwise", "convrot": True,
                                                        "convrot_groupsize": 64}
    assert sd["weight"].dtype == torch.int8 and tuple(sd["weight_scale"].shape) == (24, 1)
    model = torch.nn.Sequential(torch.nn.Linear(128, 24))
    report = replace_linears(model, {f"0.{k}": v for k, v in sd.items()}, dtype=torch.float32)
    assert report["int8"] == ["0"] and isinstance(model[0], I8.Int8Linear) and model[0].convrot_group == 64
    x = torch.randn(5, 128)
    assert torch.equal(model[0](x), layer(x))
    rel = ((layer(x) - lin(x)).norm() / lin(x).norm()).item()
    assert rel < 0.02, rel                       # int8 weight and activations: ~0.5% here


def test_int8_convrot_keys_under_params_are_read():
    assert ckpt.int8_convrot_group({"format": "int8_tensorwise", "params": {"convrot": True}}) == 256
    assert ckpt.int8_convrot_group({"format": "int8_tensorwise"}) is None


# ---------------------------------------------------------------- which kernel
@pytest.mark.parametrize("profile,want", [("cpu", "reference"), ("ampere", "mxfp8_dequant"),
                                          ("ada", "mxfp8_fp8_rowwise"), ("hopper", "mxfp8_fp8_rowwise"),
                                          ("blackwell_consumer", "mxfp8_fp8_rowwise")])
def test_mxfp8_kernel_follows_the_policy(profile, want):
    fp8 = profile in ("ada", "hopper", "blackwell_consumer")
    d = dispatch.decide("mxfp8", "auto", 4096, site_for(profile, fp8=lambda: fp8))
    assert d.kernel == want and d.kernel in dispatch.KERNEL_DOC, (profile, d)
    fidelity = site_for(profile, fp8=lambda: fp8, policy_path=lambda: "fidelity")
    if profile != "cpu":
        assert dispatch.decide("mxfp8", "auto", 8, fidelity).kernel == "mxfp8_dequant"
        assert dispatch.decide("mxfp8", "fp8", 8, site_for(profile, fp8=lambda: fp8, dims16=False)).kernel == \
            "mxfp8_dequant"
    with pytest.raises(ValueError, match="MXFP8 path"):
        dispatch.decide("mxfp8", "fast", 8, site_for(profile))


def test_int8_kernel_choice():
    """torch._int_mm where its self-test passed and the features are multiples of 8 (between the fused Triton
    kernels where they pass theirs, else torch ops), else the float64 reference, each with its reason; a bad request
    names the choices."""
    d = dispatch.decide("int8", "auto", 4096, site_for("hopper", int_mm=lambda: True, int8_fused=lambda: (True, "")))
    assert (d.path, d.kernel) == ("int_mm", "int8_int_mm") and "works here" in d.reason
    d = dispatch.decide("int8", "auto", 4096, site_for("hopper", int_mm=lambda: True,
                                                       int8_fused=lambda: (False, "failed their self-test: boom")))
    assert (d.path, d.kernel) == ("int_mm", "int8_int_mm_eager") and "works here; failed their self-test" in d.reason
    d = dispatch.decide("int8", "auto", 4096, site_for("cpu", int_mm=lambda: True, int8_fused=lambda: (True, "")))
    assert (d.path, d.kernel) == ("int_mm", "int8_int_mm_eager") and "not a CUDA device" in d.reason
    d = dispatch.decide("int8", "auto", 4096, site_for("hopper", int_mm=lambda: True, triton=False))
    assert d.kernel == "int8_int_mm_eager" and "no Triton" in d.reason
    for profile in ("cpu", "hopper"):
        d = dispatch.decide("int8", "auto", 4096, site_for(profile, int_mm=lambda: False))
        assert d.kernel == "int8_reference" and "failed its self-test" in d.reason
        d = dispatch.decide("int8", "int_mm", 8, site_for(profile, int_mm=lambda: True, dims8=False))
        assert d.kernel == "int8_reference" and "multiples of 8" in d.reason
        assert dispatch.decide("int8", "reference", 8, site_for(profile, int_mm=lambda: True)).kernel == \
            "int8_reference"
    with pytest.raises(ValueError, match="INT8 path"):
        dispatch.decide("int8", "fast", 8, site_for("cpu"))
    assert all(k in dispatch.KERNEL_DOC for k in ("int8_int_mm", "int8_int_mm_eager", "int8_reference"))
    info = device.DeviceInfo(type="cuda", index=0, name="H100", capability=(9, 0), arch_list=("sm_90a",))
    pol = policy.decide(info, selftests={"nvfp4": lambda p, i: (True, "ok"), "fp8": lambda f, i: (True, "ok")})
    line = next(line for line in pol.kernel_table() if line.strip().startswith("int8 auto"))
    assert line.endswith("all M: int8_int_mm"), line
    assert any(line.strip().startswith("mxfp8 auto") for line in dispatch.kernel_table(site_for("hopper")))


@pytest.mark.parametrize("m", [1, 16, 17, 300])
def test_int_mm_equals_the_exact_integer_product(m):
    """torch._int_mm's int32 sums equal the float64 reference's, for few rows (padded) and many; at the extremes of
    int8 the sums reach K * 128 * 128."""
    g = torch.Generator().manual_seed(m)
    a = torch.randint(-128, 128, (m, 512), generator=g, dtype=torch.int8)
    b = torch.randint(-128, 128, (72, 512), generator=g, dtype=torch.int8)
    a[0], b[0] = -128, -128
    assert torch.equal(I8.int_mm(a, b), I8.int_matmul(a, b))
    assert I8.int_mm_selftest("cpu") == (True, "")


def test_int8_layer_on_int_mm_is_bit_identical_to_the_reference():
    """The layer takes torch._int_mm where it works (here: the CPU, with the other steps as torch ops) and its
    output equals the reference bit for bit."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(512, 72).to(torch.bfloat16)
    layer = I8.Int8Linear.from_linear(lin, convrot_group=256)
    x = torch.randn(3, 40, 512).to(torch.bfloat16)
    assert layer.decision(x.reshape(-1, 512)).kernel == "int8_int_mm_eager"
    y = layer(x)
    want = I8.int8_linear(x.reshape(-1, 512), layer.weight, layer.weight_scale, layer.bias, 256).reshape(3, 40, 72)
    assert torch.equal(y, want)
    layer.path = "reference"
    assert torch.equal(layer(x), want)


def test_int_mm_selftest_failure_is_reported(monkeypatch):
    def broken(a, b):
        raise RuntimeError("_int_mm_out_cuda not supported on this GPU")
    monkeypatch.setattr(torch, "_int_mm", broken)
    ok, why = I8.int_mm_selftest("cpu")
    assert not ok and "not supported" in why
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: torch.zeros(a.shape[0], b.shape[1], dtype=torch.int32))
    ok, why = I8.int_mm_selftest("cpu")
    assert not ok and "differs" in why


# ---------------------------------------------------------------- the converter writes MXFP8
def test_converter_writes_mxfp8_that_loads_back(tmp_path):
    g = torch.Generator().manual_seed(5)
    src, dst = tmp_path / "src.safetensors", tmp_path / "dst.safetensors"
    sd = {"blocks.0.attn.proj.weight": (torch.randn(96, 64, generator=g) * 0.02).bfloat16(),
          "blocks.0.attn.proj.bias": torch.randn(96, generator=g).bfloat16(),
          "blocks.0.mlp.out.weight": torch.randn(40, 48, generator=g).half(),       # padded to 64 x 64
          "blocks.0.norm.weight": torch.ones(64), "vid_in.proj.weight": torch.randn(64, 32, generator=g)}
    save_file(sd, str(src))
    summary = convert_file(str(src), str(dst), target="mxfp8")
    assert sorted(summary.quantized) == ["blocks.0.attn.proj", "blocks.0.mlp.out"] and summary.kept == ["vid_in.proj"]
    with safe_open(str(dst), framework="pt") as f:
        out = {k: f.get_tensor(k) for k in f.keys()}
        assert ckpt.json.loads(f.metadata()["_quantization_metadata"])["layers"]["blocks.0.mlp.out"] == \
            {"format": "mxfp8"}
    assert ckpt.read_comfy_quant(out["blocks.0.mlp.out.comfy_quant"]) == {"format": "mxfp8"}
    assert out["blocks.0.mlp.out.weight"].dtype == torch.float8_e4m3fn
    assert tuple(out["blocks.0.mlp.out.weight"].shape) == (64, 64)
    assert out["blocks.0.mlp.out.weight_scale"].dtype == torch.uint8                # what ComfyUI 0.19.3 reads
    for layer, shape in (("blocks.0.attn.proj", (96, 64)), ("blocks.0.mlp.out", (40, 48))):
        q, s = MX.quantize_mxfp8(sd[f"{layer}.weight"])
        assert torch.equal(_u8(out[f"{layer}.weight"]), _u8(q)) and torch.equal(out[f"{layer}.weight_scale"], s)
    model = torch.nn.ModuleDict({"attn": torch.nn.Linear(64, 96), "out": torch.nn.Linear(48, 40, bias=False)})
    remap = {k.replace("blocks.0.attn.proj", "attn").replace("blocks.0.mlp.out", "out"): v for k, v in out.items()}
    report = replace_linears(model, remap, dtype=torch.float32)
    assert sorted(report["mxfp8"]) == ["attn", "out"] and isinstance(model["out"], MX.MXFP8Linear)
    want = MX.dequantize_mxfp8(*MX.quantize_mxfp8(sd["blocks.0.mlp.out.weight"]), shape=(40, 48))
    assert torch.equal(model["out"].dequantize_weight(), want)
    x = torch.randn(3, 48)
    assert torch.equal(model["out"](x), torch.nn.functional.linear(x, want))
    assert model["out"].derived_bytes("cpu") == 0              # the FP8 copy exists only where the FP8 GEMM runs
    if comfy_kitchen is not None:             # ComfyUI's layout reads the same weights from our tensors
        theirs = comfy_kitchen.dequantize_mxfp8(out["blocks.0.mlp.out.weight"],
                                                out["blocks.0.mlp.out.weight_scale"].view(torch.float8_e8m0fnu),
                                                torch.float32)
        assert torch.equal(theirs[:40, :48], want)


def test_unknown_comfy_quant_format_names_the_layer():
    sd = {"0.weight": torch.zeros(8, 16, dtype=torch.int8), "0.weight_scale": torch.ones(8, 1),
          "0.comfy_quant": ckpt.comfy_quant_tensor({"format": "convrot_w4a4"})}
    with pytest.raises(ValueError, match=r"0: quantization format 'convrot_w4a4'.*not one this pack loads"):
        replace_linears(torch.nn.Sequential(torch.nn.Linear(16, 8)), sd)

