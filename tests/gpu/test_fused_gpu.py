"""GPU: the fused Triton kernels against their torch references, and the dispatch. Skips without CUDA."""
import pytest
import torch

from seedvr2bw.optimization import fused
from seedvr2bw.optimization.fused import reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def test_selftest_passes():
    ok, why = fused.selftest(torch.device("cuda"))
    print("fused self-test:", ok, why)
    assert ok, why
    assert fused.enabled(torch.zeros(2, 2, device="cuda", dtype=torch.bfloat16))
    assert not fused.enabled(torch.zeros(2, 2, device="cuda"))  # fp32 keeps the exact torch path


@pytest.mark.parametrize("d,lens", [(3072, [301]), (2560, [100, 57, 3]), (320, [1, 1])])
def test_norm_modulate_and_residual(d, lens):
    g = torch.Generator(device="cuda").manual_seed(d)
    n = sum(lens)
    x, o = (torch.randn(n, d, device="cuda", generator=g).bfloat16() for _ in range(2))
    sc, sh, gt = (torch.randn(len(lens), d, device="cuda", generator=g) for _ in range(3))
    sid = fused.sample_ids(lens, "cuda")
    assert rel(fused.norm_modulate(x, sc, sh, 1e-5, lens), reference.norm_modulate(x, sc, sh, 1e-5, sid)) < 1e-2
    r, y = fused.residual_norm_modulate(x, o, gt, sc, sh, 1e-5, lens)
    r2, y2 = reference.residual_norm_modulate(x, o, gt, sc, sh, 1e-5, sid)
    assert rel(r, r2) < 1e-2 and rel(y, y2) < 1e-2
    assert rel(fused.gated_residual(x, o, gt, lens), reference.gated_residual(x, o, gt, sid)) < 1e-2


@pytest.mark.parametrize("variant", ["v1", "v2", "v3"])
@pytest.mark.parametrize("heads,r2", [(24, 30), (20, 63), (3, 0)])
def test_qkv_norm_rope_pack(heads, r2, variant, monkeypatch):
    monkeypatch.setenv("SEEDVR2BW_QKV_KERNEL", variant)
    g = torch.Generator(device="cuda").manual_seed(heads)
    m, hd = 513, 128
    qkv = torch.randn(m, 3 * heads * hd, device="cuda", generator=g).bfloat16()
    wq, wk = (1 + 0.2 * torch.randn(hd, device="cuda", generator=g)).bfloat16(), torch.rand(hd, device="cuda", generator=g).bfloat16()
    if r2:
        ang = torch.rand(m, r2, device="cuda", generator=g) * 30
        cos, sin = ang.cos(), ang.sin()
    else:
        cos = sin = None
    dst = torch.randperm(m + 50, device="cuda", generator=g)[:m]
    got, want = (torch.full((3, m + 50, heads, hd), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(2))
    fused.qkv_norm_rope_pack(qkv, heads, hd, wq, wk, 1e-5, cos, sin, dst, got)
    reference.qkv_norm_rope_pack(qkv, heads, hd, wq, wk, 1e-5, cos, sin, dst, *want)
    for a, b in zip(got, want):
        assert not a[dst].isnan().any()
        assert rel(a[dst], b[dst]) < 1e-2


def test_silu_mul_and_linear_gelu():
    g = torch.Generator(device="cuda").manual_seed(7)
    a, b = (torch.randn(1000, 777, device="cuda", generator=g).bfloat16() for _ in range(2))
    assert rel(fused.silu_mul(a, b), reference.silu_mul(a, b)) < 1e-2
    x = torch.randn(300, 256, device="cuda", generator=g).bfloat16()
    w = (torch.randn(1024, 256, device="cuda", generator=g) / 16).bfloat16()
    bias = torch.randn(1024, device="cuda", generator=g).bfloat16()
    ref = torch.nn.functional.gelu(torch.nn.functional.linear(x.float(), w.float(), bias.float()), approximate="tanh")
    assert rel(fused.linear_gelu(x, w, bias), ref) < 1e-2


@pytest.mark.parametrize("shape,groups", [((1, 128, 3, 180, 320), 32), ((2, 64, 1, 33, 47), 32), ((1, 512, 2, 90, 160), 32)])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last_3d])
def test_group_norm_frames(shape, groups, layout):
    g = torch.Generator(device="cuda").manual_seed(shape[1])
    x = (torch.randn(shape, device="cuda", generator=g) * 2 + 3).bfloat16().contiguous(memory_format=layout)
    norm = torch.nn.GroupNorm(groups, shape[1], eps=1e-6).cuda().bfloat16()
    with torch.no_grad():
        norm.weight.normal_(1, 0.2, generator=g)
        norm.bias.normal_(0, 0.2, generator=g)
        for silu in (False, True):
            fused.group_norm_frames(x, norm, silu)   # the first call runs the device's self-test (which reads back)
            torch.cuda.set_sync_debug_mode("error")   # later calls never make the host wait for the GPU
            try:
                got = fused.group_norm_frames(x, norm, silu)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            want = reference.group_norm_frames(x, groups, norm.weight, norm.bias, norm.eps, silu)
            assert got.is_contiguous(memory_format=layout)
            # same math, other fp32 summation order: a few values round to the neighbouring bf16
            differ = float((got != want).float().mean())
            assert rel(got, want) < 2e-3 and differ < 0.02, (rel(got, want), differ)
            # written behind 2 leading frames of a longer buffer (the causal conv's prefix): same values, the
            # prefix untouched
            buf = torch.full((shape[0], shape[1], 2 + shape[2]) + tuple(shape[3:]), 7.0, device="cuda",
                             dtype=x.dtype).contiguous(memory_format=layout)
            into = fused.group_norm_frames(x, norm, silu, out=buf[:, :, 2:])
            assert into.data_ptr() == buf[:, :, 2:].data_ptr()
            assert torch.equal(buf[:, :, 2:], got) and bool((buf[:, :, :2] == 7).all())
            # and between a halo row above and two below (a band of rows of a row split), channels-last only
            if layout == torch.channels_last_3d:
                h = shape[3]
                buf = torch.full(shape[:3] + (h + 3, shape[4]), 7.0, device="cuda",
                                 dtype=x.dtype).contiguous(memory_format=layout)
                into = fused.group_norm_frames(x, norm, silu, out=buf[:, :, :, 1:1 + h])
                assert into.data_ptr() == buf[:, :, :, 1:].data_ptr()
                assert torch.equal(buf[:, :, :, 1:1 + h], got)
                assert bool((buf[:, :, :, :1] == 7).all()) and bool((buf[:, :, :, 1 + h:] == 7).all())


@pytest.mark.parametrize("shape", [(1, 128, 3, 180, 320), (2, 96, 1, 33, 47)])
def test_conv_bias_folding(shape):
    """A conv's bias left to what reads its output: the channels-last GroupNorm of x + bias against adding it
    first (as cuDNN's bias pass does, rounded to bf16), and the one-pass h + x + bias against the two adds; neither
    makes the host wait."""
    g = torch.Generator(device="cuda").manual_seed(3)
    cl = torch.channels_last_3d
    x = (torch.randn(shape, device="cuda", generator=g) * 2).bfloat16().contiguous(memory_format=cl)
    ib = (torch.randn(shape[1], device="cuda", generator=g) * 0.5).bfloat16()
    norm = torch.nn.GroupNorm(32, shape[1], eps=1e-6).cuda().bfloat16()
    with torch.no_grad():
        norm.weight.normal_(1, 0.2, generator=g)
        norm.bias.normal_(0, 0.2, generator=g)
        want = fused.group_norm_frames((x + ib.view(1, -1, 1, 1, 1)).contiguous(memory_format=cl), norm, True)
        fused.group_norm_frames(x, norm, True, in_bias=ib)
        h = torch.randn(shape, device="cuda", generator=g).bfloat16().contiguous(memory_format=cl)
        want_r = (h + ib.view(1, -1, 1, 1, 1)) + x
        fused.residual_bias(h.clone(), x, ib)
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = fused.group_norm_frames(x, norm, True, in_bias=ib)
            got_r = fused.residual_bias(h, x, ib)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert got.is_contiguous(memory_format=cl) and got_r.data_ptr() == h.data_ptr()
    assert rel(got, want) < 1e-2, rel(got, want)
    assert rel(got_r, want_r) < 5e-3, rel(got_r, want_r)


def test_vae_fused_vs_torch_path(monkeypatch):
    """Tiny golden VAE in bf16: encode and decode on the fused kernels (channels-last GroupNorm, folded biases, the
    residual's moments) against the torch path: within bf16 rounding of it, and no further from the float32 golden
    outputs (the issue's bound) than it."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    from seedvr2bw.models.seedvr2.vae import load_vae

    golden = Path(__file__).resolve().parents[1] / "data" / "golden"
    man = json.loads((golden / "manifest.json").read_text())["vae"]
    vae = load_vae(golden / man["weights_file"], device="cuda", dtype=torch.bfloat16,
                   norm_num_groups=man["constructor_kwargs"]["norm_num_groups"])
    case = load_file(golden / man["cases"]["video"]["file"])
    x, z = case["x"].cuda().bfloat16(), case["z"].cuda().bfloat16()
    want = (case["posterior_mean"].cuda(), case["decoded"].cuda())
    with torch.no_grad():
        outs = {}
        for flag in ("0", "1"):
            monkeypatch.setenv("SEEDVR2BW_FUSED", flag)
            outs[flag] = (vae.encode(x).mean, vae.decode(z))
    for i, name in enumerate(("encode", "decode")):
        err, e_fused, e_torch = rel(outs["1"][i], outs["0"][i]), rel(outs["1"][i], want[i]), rel(outs["0"][i], want[i])
        print(f"vae {name}: fused vs torch path rel-L2 {err:.2e}; vs float32 golden: fused {e_fused:.2e}, "
              f"torch {e_torch:.2e}")
        assert err < 3e-2
        assert e_fused <= 1.1 * e_torch + 1e-3, (name, e_fused, e_torch)


def test_model_fused_vs_torch_path(monkeypatch):
    """Tiny golden models in bf16: fused path against the torch path (same weights, same input)."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    from seedvr2bw.models.seedvr2.dit import load_dit

    golden = Path(__file__).resolve().parents[1] / "data" / "golden"
    man = json.loads((golden / "manifest.json").read_text())["dit"]
    for variant in ("3b", "7b"):
        model = load_dit(golden / man["tiny_models"][variant]["weights_file"], device="cuda", dtype=torch.bfloat16,
                         attention_backend="sdpa")
        inp = load_file(golden / man["cases"]["video"]["inputs_file"])
        C = inp["vid"].shape[-1]
        args = (inp["vid"].reshape(-1, C).cuda(), inp["txt"].cuda(), inp["vid_shape"].cuda(), inp["txt_shape"].cuda(),
                inp["timestep"].cuda())
        with torch.no_grad():
            monkeypatch.setenv("SEEDVR2BW_FUSED", "0")
            base = model(*args)
            monkeypatch.setenv("SEEDVR2BW_FUSED", "1")
            got = model(*args)
        err = rel(got, base)
        print(f"{variant}: fused vs torch path rel-L2 {err:.2e}")
        assert err < 2e-2



@pytest.mark.parametrize("n", [14400, 32400])
def test_wide_head_attention(n):
    """The VAE mid block's head (512) at a 720p and a 1080p latent frame: two GEMMs with a split softmax no further
    from the float64 result than SDPA, in bounded query blocks; the dispatch's self-test says which runs."""
    from seedvr2bw.optimization.attention import wide_head
    g = torch.Generator(device="cuda").manual_seed(n)
    q, k, v = (torch.randn(1, n, 512, device="cuda", generator=g) for _ in range(3))
    q = q * 3
    idx = torch.randperm(n, device="cuda", generator=g)[:512]          # float64 reference on 512 query rows
    want = torch.softmax(q[:, idx].double() @ k.double().transpose(1, 2) / 512 ** 0.5, -1) @ v.double()
    q, k, v = (t.bfloat16() for t in (q, k, v))
    got = wide_head.gemm_attention(q, k, v)
    ref = wide_head.sdpa(q, k, v)
    e_got, e_ref = rel(got[:, idx], want), rel(ref[:, idx], want)
    print(f"N={n}: gemm attention rel err {e_got:.3e}, SDPA {e_ref:.3e};", wide_head.gemm_attention_selftest("cuda"))
    assert e_got <= 1.01 * e_ref


@pytest.mark.parametrize("shape", [(128, 6, 96, 160), (128, 5, 720, 1280)])
def test_streamed_conv_out(shape):
    """The decoder's conv_out (128 -> 3) streamed (a GEMM per frame, the tap-sum kernel) in two temporal chunks, in
    bands of rows and whole, against the float32 causal conv of the whole clip: no further from it than cuDNN's bf16
    conv (which rounds its output, then its bias pass rounds again)."""
    import torch.nn.functional as F
    c, t, h, w = shape
    g = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn(1, c, t, h, w, device="cuda", generator=g).bfloat16().contiguous(memory_format=torch.channels_last_3d)
    wt = (torch.randn(3, c, 3, 3, 3, device="cuda", generator=g) / (27 * c) ** 0.5).bfloat16()
    b = torch.randn(3, device="cuda", generator=g).bfloat16()
    xe = torch.cat([x[:, :, :1], x[:, :, :1], x], 2)
    with torch.backends.cudnn.flags(allow_tf32=False):
        want = F.conv3d(xe.float(), wt.float(), b.float(), padding=(0, 1, 1))
    cudnn = F.conv3d(xe, wt.contiguous(memory_format=torch.channels_last_3d), None, padding=(0, 1, 1)) + b.view(1, -1, 1, 1, 1)
    for max_bytes in (float("inf"), 27 * 3 * 4 * w * 40):
        y1, s = fused.stream_conv3d(x[:, :, :2], wt, b, None, True, max_bytes)
        y2, _ = fused.stream_conv3d(x[:, :, 2:], wt, b, s, False, max_bytes)
        got = torch.cat([y1, y2], 2)
        print(f"conv_out {shape} bands {max_bytes}: streamed {rel(got, want):.3e}, cuDNN {rel(cudnn, want):.3e}")
        assert rel(got, want) <= rel(cudnn, want)


def test_streamed_conv_out_reads_its_norm():
    """conv_out streamed with its GroupNorm + SiLU applied as the GEMM loads x (no normalised copy): the same as the
    GroupNorm kernels' output streamed, at a 720p chunk (128 channels, 32 groups; moments from the residual pass)."""
    from seedvr2bw.optimization.fused import vae_kernels as vk
    g = torch.Generator(device="cuda").manual_seed(0)
    cl = torch.channels_last_3d
    h_, x_ = (torch.randn(1, 128, 4, 720, 1280, device="cuda", generator=g).bfloat16().contiguous(memory_format=cl)
              for _ in range(2))
    norm = torch.nn.GroupNorm(32, 128, eps=1e-6).cuda().bfloat16()
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(128, device="cuda", generator=g))
        norm.bias.copy_(0.3 * torch.randn(128, device="cuda", generator=g))
    wt = (torch.randn(3, 128, 3, 3, 3, device="cuda", generator=g) / (27 * 128) ** 0.5).bfloat16()
    b = torch.randn(3, device="cuda", generator=g).bfloat16()
    x = fused.residual_bias(h_, x_, torch.zeros(128, device="cuda", dtype=torch.bfloat16))   # remembers its moments
    y = vk.group_norm_frames_cl(x, 32, norm.weight, norm.bias, 1e-6, silu=True)
    got, s1 = fused.stream_conv3d(x, wt, b, norm=norm)
    want, s2 = fused.stream_conv3d(y, wt, b)
    print(f"norm read by the GEMM: rel {rel(got, want):.2e}, max |diff| {(got.float() - want.float()).abs().max():.3e}")
    assert rel(got, want) < 1e-3 and rel(s1[0], s2[0]) < 1e-5


@pytest.mark.parametrize("case", ["up_t", "up_s", "shortcut"])
def test_gemm_epilogues(case):
    """The 1 x 1 convs as GEMMs with their readers as the epilogue, at a 720p decode chunk's shapes: the upsampler's
    conv with its depth-to-space (x2 in time and space, the first chunk's duplicate dropped; x2 in space), the
    ResNet shortcut with the residual add: no further from float32 than cuDNN's conv and the passes after it (which
    round the conv's output, then its bias); the shortcut's moments are the GroupNorm's."""
    import torch.nn.functional as F
    from seedvr2bw.optimization.runtime import knobs, selftests
    assert fused.gemm_epilogues(torch.zeros(1, device="cuda", dtype=torch.bfloat16)), selftests.status(
        "fused_gemm", "cuda")
    print("gemm self-test:", selftests.status("fused_gemm", "cuda"))
    g = torch.Generator(device="cuda").manual_seed(7)
    cl = torch.channels_last_3d

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).bfloat16()

    cin, t, h, w, s, rt, drop = {"up_t": (512, 2, 180, 320, 2, 2, True), "up_s": (256, 4, 360, 640, 2, 1, False),
                                 "shortcut": (512, 4, 360, 640, 1, 1, False)}[case]
    x = rnd(1, cin, t, h, w).contiguous(memory_format=cl)
    if case == "shortcut":
        c = 256
        wt, xb, b, hh = rnd(c, cin, 1, 1, 1, scale=cin ** -0.5), rnd(c, scale=0.3), rnd(c, scale=0.3), rnd(1, c, t, h, w)
        hh = hh.contiguous(memory_format=cl)
        want = hh.float() + b.float().view(1, -1, 1, 1, 1) + F.conv3d(x.float(), wt.float(), xb.float())
        ref = fused.residual_bias(hh.clone(), F.conv3d(x, wt).contiguous(memory_format=cl), b, xb)
        got = fused.shortcut_residual(hh.clone(), x, wt, xb, b)
        norm = torch.nn.GroupNorm(32, c, eps=1e-6).cuda().bfloat16()
        with torch.no_grad():       # the norm of the sum from the kernel's moments, and from its own pass (a copy)
            assert rel(fused.group_norm_frames(got, norm, True), fused.group_norm_frames(got.clone(), norm, True)) < 1e-5
    else:
        c = cin
        n = s * s * rt * c
        wt, bias = rnd(n, cin, 1, 1, 1, scale=cin ** -0.5), rnd(n, scale=0.3)
        shape = (1, c, t * rt - int(drop), h * s, w * s)
        want = torch.empty(shape, device="cuda", memory_format=cl)
        with knobs.override(VAE_GEMM_EPILOGUE=False):
            fused.depth_to_space(F.conv3d(x.float(), wt.float()).contiguous(memory_format=cl), bias.float(), want, s,
                                 rt, drop)
            ref = fused.conv1x1_depth_to_space(x, wt, bias, torch.empty(shape, device="cuda", dtype=x.dtype,
                                                                        memory_format=cl), s, rt, drop)
        got = fused.conv1x1_depth_to_space(x, wt, bias, torch.empty(shape, device="cuda", dtype=x.dtype,
                                                                    memory_format=cl), s, rt, drop)
    print(f"{case}: GEMM with epilogue {rel(got, want):.3e}, cuDNN and its passes {rel(ref, want):.3e}")
    assert rel(got, want) <= rel(ref, want)
