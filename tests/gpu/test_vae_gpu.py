"""GPU checks of the SeedVR2 VAE (skipped without CUDA): fp32 golden parity on the GPU, bf16 vs fp32 sanity,
and tiled-decode peak VRAM bounded as the resolution grows. Set VAE_GPU_REPORT=<path> to write the figures."""
import json
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
sys.path.insert(0, str(ROOT / "scripts"))  # bench_vae.make_random_vae
from safetensors.torch import load_file  # noqa: E402

from seedvr2bw.models.seedvr2.vae import build_vae  # noqa: E402
from seedvr2bw.models.seedvr2.vae.tiling import estimate_decode_bytes  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GIB = 1024 ** 3
REPORT = {}


def rel_l2(a, b):
    return ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm()).item()


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    path = os.environ.get("VAE_GPU_REPORT")
    if path and REPORT:
        REPORT["device"] = torch.cuda.get_device_name()
        REPORT["torch"] = torch.__version__
        Path(path).write_text(json.dumps(REPORT, indent=1))


@pytest.fixture(scope="module")
def tiny():
    sd = load_file(str(DATA / "golden" / "vae_tiny_weights.safetensors"))
    return build_vae(sd, norm_num_groups=2, device="cuda")


@pytest.fixture(scope="module")
def real_bf16():
    from bench_vae import make_random_vae
    return make_random_vae("cuda", torch.bfloat16)


def test_golden_fp32_on_gpu(tiny):
    prev = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for case in ("video", "image"):
            d = load_file(str(DATA / "golden" / f"vae_case_{case}.safetensors"), device="cuda")
            post = tiny.encode(d["x"])
            z = d["z"].squeeze(2) if case == "image" else d["z"]
            r = dict(mean=rel_l2(post.mean, d["posterior_mean"]), logvar=rel_l2(post.logvar, d["posterior_logvar"]),
                     decoded=rel_l2(tiny.decode(z), d["decoded"]))
            REPORT[f"golden_fp32_cuda_{case}"] = r
            assert max(r.values()) <= 1e-5, r
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = prev


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_channels_last_equals_ncdhw(dtype):
    """The NDHWC path (cuDNN without transposes, the channels-last GroupNorm kernel) against NCDHW, TF32 off: fp32
    within rounding, bf16 within a few units of the last place; and the bf16 output's distance to the fp32 NCDHW
    output no worse than the NCDHW bf16 one's (the issue's bound)."""
    prev = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        sd = load_file(str(DATA / "golden" / "vae_tiny_weights.safetensors"))
        vae = build_vae(sd, norm_num_groups=2, dtype=dtype, device="cuda")
        d = load_file(str(DATA / "golden" / "vae_case_video.safetensors"), device="cuda")
        out = {}
        for on in (False, True):
            vae.channels_last = on
            out[on] = (vae.encode(d["x"].to(dtype)).mean, vae.decode(d["z"].to(dtype)))
        r = [rel_l2(out[True][i], out[False][i]) for i in range(2)]
        REPORT[f"channels_last_vs_ncdhw_{str(dtype)[6:]}"] = r
        assert max(r) < (1e-5 if dtype == torch.float32 else 2e-2), r
        if dtype == torch.bfloat16:
            for i, key in enumerate(("posterior_mean", "decoded")):
                assert rel_l2(out[True][i], d[key]) <= 1.1 * rel_l2(out[False][i], d[key]) + 1e-4
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = prev


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_folded_conv_biases_are_bit_equal(dtype):
    """SEEDVR2BW_VAE_FOLD_BIASES: the ResNet convs' biases added by the fused kernels that read their outputs give
    the same bits as torch's own bias pass (cuDNN's path adds the bias after the convolution, rounded, as they do):
    the tiny golden VAE's encode on NDHWC; its decode within rounding (the upsamplers' biases, below). Its convs to 4
    channels run on cuDNN here (SEEDVR2BW_VAE_STREAM_CONV off): streamed, a conv adds its bias before rounding."""
    from seedvr2bw.models.seedvr2.vae.norm import fold_biases
    from seedvr2bw.optimization.runtime import knobs
    vae = build_vae(load_file(str(DATA / "golden" / "vae_tiny_weights.safetensors")), norm_num_groups=2,
                    dtype=dtype, device="cuda")
    vae.channels_last = True
    d = load_file(str(DATA / "golden" / "vae_case_video.safetensors"), device="cuda")
    block = vae.encoder.down_blocks[0].resnets[0]
    out = {}
    with torch.no_grad():
        for fold in (False, True):
            with knobs.override(VAE_FOLD_BIASES=fold, VAE_STREAM_CONV=False):
                probe = torch.zeros(1, block.conv1.in_channels, 1, 2, 2, device="cuda", dtype=dtype)
                assert fold_biases(probe.contiguous(memory_format=torch.channels_last_3d), block.conv1,
                                   block.conv2) == fold
                out[fold] = (vae.encode(d["x"].to(dtype)).mean, vae.decode(d["z"].to(dtype)))
    assert torch.equal(out[True][0], out[False][0]), ("encode", rel_l2(out[True][0], out[False][0]))
    # the decoder's upsamplers leave their conv's bias to the next block too; where that block has a 1 x 1 shortcut,
    # the bias reaches the residual through the shortcut's weight (in float32), which rounds otherwise than
    # shortcut(x + bias): within rounding of the unfolded output, and no further from the float32 golden one
    err, e_fold, e_plain = (rel_l2(out[True][1], out[False][1]), rel_l2(out[True][1], d["decoded"]),
                            rel_l2(out[False][1], d["decoded"]))
    print(f"{dtype} decode: folded vs unfolded {err:.2e}; vs float32 golden: folded {e_fold:.2e}, unfolded {e_plain:.2e}")
    assert err < 3e-2 and e_fold <= 1.1 * e_plain + 1e-3, (err, e_fold, e_plain)


def test_bf16_vs_fp32(tiny, real_bf16):
    d = load_file(str(DATA / "golden" / "vae_case_video.safetensors"), device="cuda")
    ref = tiny.decode(d["z"])
    bf = build_vae(load_file(str(DATA / "golden" / "vae_tiny_weights.safetensors")), norm_num_groups=2,
                   dtype=torch.bfloat16, device="cuda")
    r_tiny = rel_l2(bf.decode(d["z"].bfloat16()), ref)
    r_tiny_enc = rel_l2(bf.encode(d["x"]).mean, tiny.encode(d["x"]).mean)
    # Real dimensions: the random bf16 model against its fp32 copy on a small clip.
    real32 = build_vae({k: v.float() for k, v in real_bf16.state_dict().items()}, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.rand(1, 3, 5, 64, 96, generator=g, device="cuda") * 2 - 1
    p32 = real32.encode(x)
    r_real_enc = rel_l2(real_bf16.encode(x.bfloat16()).mean, p32.mean)
    r_real_dec = rel_l2(real_bf16.decode(p32.mean.bfloat16()), real32.decode(p32.mean))
    REPORT["bf16_vs_fp32"] = dict(tiny_decode=r_tiny, tiny_encode=r_tiny_enc, real_encode=r_real_enc,
                                  real_decode=r_real_dec)
    assert r_tiny < 3e-2 and r_tiny_enc < 3e-2 and r_real_enc < 5e-2 and r_real_dec < 5e-2, REPORT["bf16_vs_fp32"]
    del real32


def _peak(fn):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    torch.cuda.empty_cache()
    return peak


def test_tiled_decode_vram_bounded(real_bf16):
    vae, tile, overlap = real_bf16, 24, 4
    rows = {}
    for n in (32, 64, 128):  # 256, 512, 1024 px square; 2 latent frames -> 5 frames
        z = torch.randn(1, 16, 2, n, n, device="cuda", dtype=torch.bfloat16)
        tiled = _peak(lambda: vae.decode_tiled(z, tile, overlap, output_device="cpu"))
        single = _peak(lambda: vae.decode(z, output_device="cpu")) if n <= 64 else None
        rows[n] = dict(tiled_gib=tiled / GIB, untiled_gib=None if single is None else single / GIB)
    est = estimate_decode_bytes(tile) / GIB
    REPORT["tiled_decode_peak_vram"] = dict(tile=tile, overlap=overlap, est_gib=est, by_latent_size=rows)
    print(REPORT["tiled_decode_peak_vram"])
    assert rows[128]["tiled_gib"] <= 1.15 * rows[32]["tiled_gib"] + 0.05
    assert rows[64]["untiled_gib"] > 1.5 * rows[64]["tiled_gib"]


def test_streamed_conv_out_decode():
    """SEEDVR2BW_VAE_STREAM_CONV: the tiny golden decode (bf16, NDHWC, the official temporal chunks) with conv_out
    streamed is within rounding of cuDNN's and no further from the float32 golden output."""
    from seedvr2bw.optimization.runtime import knobs
    vae = build_vae(load_file(str(DATA / "golden" / "vae_tiny_weights.safetensors")), norm_num_groups=2,
                    dtype=torch.bfloat16, device="cuda")
    vae.channels_last = True
    d = load_file(str(DATA / "golden" / "vae_case_video.safetensors"), device="cuda")
    out = {}
    with torch.no_grad():
        for on in (True, False):
            with knobs.override(VAE_STREAM_CONV=on):
                probe = torch.zeros(1, 8, 1, 2, 2, device="cuda", dtype=torch.bfloat16)
                assert vae.decoder.conv_out.streams(probe.contiguous(memory_format=torch.channels_last_3d)) == on
                out[on] = vae.decode(d["z"].bfloat16())
    err, e_on, e_off = rel_l2(out[True], out[False]), rel_l2(out[True], d["decoded"]), rel_l2(out[False], d["decoded"])
    print(f"streamed conv_out: vs cuDNN {err:.2e}; vs float32 golden: streamed {e_on:.2e}, cuDNN {e_off:.2e}")
    assert err < 1e-2 and e_on <= e_off, (err, e_on, e_off)


def test_head_sum_first_chunk():
    """SEEDVR2BW_VAE_HEAD_SUM (auto: on for 16-bit weights on a GPU): cuDNN writes frames 1.. of the first chunk's
    conv into its output and frame 0 comes from the summed taps; at a real width (256 channels, 90 x 160) no further
    from the float32 conv than the conv of the replicated frames, and the tiny golden encode and decode (bf16) no
    further from the float32 golden outputs than with it off."""
    import torch.nn.functional as F
    from seedvr2bw.models.seedvr2.vae.causal_conv import head_sum_conv
    from seedvr2bw.optimization.runtime import knobs
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, 256, 3, 90, 160, device="cuda", generator=g).bfloat16()
    w = (torch.randn(256, 256, 3, 3, 3, device="cuda", generator=g) / (27 * 256) ** 0.5).bfloat16()
    cl = torch.channels_last_3d
    three = torch.cat([x[:, :, :1], x[:, :, :1], x], 2).contiguous(memory_format=cl)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        want = F.conv3d(three.float(), w.float(), None, padding=(0, 1, 1))
    plain = F.conv3d(three, w.contiguous(memory_format=cl), None, padding=(0, 1, 1))
    got = head_sum_conv(three[:, :, 1:], w.contiguous(memory_format=cl), None, (1, 1, 1), (0, 1, 1))
    assert got.is_contiguous(memory_format=cl)
    e_got, e_plain = rel_l2(got, want), rel_l2(plain, want)
    print(f"head sum conv: {e_got:.3e} from float32 (replicated frames {e_plain:.3e})")
    assert e_got <= 1.01 * e_plain, (e_got, e_plain)
    assert rel_l2(got[:, :, 1:], plain[:, :, 1:]) < 5e-3      # the same conv (cuDNN may pick another algorithm)

    vae = build_vae(load_file(str(DATA / "golden" / "vae_tiny_weights.safetensors")), norm_num_groups=2,
                    dtype=torch.bfloat16, device="cuda")
    d = load_file(str(DATA / "golden" / "vae_case_video.safetensors"), device="cuda")
    out = {}
    with torch.no_grad():
        for on in (None, False):
            with knobs.override(VAE_HEAD_SUM=on):
                assert vae.decoder.conv_in.sums_head() == (on is None)
                out[on] = (vae.encode(d["x"].bfloat16()).mean, vae.decode(d["z"].bfloat16()))
    for i, key in enumerate(("posterior_mean", "decoded")):
        e_on, e_off = rel_l2(out[None][i], d[key]), rel_l2(out[False][i], d[key])
        print(f"tiny {key}: head sum {e_on:.3e}, off {e_off:.3e} from float32 golden")
        assert e_on <= 1.02 * e_off, (key, e_on, e_off)


def test_gemm_epilogues_in_the_model():
    """SEEDVR2BW_VAE_GEMM_EPILOGUE: the real-size random VAE with random biases (its upsamplers' 1 x 1 convs to
    512 x 8 and 256 x 4 channels, the 512 -> 256 and 256 -> 128 shortcuts) decodes and encodes a small clip, in
    temporal chunks, within rounding of cuBLAS's path and no further from its float32 copy. (With zero biases the two
    paths give the same bits: the GEMMs sum in the same order, and the bias is what the kernels round once less.)"""
    from bench_vae import make_random_vae
    from seedvr2bw.optimization.runtime import knobs
    vae = make_random_vae("cuda", torch.float32, seed=5)
    g = torch.Generator(device="cuda").manual_seed(3)
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if name.endswith("bias") and "norm" not in name:
                p.normal_(0.0, 0.1, generator=g)
    bf = build_vae({k: v.bfloat16() for k, v in vae.state_dict().items()}, dtype=torch.bfloat16, device="cuda")
    bf.channels_last = True              # (the kernels' layout; the pipeline takes it from the hardware policy)
    x = torch.rand(1, 3, 9, 64, 96, generator=g, device="cuda") * 2 - 1
    with torch.no_grad():
        z = vae.encode(x).mean
        want = (vae.decode(z), z)
        got = {}
        for on in (True, False):
            with knobs.override(VAE_GEMM_EPILOGUE=on):
                got[on] = (bf.decode(z.bfloat16()), bf.encode(x.bfloat16()).mean)
    for i, name in enumerate(("decode", "encode")):
        err, e_on, e_off = rel_l2(got[True][i], got[False][i]), rel_l2(got[True][i], want[i]), rel_l2(got[False][i],
                                                                                                      want[i])
        print(f"gemm epilogues, {name}: vs cuBLAS path {err:.2e}; vs float32: on {e_on:.2e}, off {e_off:.2e}")
        assert 0 < err < 2e-2 and e_on <= 1.05 * e_off, (name, err, e_on, e_off)


def test_tiled_calls_do_not_wait_for_the_gpu(tiny):
    """decode_tiled / encode_tiled copy nothing from the host while tiles run: their blend weights go to the GPU once
    before the first tile (a pageable host-to-device copy waits for the queued work: one a temporal chunk kept the
    GPU idle while the next chunk was launched). Counted with the profiler: one copy a row and a column of tiles (the
    weights: 1 row, 2 columns here), none a chunk (2 tiles x 3 chunks would make 6)."""
    from torch.profiler import ProfilerActivity, profile
    d = load_file(str(DATA / "golden" / "vae_case_video.safetensors"), device="cuda")
    z, x = d["z"], d["x"]
    with torch.no_grad():
        tiny.decode_tiled(z, (4, 4), 2)
        tiny.encode_tiled(x, (32, 32), 16)
        for name, run, spans in (("decode", lambda: tiny.decode_tiled(z, (4, 4), 2), z.shape[-2:]),
                                 ("encode", lambda: tiny.encode_tiled(x, (32, 32), 16), x.shape[-2:])):
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                run()
                torch.cuda.synchronize()
            h2d = sum(1 for e in prof.events() if "HtoD" in e.name)
            print(f"tiled {name} of {tuple(spans)}: {h2d} host-to-device copies")
            assert h2d <= 3, (name, h2d)
