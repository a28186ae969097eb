"""GGUF: reader (memory-mapped, shapes, metadata), torch dequantization bit-exact with the `gguf` package's numpy
reference, GGUFLinear and model surgery, error messages.

Needs the `gguf` package (requirements-test.txt pins it; PyPI `gguf`): it writes the test files
(``gguf.GGUFWriter``), quantizes real data (``gguf.quants.quantize``) and is the reference
(``gguf.quants.dequantize``, numpy, float32).
"""
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

gguf = pytest.importorskip("gguf")

from seedvr2bw.optimization.gguf import (GGUFError, GGUFLinear, GGUFPackageMissing, GGUFTensor, QType,  # noqa: E402
                                         dequantize, read_gguf, replace_with_gguf_linears)
from seedvr2bw.optimization.gguf import dequant as D  # noqa: E402
from seedvr2bw.optimization.gguf.format import QUANT_SIZES, QUANTIZED_QTYPES, SUPPORTED_QTYPES  # noqa: E402

GT = gguf.GGMLQuantizationType

# byte offsets of each type's fp16 scale fields inside a block (the rest of a block is integer data: any bytes)
F16_FIELDS = {
    QType.Q8_0: (0,), QType.Q4_0: (0,), QType.Q4_1: (0, 2), QType.Q5_0: (0,), QType.Q5_1: (0, 2),
    QType.Q2_K: (80, 82), QType.Q3_K: (108,), QType.Q4_K: (0, 2), QType.Q5_K: (0, 2), QType.Q6_K: (208,),
}
# types gguf.quants can quantize (the K-quants it only dequantizes)
QUANTIZABLE = (QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1)


def random_blocks(qtype, n_blocks, seed=0):
    """Random block bytes with finite fp16 scales (random small values, plus 0, -0, subnormal and +-max)."""
    rng = np.random.default_rng(seed)
    _, size = QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    special = np.array([0.0, -0.0, 6e-8, -3e-5, 65504.0, -65504.0], dtype=np.float16)
    for at in F16_FIELDS[qtype]:
        scale = (rng.standard_normal(n_blocks) * 0.01).astype(np.float16)
        k = min(len(special), n_blocks)
        scale[:k] = special[:k]
        rng.shuffle(scale)
        raw[:, at:at + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return raw


def reference(raw: np.ndarray, qtype, shape) -> torch.Tensor:
    """``gguf.quants.dequantize`` (float32, numpy) as a torch tensor of ``shape``."""
    out = gguf.quants.dequantize(raw, GT(int(qtype)))
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(shape)


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor):
    assert got.dtype == want.dtype and got.shape == want.shape
    int_view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[got.dtype]
    same = got.view(int_view) == want.view(int_view)
    if not bool(same.all()):
        i = int((~same).reshape(-1).nonzero()[0])
        raise AssertionError(f"{int((~same).sum())} values differ, first at flat {i}: "
                             f"{got.reshape(-1)[i].item()!r} vs {want.reshape(-1)[i].item()!r}")


# ---------------------------------------------------------------------------------------------------- (a) dequant

def test_type_table_matches_gguf():
    for q in SUPPORTED_QTYPES:
        assert GT(int(q)).name == q.name
        if q in QUANT_SIZES:
            assert gguf.GGML_QUANT_SIZES[GT(int(q))] == QUANT_SIZES[q]


@pytest.mark.parametrize("qtype", QUANTIZED_QTYPES, ids=lambda q: q.name)
def test_random_blocks_bit_exact(qtype):
    block, _ = QUANT_SIZES[qtype]
    raw = random_blocks(qtype, 96, seed=int(qtype))
    shape = (12, 8 * block)  # 12 rows of 8 blocks
    want = reference(raw.reshape(12, -1), qtype, shape)
    assert torch.isfinite(want).all()
    got = dequantize(torch.from_numpy(raw), qtype, shape, dtype=torch.float32)
    assert_bits_equal(got, want)
    # the cast happens after the exact float32 values (one rounding)
    for dtype in (torch.bfloat16, torch.float16):
        assert_bits_equal(dequantize(torch.from_numpy(raw), qtype, shape, dtype=dtype), want.to(dtype))


@pytest.mark.parametrize("qtype", QUANTIZED_QTYPES, ids=lambda q: q.name)
def test_chunked_path_bit_exact(qtype, monkeypatch):
    """Tensors of more than CHUNK_ELEMENTS elements are decoded chunk by chunk into the output."""
    block, _ = QUANT_SIZES[qtype]
    raw = random_blocks(qtype, 37, seed=100 + int(qtype))
    shape = (37 * block,)
    want = reference(raw, qtype, shape)
    monkeypatch.setattr(D, "CHUNK_ELEMENTS", 5 * block)  # 8 chunks, the last one partial
    for dtype in (torch.float32, torch.bfloat16):
        assert_bits_equal(dequantize(torch.from_numpy(raw), qtype, shape, dtype=dtype), want.to(dtype))


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda q: q.name)
def test_quantized_real_data_bit_exact(qtype):
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((64, 256)) * 0.05).astype(np.float32)
    w[3] = 0.0  # all-zero blocks (scale 0)
    w[5, :32] = np.linspace(-1, 1, 32, dtype=np.float32)
    raw = gguf.quants.quantize(w, GT(int(qtype)))
    assert raw.dtype == np.uint8 and raw.shape == (64, 256 // 32 * QUANT_SIZES[qtype][1])
    want = reference(raw, qtype, w.shape)
    got = dequantize(torch.from_numpy(raw), qtype, w.shape, dtype=torch.float32)
    assert_bits_equal(got, want)
    # and it is a quantization of w: within one step of each block's range (so the layout is read right)
    err = (got - torch.from_numpy(w)).abs().reshape(-1, 32)
    amax = torch.from_numpy(w).abs().reshape(-1, 32).amax(dim=1, keepdim=True)
    step = {QType.Q8_0: 1 / 127, QType.Q4_0: 1 / 8, QType.Q4_1: 2 / 15, QType.Q5_0: 1 / 16, QType.Q5_1: 2 / 31}
    assert (err <= amax * step[qtype] + 1e-7).all()


@pytest.mark.parametrize("qtype", (QType.F32, QType.F16, QType.BF16), ids=lambda q: q.name)
def test_plain_types_passthrough(qtype):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    if qtype == QType.BF16:
        stored = gguf.quants.quantize(w, GT.BF16)  # uint8 bytes, as a GGUF file holds them
        want = reference(stored, qtype, w.shape)
    else:
        stored = w.astype(np.float16) if qtype == QType.F16 else w
        want = torch.from_numpy(stored.astype(np.float32))
    got = dequantize(torch.from_numpy(np.ascontiguousarray(stored)).view(torch.uint8).reshape(-1), qtype, w.shape,
                     dtype=torch.float32)
    assert_bits_equal(got, want)


def test_dequantize_follows_device_meta():
    """The decoders are plain torch ops: they run wherever the bytes are (meta here; CUDA on a GPU machine)."""
    raw = torch.from_numpy(random_blocks(QType.Q4_K, 4)).to("meta")
    out = dequantize(raw, QType.Q4_K, (4, 256), dtype=torch.bfloat16)
    assert out.device.type == "meta" and out.shape == (4, 256) and out.dtype == torch.bfloat16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("qtype", QUANTIZED_QTYPES, ids=lambda q: q.name)
def test_cuda_bit_exact(qtype):
    raw = random_blocks(qtype, 64, seed=int(qtype))
    shape = (64 * QUANT_SIZES[qtype][0],)
    got = dequantize(torch.from_numpy(raw).cuda(), qtype, shape, dtype=torch.float32).cpu()
    assert_bits_equal(got, reference(raw, qtype, shape))


# ---------------------------------------------------------------------------------------------------- (b) reader

def write_gguf(path, tensors, kv=None, arch="seedvr2"):
    """Write a GGUF file: ``tensors`` maps name -> (numpy array, raw_dtype or None)."""
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in (kv or {}).items():
        if isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, (list, tuple)):
            w.add_array(k, list(v))
        else:
            w.add_uint32(k, v)
    for name, (arr, raw_dtype) in tensors.items():
        w.add_tensor(name, arr, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture()
def mixed_file(tmp_path):
    rng = np.random.default_rng(11)
    w_q8 = (rng.standard_normal((48, 64)) * 0.1).astype(np.float32)
    q4k = random_blocks(QType.Q4_K, 8 * 2, seed=5).reshape(8, -1)  # torch shape (8, 512)
    flat = random_blocks(QType.Q6_K, 3, seed=6).reshape(3, -1)      # stored (3, 256), really (8, 96)
    data = {
        "blocks.0.proj.weight": (gguf.quants.quantize(w_q8, GT.Q8_0), GT.Q8_0),
        "blocks.0.mlp.weight": (q4k, GT.Q4_K),
        "blocks.0.reshaped.weight": (flat, GT.Q6_K),
        "emb.weight": (rng.standard_normal((10, 64)).astype(np.float16), None),
        "norm.weight": (rng.standard_normal(64).astype(np.float32), None),
        "cube": (np.arange(24, dtype=np.float32).reshape(2, 3, 4), None),
        "bf.weight": (gguf.quants.quantize(rng.standard_normal((4, 32)).astype(np.float32), GT.BF16), GT.BF16),
    }
    kv = {"seedvr2.note": "test file", "seedvr2.blocks": 1,
          "comfy.gguf.orig_shape.blocks.0.reshaped.weight": [8, 96]}
    path = write_gguf(tmp_path / "mixed.gguf", data, kv)
    return path, data, w_q8


def test_reader_round_trip(mixed_file):
    path, data, w_q8 = mixed_file
    tensors, meta = read_gguf(path)
    assert set(tensors) == set(data)
    assert meta["general.architecture"] == "seedvr2"
    assert meta["seedvr2.note"] == "test file" and meta["seedvr2.blocks"] == 1

    q8 = tensors["blocks.0.proj.weight"]
    assert isinstance(q8, GGUFTensor) and q8.qtype == QType.Q8_0 and q8.shape == (48, 64)
    assert q8.raw.dtype == torch.uint8 and q8.nbytes == 48 * 2 * 34
    assert np.array_equal(q8.raw.numpy(), data["blocks.0.proj.weight"][0])
    assert_bits_equal(q8.dequantize(torch.float32), reference(data["blocks.0.proj.weight"][0], QType.Q8_0, (48, 64)))
    assert (q8.dequantize(torch.float32) - torch.from_numpy(w_q8)).abs().max() < 0.003

    q4k = tensors["blocks.0.mlp.weight"]
    assert q4k.qtype == QType.Q4_K and q4k.shape == (8, 512)
    assert_bits_equal(q4k.dequantize(torch.float32), reference(data["blocks.0.mlp.weight"][0], QType.Q4_K, (8, 512)))

    # ComfyUI-GGUF's reshape record wins over the stored (3, 256)
    r = tensors["blocks.0.reshaped.weight"]
    assert r.shape == (8, 96)
    assert_bits_equal(r.dequantize(torch.float32), reference(data["blocks.0.reshaped.weight"][0], QType.Q6_K, (8, 96)))

    emb, norm, cube, bf = (tensors[k] for k in ("emb.weight", "norm.weight", "cube", "bf.weight"))
    assert emb.dtype == torch.float16 and torch.equal(emb, torch.from_numpy(data["emb.weight"][0]))
    assert norm.dtype == torch.float32 and torch.equal(norm, torch.from_numpy(data["norm.weight"][0]))
    assert cube.shape == (2, 3, 4) and torch.equal(cube, torch.arange(24, dtype=torch.float32).reshape(2, 3, 4))
    assert bf.dtype == torch.bfloat16 and bf.shape == (4, 32)
    assert_bits_equal(bf.float(), reference(data["bf.weight"][0], QType.BF16, (4, 32)))


def test_file_dims_are_reversed_torch_shape(mixed_file):
    """What the file itself lists (ggml ne[], innermost first) is the reverse of the torch shape we return."""
    path, _, _ = mixed_file
    tensors, _ = read_gguf(path)
    listed = {t.name: [int(d) for d in t.shape] for t in gguf.GGUFReader(str(path)).tensors}
    assert listed["blocks.0.proj.weight"] == [64, 48]
    assert listed["cube"] == [4, 3, 2]
    for name, dims in listed.items():
        if name != "blocks.0.reshaped.weight":
            assert tuple(tensors[name].shape) == tuple(reversed(dims))


def _mapped_ranges(path):
    real = os.path.realpath(path)
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[-1] == real:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi))
    return out


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_reader_is_zero_copy_and_never_writes_the_file(mixed_file):
    path, data, _ = mixed_file
    before = path.read_bytes()
    tensors, _ = read_gguf(path)
    ranges = _mapped_ranges(path)
    assert ranges
    for name in ("blocks.0.proj.weight", "blocks.0.mlp.weight", "norm.weight", "bf.weight"):
        t = tensors[name]
        ptr = (t.raw if isinstance(t, GGUFTensor) else t).data_ptr()
        assert any(lo <= ptr < hi for lo, hi in ranges), f"{name} is not a view of the file mapping"
    # copy-on-write: writing into a tensor changes this process' copy only
    tensors["norm.weight"].fill_(123.0)
    tensors["blocks.0.proj.weight"].raw.zero_()
    assert path.read_bytes() == before
    again, _ = read_gguf(path)
    assert torch.equal(again["norm.weight"], torch.from_numpy(data["norm.weight"][0]))


# ---------------------------------------------------------------------------------------------------- (c) linear

def _gguf_tensor(qtype, out_f, in_f, seed=0):
    block, _ = QUANT_SIZES[qtype]
    raw = random_blocks(qtype, out_f * in_f // block, seed=seed)
    return GGUFTensor(torch.from_numpy(raw).reshape(out_f, -1), qtype, torch.Size((out_f, in_f)))


@pytest.mark.parametrize("qtype", (QType.Q4_K, QType.Q8_0, QType.Q5_1), ids=lambda q: q.name)
def test_gguf_linear_forward(qtype):
    t = _gguf_tensor(qtype, 16, 512, seed=1)
    bias = torch.randn(16)
    m = GGUFLinear.from_gguf(t, bias)
    assert m.weight.dtype == torch.uint8 and m.weight.data_ptr() == t.raw.data_ptr()  # no copy
    assert m.weight_nbytes() == t.nbytes
    assert_bits_equal(m.dequantize_weight(torch.float32), t.dequantize(torch.float32))
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 5, 512).to(dtype)
        w = dequantize(t.raw, qtype, (16, 512), dtype=dtype)
        assert torch.equal(m(x), F.linear(x, w, bias.to(dtype)))
    assert "Q" in repr(m) and "in_features=512" in repr(m)


def test_gguf_linear_to_keeps_blocks():
    t = _gguf_tensor(QType.Q4_K, 8, 256)
    m = GGUFLinear.from_gguf(t, torch.randn(8))
    raw_before = m.weight.clone()
    ptr = m.weight.data_ptr()
    m.to(torch.float16)
    assert m.weight.dtype == torch.uint8 and m.weight.data_ptr() == ptr and m.bias.dtype == torch.float16
    m.to(torch.bfloat16)
    m.half()
    assert m.weight.dtype == torch.uint8 and torch.equal(m.weight, raw_before)
    assert set(m.state_dict()) == {"weight", "bias"}
    m.to("meta")  # a device move takes the blocks along, as bytes
    assert m.weight.device.type == "meta" and m.weight.dtype == torch.uint8 and m.bias.device.type == "meta"
    assert m.weight.shape == raw_before.reshape(-1, QUANT_SIZES[QType.Q4_K][1]).shape


def test_gguf_linear_follows_input_device_and_dtype():
    t = _gguf_tensor(QType.Q8_0, 8, 64)
    m = GGUFLinear.from_gguf(t, None)
    y = m(torch.randn(2, 64, device="meta", dtype=torch.float16))  # blocks on CPU, input elsewhere
    assert y.device.type == "meta" and y.dtype == torch.float16 and y.shape == (2, 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_gguf_linear_cuda():
    t = _gguf_tensor(QType.Q4_K, 16, 512)
    m = GGUFLinear.from_gguf(t, torch.randn(16)).cuda()
    assert m.weight.is_cuda and m.weight.dtype == torch.uint8
    x = torch.randn(4, 512, dtype=torch.bfloat16, device="cuda")
    w = t.dequantize(torch.bfloat16).cuda()
    assert torch.equal(m(x), F.linear(x, w, m.bias.to(torch.bfloat16)))


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.b = torch.nn.Linear(32, 32, bias=False)
        self.c = torch.nn.Linear(32, 256)
        self.d = torch.nn.Linear(256, 8)

    def forward(self, x):
        return self.d(self.c(self.b(self.norm(self.a(x)))))


def _tiny_tensors(prefix=""):
    g = torch.Generator().manual_seed(0)
    return {
        prefix + "a.weight": _gguf_tensor(QType.Q8_0, 32, 64, seed=2),
        prefix + "a.bias": torch.randn(32, generator=g),
        prefix + "norm.weight": torch.rand(32, generator=g) + 0.5,
        prefix + "norm.bias": torch.randn(32, generator=g).half(),
        prefix + "b.weight": torch.randn(32, 32, generator=g) * 0.1,             # plain: loaded as usual
        prefix + "c.weight": _gguf_tensor(QType.Q4_0, 256, 32, seed=3),          # kept by the rule below
        prefix + "c.bias": torch.randn(256, generator=g),
        prefix + "d.weight": _gguf_tensor(QType.Q4_K, 8, 256, seed=4),
        prefix + "d.bias": torch.randn(8, generator=g),
        prefix + "extra.weight": torch.zeros(3),
    }


def _expected_output(tensors, x, prefix=""):
    ref = Tiny()
    sd = {k[len(prefix):]: (v.dequantize(torch.float32) if isinstance(v, GGUFTensor) else v.float())
          for k, v in tensors.items() if not k.endswith("extra.weight")}
    ref.load_state_dict(sd)
    return ref(x)


@pytest.mark.parametrize("meta", (False, True), ids=("cpu", "meta"))
def test_replace_with_gguf_linears(meta):
    tensors = _tiny_tensors("model.")
    if meta:
        with torch.device("meta"):
            model = Tiny()
    else:
        model = Tiny()
    keys_before = set(model.state_dict())
    report = replace_with_gguf_linears(model, tensors, keep=["c"], prefix="model.")
    assert report["gguf"] == ["a", "d"] and report["kept"] == ["c"] and report["plain"] == ["b"]
    assert sorted(report["other"]) == ["norm.bias", "norm.weight"]
    assert report["unexpected"] == ["model.extra.weight"] and report["missing"] == []
    assert isinstance(model.a, GGUFLinear) and isinstance(model.d, GGUFLinear)
    assert type(model.c) is torch.nn.Linear and type(model.b) is torch.nn.Linear
    assert model.a.weight.dtype == torch.uint8 and model.a.qtype == QType.Q8_0
    assert set(model.state_dict()) == keys_before  # same keys as the file
    assert model.norm.bias.dtype == torch.float32  # loaded in the model's dtype
    x = torch.randn(4, 64)
    assert torch.allclose(model(x), _expected_output(tensors, x, "model."), rtol=0, atol=1e-5)


def test_replace_keep_callable_and_shape_mismatch():
    tensors = _tiny_tensors()
    model = Tiny()
    report = replace_with_gguf_linears(model, tensors, keep=lambda name, module: name == "d")
    assert report["gguf"] == ["a", "c"] and report["kept"] == ["d"]
    assert torch.equal(model.d.weight, tensors["d.weight"].dequantize(torch.float32))

    bad = dict(tensors, **{"a.weight": _gguf_tensor(QType.Q8_0, 32, 128)})
    with pytest.raises(GGUFError, match=r"a\.weight: the file holds shape \(32, 128\), the model expects \(32, 64\)"):
        replace_with_gguf_linears(Tiny(), bad)


# ---------------------------------------------------------------------------------------------------- (d) errors

def test_error_not_gguf(tmp_path):
    st = tmp_path / "model.safetensors.gguf"
    st.write_bytes((20).to_bytes(8, "little") + b'{"__metadata__":{}}  ')
    with pytest.raises(GGUFError, match=r"model\.safetensors\.gguf: not a GGUF file .*safetensors"):
        read_gguf(st)
    html = tmp_path / "page.gguf"
    html.write_text("<!DOCTYPE html><html>rate limited</html>")
    with pytest.raises(GGUFError, match=r"page\.gguf: not a GGUF file .*HTML"):
        read_gguf(html)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFError, match=r"empty\.gguf: .*empty"):
        read_gguf(empty)
    with pytest.raises(FileNotFoundError):
        read_gguf(tmp_path / "missing.gguf")


def test_error_truncated(mixed_file, tmp_path):
    path, _, _ = mixed_file
    full = path.read_bytes()
    for n in (2, 10, 40, 300, len(full) // 2, len(full) - 1):
        cut = tmp_path / f"cut{n}.gguf"
        cut.write_bytes(full[:n])
        with pytest.raises(GGUFError, match=rf"cut{n}\.gguf: .*truncated.*download it again"):
            read_gguf(cut)


def test_error_unsupported_type(tmp_path):
    rng = np.random.default_rng(0)
    data = {
        "ok.weight": (gguf.quants.quantize(rng.standard_normal((4, 32)).astype(np.float32), GT.Q8_0), GT.Q8_0),
        "odd.weight": (rng.integers(0, 256, size=(4, 18), dtype=np.uint8), GT.IQ4_NL),
    }
    path = write_gguf(tmp_path / "iq.gguf", data)
    with pytest.raises(GGUFError, match=r"iq\.gguf: 1 tensor\(s\) use GGML types .*odd\.weight \(IQ4_NL\).*"
                                        r"Supported: .*Q8_0.*Q4_K.*Q6_K"):
        read_gguf(path)
    with pytest.raises(GGUFError, match=r"IQ4_NL is not supported \(supported: .*Q2_K"):
        dequantize(torch.zeros(18, dtype=torch.uint8), int(GT.IQ4_NL), (32,))


def test_error_unknown_type_id(mixed_file, tmp_path):
    """A type id the `gguf` package does not know (a newer or corrupt file)."""
    path, _, _ = mixed_file
    t = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "norm.weight")
    type_at = int(t.field.offset) + sum(int(p.nbytes) for p in t.field.parts[:4])  # name, n_dims, dims, then type
    blob = bytearray(path.read_bytes())
    assert int.from_bytes(blob[type_at:type_at + 4], "little") == int(GT.F32)
    blob[type_at:type_at + 4] = (250).to_bytes(4, "little")
    bad = tmp_path / "newtype.gguf"
    bad.write_bytes(bytes(blob))
    with pytest.raises(GGUFError, match=r"newtype\.gguf: a tensor has a GGML type .*pip install -U gguf"):
        read_gguf(bad)


def test_error_gguf_package_missing(mixed_file, monkeypatch):
    path, _, _ = mixed_file
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf -> ImportError
    with pytest.raises(GGUFPackageMissing, match=r"mixed\.gguf: .*pip install gguf") as e:
        read_gguf(path)
    assert isinstance(e.value, ImportError) and isinstance(e.value, GGUFError)


def test_error_bad_sizes():
    with pytest.raises(GGUFError, match=r"Q4_K tensor of shape \(8, 100\): 800 elements are not a multiple"):
        dequantize(torch.zeros(1000, dtype=torch.uint8), QType.Q4_K, (8, 100))
    with pytest.raises(GGUFError, match=r"takes 288 bytes, the data has 287"):
        dequantize(torch.zeros(287, dtype=torch.uint8), QType.Q4_K, (2, 256))
    with pytest.raises(GGUFError, match="must be a uint8 tensor"):
        dequantize(torch.zeros(72), QType.Q4_K, (2, 256))
    with pytest.raises(GGUFError, match="takes 34 bytes, raw has 68"):
        GGUFTensor(torch.zeros(68, dtype=torch.uint8), QType.Q8_0, torch.Size((32,)))


def test_gguf_tensor_takes_gguf_enum_and_tuple_shape():
    t = GGUFTensor(torch.zeros(34, dtype=torch.uint8), GT.Q8_0, (32,))
    assert t.qtype is QType.Q8_0 and t.shape == torch.Size((32,)) and "Q8_0" in repr(t)
    assert t.block_size == 32 and t.type_size == 34 and t.nbytes == 34
    assert torch.equal(t.dequantize(torch.float32), torch.zeros(32))
    with pytest.raises(GGUFError, match="F16 is not a quantized type"):
        GGUFTensor(torch.zeros(64, dtype=torch.uint8), GT.F16, (32,))
