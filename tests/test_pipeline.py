"""Pipeline tests: pure torch, CPU.

Most tests use tiny *fake* models with the real interfaces (lossless toy VAE, a DiT that returns
``x_t - LQ`` so that x_0 = the LQ latent): the output then equals the (resized) input, so sizes, frame
padding, chunk blending and alpha handling can be checked exactly. The ``real_models`` tests run the
golden tiny DiT/VAE weights through the real model code.
"""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from seedvr2bw.models.seedvr2 import pipeline as P
from seedvr2bw.models.seedvr2.embeddings import MissingEmbeddingError, load_text_embeddings
from seedvr2bw.models.seedvr2.noise import SeededNoise
from seedvr2bw.models.seedvr2.dit.loader import load_dit
from seedvr2bw.models.seedvr2.vae import SEEDVR2_VAE, VideoAutoencoder, load_vae
from seedvr2bw.models.seedvr2.vae.tiling import estimate_decode_bytes

from conftest import DATA

GOLDEN = DATA / "golden"


# ----------------------------------------------------------------------------------------- fakes
class FakeVAE(VideoAutoencoder):
    """The real VAE class (its encode/decode, vae/tiling.py's tiler) with toy cores: lossless in time (4 frames ->
    the 4 channel groups of one latent frame), 8x average pooling in space. One core call per temporal pass."""

    def __init__(self, logvar=-30.0):
        torch.nn.Module.__init__(self)   # no encoder/decoder: iter_encode/iter_decode below stand in for them
        self.config = SEEDVR2_VAE
        self.split_size = None
        self.channels_last = None        # the real class's default: the device's policy decides the layout
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        self.logvar = logvar
        self.encode_calls = []
        self.decode_calls = []

    @property
    def dtype(self):
        return self.dummy.dtype

    @property
    def device(self):
        return self.dummy.device

    def iter_encode(self, x, should_stop=None):
        b, c, T, H, W = x.shape
        assert c == 3 and (T - 1) % 4 == 0 and H % 8 == 0 and W % 8 == 0, x.shape
        self.encode_calls.append(tuple(x.shape))
        pooled = F.avg_pool3d(x, (1, 8, 8))
        t = (T - 1) // 4 + 1
        mean = torch.zeros(b, 16, t, H // 8, W // 8, dtype=x.dtype)
        mean[:, 0:3, 0] = pooled[:, :, 0]
        for k in range(1, t):
            for j in range(4):
                mean[:, 3 * j:3 * j + 3, k] = pooled[:, :, 4 * k - 3 + j]
        yield 0, torch.cat([mean, torch.full_like(mean, self.logvar)], dim=1)

    def iter_decode(self, z, should_stop=None):
        b, c, t, h, w = z.shape
        self.decode_calls.append(tuple(z.shape))
        frames = [z[:, 0:3, 0]]
        for k in range(1, t):
            frames += [z[:, 3 * j:3 * j + 3, k] for j in range(4)]
        x = torch.stack(frames, dim=2)
        yield 0, x.repeat_interleave(8, dim=3).repeat_interleave(8, dim=4)


class FakeDiT(torch.nn.Module):
    """Velocity x_t - LQ (so x_0 = LQ) plus ``offset_per_call * call_index`` on the RGB channels."""

    def __init__(self, offset_per_call=0.0):
        super().__init__()
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        self.calls = []
        self.offset_per_call = offset_per_call

    def forward(self, vid, txt, vid_shape, txt_shape, timestep, should_stop=None):
        assert vid.shape[1] == 33 and torch.all(vid[:, 32] == 1)
        assert int(txt_shape[0, 0]) == txt.shape[0] and float(timestep[0]) == 1000.0
        assert vid.shape[0] == int(vid_shape.prod())
        k = len(self.calls)
        self.calls.append(SimpleNamespace(vid_shape=vid_shape.tolist(), txt=txt.clone(), noise=vid[:, :16].clone()))
        out = vid[:, :16] - vid[:, 16:32]
        out[:, :12] -= self.offset_per_call * k * 0.9152 * 2  # +offset in [0, 1] pixel space after decode
        return out


TXT = torch.randn(3, 24, generator=torch.Generator().manual_seed(0))


def run(frames, dit=None, vae=None, **kw):
    dit = dit or FakeDiT()
    vae = vae or FakeVAE()
    settings = P.UpscaleSettings(**{"resolution": 32, "color_correction": "none", **kw})
    return P.upscale(frames, dit, vae, TXT, settings)


def const_frames(T, H, W, C=3):
    vals = torch.linspace(0.1, 0.9, T)
    f = torch.zeros(T, H, W, C)
    f[..., 0] = vals[:, None, None]
    f[..., 1] = 0.5
    f[..., 2] = 1 - vals[:, None, None]
    if C == 4:
        f[..., 3] = 0.25
    return f


# ----------------------------------------------------------------------------------------- sizes
@pytest.mark.parametrize("h,w,res,scale,maxr,expect", [
    (24, 40, 32, 0, 0, (32, 53)),        # 53.33 -> 53
    (40, 24, 32, 0, 0, (53, 32)),
    (30, 45, 48, 0, 0, (48, 72)),
    (30, 45, 20, 0, 0, (20, 30)),        # downscale allowed
    (100, 100, 1080, 0, 0, (1080, 1080)),
    (24, 40, 0, 2.0, 0, (48, 80)),
    (25, 41, 0, 1.5, 0, (38, 62)),       # 37.5 -> 38 (half up), 61.5 -> 62
    (24, 48, 64, 0, 100, (50, 100)),     # long edge capped
])
def test_target_size(h, w, res, scale, maxr, expect):
    assert P.compute_target_size(h, w, res, scale, maxr) == expect


def test_model_size_rounds_up_to_16():
    assert P.model_size(32, 53) == (32, 64)
    assert P.model_size(17, 16) == (32, 16)


@pytest.mark.parametrize("T,H,W,res", [(1, 24, 40, 32), (1, 21, 33, 45), (3, 16, 16, 20), (7, 12, 20, 18)])
def test_output_size_is_requested_size(T, H, W, res):
    frames = torch.rand(T, H, W, 3, generator=torch.Generator().manual_seed(1))
    th, tw = P.compute_target_size(H, W, res)
    vae = FakeVAE()
    out = run(frames, vae=vae, resolution=res)
    assert out.shape == (T, th, tw, 3)
    assert out.dtype == torch.float32 and 0 <= out.min() and out.max() <= 1
    ph, pw = P.model_size(th, tw)
    assert all(c[-2:] == (ph, pw) for c in vae.encode_calls)


def test_scale_factor_mode():
    out = run(torch.rand(1, 20, 30, 3), resolution=0, scale_factor=2.5)
    assert out.shape == (1, 50, 75, 3)


# ----------------------------------------------------------------------------------------- frames
@pytest.mark.parametrize("T,expect_padded", [(1, 1), (2, 5), (4, 5), (5, 5), (6, 9)])
def test_frames_padded_to_4n1_and_cropped_back(T, expect_padded):
    vae = FakeVAE()
    frames = const_frames(T, 16, 16)
    out = run(frames, vae=vae, resolution=16, batch_size=9)
    assert [c[2] for c in vae.encode_calls] == [expect_padded]
    assert out.shape == (T, 16, 16, 3)
    torch.testing.assert_close(out, frames, atol=1e-5, rtol=0)


def test_pad_repeats_last_frame():
    x = torch.arange(6.0).reshape(6, 1)
    padded = P.pad_frames_4n1(x)
    assert padded.flatten().tolist() == [0, 1, 2, 3, 4, 5, 5, 5, 5]


def test_identity_pipeline_reproduces_input():
    frames = const_frames(5, 24, 40)
    out = run(frames, resolution=24)
    torch.testing.assert_close(out, frames, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------------------- chunks
def test_plan_chunks():
    assert P.plan_chunks(10, 5, 0) == [(0, 5), (5, 10)]
    assert P.plan_chunks(12, 5, 0) == [(0, 5), (5, 10), (10, 12)]
    assert P.plan_chunks(10, 5, 2) == [(0, 5), (3, 8), (6, 10)]
    assert P.plan_chunks(3, 5, 2) == [(0, 3)]
    assert P.plan_chunks(4, 1, 0) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    for T in range(1, 30):
        for bs, ov in [(5, 1), (5, 4), (9, 3), (13, 12)]:
            ch = P.plan_chunks(T, bs, ov)
            assert ch[0][0] == 0 and ch[-1][1] == T
            assert all(b[0] - a[0] == bs - ov for a, b in zip(ch, ch[1:]))
            assert ch[-1][1] - ch[-1][0] > (ov if len(ch) > 1 else 0)


def test_blend_weights_sum_to_one_and_are_linear():
    chunks = P.plan_chunks(17, 9, 3)
    ws = P.chunk_blend_weights(chunks, 3)
    total = torch.zeros(17)
    for (s, e), w in zip(chunks, ws):
        total[s:e] += w
    torch.testing.assert_close(total, torch.ones(17))
    assert ws[1][:3].tolist() == pytest.approx([0.25, 0.5, 0.75])
    assert ws[0][-3:].tolist() == pytest.approx([0.75, 0.5, 0.25])


def test_chunking_without_overlap_matches_single_chunk():
    frames = const_frames(11, 16, 16)
    dit_a, vae_a = FakeDiT(), FakeVAE()
    a = run(frames, dit=dit_a, vae=vae_a, resolution=16, batch_size=5)
    b = run(frames, resolution=16, batch_size=13)
    assert [c.vid_shape[0][0] for c in dit_a.calls] == [2, 2, 1]  # 5, 5, 1 frames -> 2, 2, 1 latent frames
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    torch.testing.assert_close(a, frames, atol=1e-5, rtol=0)


def test_overlap_is_blended_linearly():
    frames = torch.full((8, 16, 16, 3), 0.2)
    dit = FakeDiT(offset_per_call=0.4)   # chunk k comes out as 0.2 + 0.4 k
    out = run(frames, dit=dit, resolution=16, batch_size=5, temporal_overlap=2)
    assert P.plan_chunks(8, 5, 2) == [(0, 5), (3, 8)]
    per_frame = out[:, 0, 0, 0]
    expect = torch.tensor([0.2, 0.2, 0.2, 0.2 + 0.4 / 3, 0.2 + 0.8 / 3, 0.6, 0.6, 0.6])
    torch.testing.assert_close(per_frame, expect, atol=1e-5, rtol=0)


def test_progress_and_should_stop():
    seen, stops = [], []
    frames = const_frames(9, 16, 16)
    settings = P.UpscaleSettings(resolution=16, batch_size=5, color_correction="none")
    P.upscale(frames, FakeDiT(), FakeVAE(), TXT, settings, progress=lambda d, t: seen.append((d, t)),
              should_stop=lambda: stops.append(1))
    assert seen == [(i, 6) for i in range(1, 7)]
    assert len(stops) >= 6

    class Stop(Exception):
        pass

    calls = []

    def should_stop():
        calls.append(1)
        if len(calls) > 3:
            raise Stop

    with pytest.raises(Stop):
        P.upscale(frames, FakeDiT(), FakeVAE(), TXT, settings, should_stop=should_stop)


def test_hooks_order():
    order = []
    hooks = P.PipelineHooks(before_encode=lambda: order.append("enc"), before_dit=lambda: order.append("dit"),
                            after_dit=lambda: order.append("/dit"), before_decode=lambda: order.append("dec"))
    P.upscale(const_frames(1, 16, 16), FakeDiT(), FakeVAE(), TXT, P.UpscaleSettings(resolution=16), hooks=hooks)
    assert order == ["enc", "dit", "/dit", "dec"]


# ----------------------------------------------------------------------------------------- alpha
def test_alpha_carried_through():
    frames = const_frames(2, 16, 24, C=4)
    frames[:, :8, :, 3] = 1.0
    out = run(frames, resolution=32)
    assert out.shape == (2, 32, 48, 4)
    torch.testing.assert_close(out[..., :3], P.resize_frames(frames[..., :3].permute(0, 3, 1, 2), 32, 48)
                               .permute(0, 2, 3, 1), atol=1e-5, rtol=0)
    assert out[:, :12, :, 3].min() > 0.99 and out[:, 20:, :, 3].max() < 0.26
    assert 0 <= out[..., 3].min() and out[..., 3].max() <= 1


# ----------------------------------------------------------------------------------------- seeds
def test_seed_reproducible_and_different_seeds_differ():
    frames = torch.rand(5, 16, 16, 3, generator=torch.Generator().manual_seed(3))
    outs = []
    for seed in (1, 1, 2):
        dit = FakeDiT()
        run(frames, dit=dit, vae=FakeVAE(logvar=-2.0), resolution=16, seed=seed)
        outs.append((dit.calls[0].noise, P.upscale(frames, FakeDiT(), FakeVAE(logvar=-2.0), TXT,
                                                   P.UpscaleSettings(resolution=16, seed=seed))))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert not torch.equal(outs[0][0], outs[2][0]) and not torch.equal(outs[0][1], outs[2][1])


def test_positive_embedding_is_passed():
    dit = FakeDiT()
    run(const_frames(1, 16, 16), dit=dit, resolution=16)
    assert torch.equal(dit.calls[0].txt, TXT)


# ----------------------------------------------------------------------------------------- tiling
def test_tiled_vae_matches_untiled_on_smooth_input():
    frames = const_frames(1, 64, 96)
    tiled = P.VAETiling(encode="on", decode="on", encode_tile=32, decode_tile=32, overlap=16)
    vae = FakeVAE()
    out = run(frames, vae=vae, resolution=64, tiling=tiled)
    assert len(vae.encode_calls) > 1 and len(vae.decode_calls) > 1
    assert all(c[-1] <= 32 and c[-2] <= 32 for c in vae.encode_calls)
    torch.testing.assert_close(out, frames, atol=1e-5, rtol=0)


def test_plan_is_what_upscale_runs():
    """plan() gives the sizes, chunks and weights upscale() works with (the node sizes its model loads by it)."""
    frames = const_frames(11, 24, 40)
    s = P.UpscaleSettings(resolution=20, batch_size=5, temporal_overlap=2, color_correction="none")
    p = P.plan(frames, s)
    assert p.target == P.compute_target_size(24, 40, 20) == (20, 33) and p.model == (32, 48)
    assert p.chunks == P.plan_chunks(11, 5, 2) and p.chunk_frames == 5 and p.tiling is s.tiling
    dit, vae = FakeDiT(), FakeVAE()
    out = P.upscale(frames, dit, vae, TXT, s)
    assert out.shape == (11, *p.target, 3) and all(c[-2:] == p.model for c in vae.encode_calls)
    assert len(dit.calls) == len(p.chunks)


def test_vae_tiles_follow_the_settings_and_free_memory():
    p = P.plan(torch.zeros(1, 1080, 1920, 3), P.UpscaleSettings(resolution=1080))
    assert p.model == (1088, 1920)
    cfg, bf16 = SEEDVR2_VAE, torch.bfloat16
    none = lambda: None  # noqa: E731 - free memory unknown (CPU)
    assert p.vae_tiles("encode", none, bf16, cfg) == (0, 0)                  # auto, unknown: no tiling
    on = P.plan(torch.zeros(1, 1080, 1920, 3), P.UpscaleSettings(tiling=P.VAETiling(encode="on", decode="on")))
    assert on.vae_tiles("encode", none, bf16, cfg) == ((512, 512), 64)       # on, unknown: 512 px
    assert on.vae_tiles("decode", none, bf16, cfg) == ((64, 64), 8)          # in latents
    (th, tw), ov = on.vae_tiles("decode", lambda: 8 << 30, bf16, cfg)
    assert 0 < th <= 1088 // 8 and 0 < tw <= 1920 // 8 and th * tw < 1088 * 1920 // 64 and ov <= min(th, tw) // 2
    assert p.vae_tiles("decode", lambda: 1 << 50, bf16, cfg) == (0, 0)       # plenty free: one tile = none
    # a frame whose whole-frame estimate fits is one pass, though a square tile of its width would not fit
    whole = estimate_decode_bytes((1088 // 8, 1920 // 8))
    square = estimate_decode_bytes((1920 // 8, 1920 // 8))
    free = int((whole + square) / 2 / 0.8)
    assert p.vae_tiles("decode", lambda: free, bf16, cfg) == (0, 0)
    off = P.plan(torch.zeros(1, 1080, 1920, 3), P.UpscaleSettings(tiling=P.VAETiling(encode="off", encode_tile=256)))
    assert off.vae_tiles("encode", none, bf16, cfg) == (0, 0)


# ----------------------------------------------------------------------------------------- errors
def test_error_zero_frames():
    with pytest.raises(P.SeedVR2InputError, match="0 frames"):
        run(torch.zeros(0, 16, 16, 3))


def test_error_tiny_image():
    with pytest.raises(P.SeedVR2InputError, match="at least"):
        run(torch.zeros(1, 1, 1, 3))


def test_error_output_too_small():
    with pytest.raises(P.SeedVR2InputError, match="output would be"):
        run(torch.zeros(1, 16, 16, 3), resolution=8)


@pytest.mark.parametrize("bs", [0, 2, 4, 6, 8])
def test_error_batch_size_not_4n1(bs):
    with pytest.raises(P.SeedVR2InputError, match="4n\\+1"):
        run(torch.zeros(1, 16, 16, 3), batch_size=bs)


@pytest.mark.parametrize("bs,ov", [(5, 5), (5, -1), (1, 1)])
def test_error_bad_overlap(bs, ov):
    with pytest.raises(P.SeedVR2InputError, match="temporal_overlap"):
        run(torch.zeros(1, 16, 16, 3), batch_size=bs, temporal_overlap=ov)


def test_error_bad_channels_and_dims_and_mode():
    with pytest.raises(P.SeedVR2InputError, match="channels"):
        run(torch.zeros(1, 16, 16, 2))
    with pytest.raises(P.SeedVR2InputError, match="T, H, W, C"):
        run(torch.zeros(16, 16, 3))
    with pytest.raises(P.SeedVR2InputError, match="color_correction"):
        run(torch.zeros(1, 16, 16, 3), color_correction="hsv")
    with pytest.raises(P.SeedVR2InputError, match="pos_emb"):
        P.upscale(torch.zeros(1, 16, 16, 3), FakeDiT(), FakeVAE(), None, P.UpscaleSettings(resolution=16))


def test_error_missing_embeddings(tmp_path):
    model = tmp_path / "seedvr2_ema_3b.safetensors"
    model.write_bytes(b"")
    with pytest.raises(MissingEmbeddingError) as exc:
        load_text_embeddings(str(model))
    msg = str(exc.value)
    assert "pos_emb.pt" in msg and str(tmp_path) in msg


@pytest.mark.parametrize("ext", [".pt", ".safetensors"])
def test_embeddings_load(tmp_path, ext):
    pos, neg = torch.randn(58, 24), torch.randn(64, 24)
    if ext == ".pt":
        torch.save(pos.bfloat16(), tmp_path / "pos_emb.pt")
        torch.save(neg.bfloat16(), tmp_path / "neg_emb.pt")
    else:
        from safetensors.torch import save_file
        save_file({"pos_emb": pos}, str(tmp_path / "pos_emb.safetensors"))
        save_file({"neg_emb": neg}, str(tmp_path / "neg_emb.safetensors"))
    emb = load_text_embeddings(str(tmp_path / "model.safetensors"), expected_dim=24)
    assert emb.positive.shape == (58, 24) and emb.negative.shape == (64, 24)
    assert emb.positive.dtype == torch.float32
    with pytest.raises(ValueError, match="does not match"):
        load_text_embeddings(str(tmp_path / "model.safetensors"), expected_dim=5120)


# ----------------------------------------------------------------------------------------- real tiny models
def _real_models(variant="3b"):
    dit = load_dit(str(GOLDEN / f"dit_{variant}_tiny_weights.safetensors"))
    vae = load_vae(str(GOLDEN / "vae_tiny_weights.safetensors"), norm_num_groups=2)
    return dit, vae


@pytest.mark.parametrize("variant", ["3b", "7b"])
def test_real_dit_step_matches_golden_call(variant):
    """The runner builds vid = [x_t | LQ | 1] and returns x_t - v: check against the golden DiT output."""
    from safetensors.torch import load_file
    dit, vae = _real_models(variant)
    inp = load_file(str(GOLDEN / "dit_case_image_inputs.safetensors"))
    ref = load_file(str(GOLDEN / f"dit_{variant}_case_image_outputs.safetensors"))["out"]
    vid = inp["vid"]  # (1, 36, 52, 33)
    runner = P.SeedVR2Runner(dit, vae, inp["txt"])
    x0 = runner.dit_step(lq_latent=vid[..., 16:32], noise=vid[..., :16])
    expect = vid[..., :16] - ref
    rel = (x0 - expect).norm() / expect.norm()
    assert rel < 1e-5, rel


@pytest.mark.parametrize("variant", ["3b", "7b"])
def test_real_models_image_size_and_seed(variant):
    dit, vae = _real_models(variant)
    frames = torch.rand(1, 20, 30, 3, generator=torch.Generator().manual_seed(5))
    txt = torch.randn(3, 24, generator=torch.Generator().manual_seed(6))
    s = P.UpscaleSettings(resolution=24, seed=7)
    a = P.upscale(frames, dit, vae, txt, s)
    b = P.upscale(frames, dit, vae, txt, s)
    c = P.upscale(frames, dit, vae, txt, P.UpscaleSettings(resolution=24, seed=8))
    assert a.shape == (1, 24, 36, 3) and torch.isfinite(a).all()
    assert 0 <= a.min() and a.max() <= 1
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_real_models_video_chunks_alpha():
    dit, vae = _real_models("3b")
    frames = torch.rand(6, 16, 16, 4, generator=torch.Generator().manual_seed(9))
    out = P.upscale(frames, dit, vae, torch.randn(3, 24),
                    P.UpscaleSettings(resolution=16, batch_size=5, temporal_overlap=1, color_correction="lab"))
    assert out.shape == (6, 16, 16, 4) and torch.isfinite(out).all()
    torch.testing.assert_close(out[..., 3], frames[..., 3])


def test_frame_group_does_not_change_the_result():
    frames = torch.rand(7, 16, 24, 3, generator=torch.Generator().manual_seed(11))
    s = P.UpscaleSettings(resolution=20, batch_size=5, temporal_overlap=2, color_correction="wavelet")
    a = P.upscale(frames, FakeDiT(), FakeVAE(logvar=-3.0), TXT, s, frame_group=1)
    b = P.upscale(frames, FakeDiT(), FakeVAE(logvar=-3.0), TXT, s, frame_group=8)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_seeded_noise_draws_what_each_chunk_drew_once_per_shape():
    """Every chunk draws from a fresh generator of the same seed: the drawn tensors equal that draw, whether
    expected (drawn ahead on a thread) or not, and a shape is drawn once."""
    def fresh(shape, offset):
        return torch.randn(shape, generator=torch.Generator().manual_seed(7 + offset), dtype=torch.float32)
    noise = SeededNoise(7, 1, [(1, 16, 6, 4, 5), (1, 16, 2, 4, 5), (1, 16, 6, 4, 5)])
    a = noise(torch.Size((1, 16, 6, 4, 5)))
    assert torch.equal(a, fresh((1, 16, 6, 4, 5), 1))
    assert noise((1, 16, 6, 4, 5)) is a
    assert torch.equal(noise((1, 16, 2, 4, 5)), fresh((1, 16, 2, 4, 5), 1))
    assert torch.equal(noise((3, 4, 5, 16)), fresh((3, 4, 5, 16), 1))      # a shape nobody expected
    assert torch.equal(SeededNoise(7, 0)((3, 4, 5, 16)), fresh((3, 4, 5, 16), 0))
    assert not torch.equal(noise((3, 4, 5, 16)), fresh((3, 4, 5, 16), 0))


def test_without_a_plan_ndhwc_convs_run_whole_and_the_limit_comes_back():
    """No memory plan on the NDHWC layout: the convs run without the official bands for the run (as a plan would
    choose), with the same output, and the VAE's official limit is back afterwards; NCDHW keeps the bands."""
    from seedvr2bw.models.seedvr2.vae.causal_conv import CausalConv3d
    dit, vae = _real_models("3b")
    frames = torch.rand(5, 16, 16, 3, generator=torch.Generator().manual_seed(9))
    txt = torch.randn(3, 24, generator=torch.Generator().manual_seed(6))
    official = vae.config.conv_max_mem * 2**30
    seen = []

    def limits():
        seen.append({m.max_bytes for m in vae.modules() if isinstance(m, CausalConv3d)})
    hooks = P.PipelineHooks(before_encode=limits, before_decode=limits)
    s = P.UpscaleSettings(resolution=16, batch_size=5)
    vae.channels_last = False
    banded = P.upscale(frames, dit, vae, txt, s, hooks=hooks)
    assert seen == [{official}, {official}]
    vae.channels_last, seen[:] = True, []
    whole = P.upscale(frames, dit, vae, txt, s, hooks=hooks)
    assert seen == [{float("inf")}, {float("inf")}]
    assert {m.max_bytes for m in vae.modules() if isinstance(m, CausalConv3d)} == {official}
    assert torch.allclose(whole, banded, atol=1e-5)
