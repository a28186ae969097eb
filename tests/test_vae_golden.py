"""fp32 parity of the SeedVR2 VAE against the official implementation's golden vectors (manifest.json, vae_call).

The golden tensors were produced with the pipeline settings (causal slicing split_size=4, conv/norm memory limits
0.5 GiB); one pass differs from them by ~1e-7. Tolerance: rel-L2 <= 1e-5 (manifest tolerance_advice).
"""
import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import DATA
from seedvr2bw.models.seedvr2.vae import VAEConfig, build_vae
from seedvr2bw.models.seedvr2.vae.causal_conv import CausalConv3d
from seedvr2bw.optimization.runtime import knobs

GOLDEN = DATA / "golden"
TOL = 1e-5


def rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def manifest():
    return json.loads((GOLDEN / "manifest.json").read_text())


@pytest.fixture(scope="module")
def vae(manifest):
    kw = manifest["vae"]["constructor_kwargs"]
    sd = load_file(str(GOLDEN / manifest["vae"]["weights_file"]))
    model = build_vae(sd, norm_num_groups=kw["norm_num_groups"])
    assert model.config.block_out_channels == tuple(kw["block_out_channels"])
    assert model.config.latent_channels == kw["latent_channels"]
    assert model.config.temporal_scale_num == kw["temporal_scale_num"]
    assert model.config.split_size == kw["slicing_sample_min_size"]
    assert sum(p.numel() for p in model.parameters()) == manifest["vae"]["num_parameters"]
    return model


# (split_size, conv_max_mem GiB, norm_max_mem GiB): the pipeline mode of the golden run, one pass without limits,
# and tiny limits that force the banded conv path (recursing into W) and the group-chunked GroupNorm.
MODES = {
    "pipeline": (4, 0.5, 0.5),
    "one_pass": (None, None, None),
    "tiny_mem_limits": (4, 1e-5, 1e-7),
}


def _assert_channels_last(module, args):
    x = args[0]
    assert x.is_contiguous(memory_format=torch.channels_last_3d) and not x.is_contiguous(), \
        f"{type(module).__name__} got an NCDHW input {tuple(x.stride())}"
    # its weight too (VideoAutoencoder.store_weights): no converted copy per call
    assert module.weight.is_contiguous(memory_format=torch.channels_last_3d), type(module).__name__


def _assert_ncdhw_weight(module, args):
    assert module.weight.is_contiguous(), type(module).__name__


@pytest.mark.parametrize("head_sum", [None, True])
@pytest.mark.parametrize("layout", ["ncdhw", "ndhwc"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", ["video", "image"])
def test_golden(vae, manifest, case, mode, layout, head_sum):
    """Both activation layouts give the official numbers; the channels-last one keeps NDHWC from the first conv
    to the last (every conv, the upsamplers' depth-to-space, the bands, the causal frames, the GroupNorms). So does
    the first chunk with its replicated frame's temporal taps summed (SEEDVR2BW_VAE_HEAD_SUM, on GPUs in 16 bits)."""
    with knobs.override(VAE_HEAD_SUM=head_sum):
        _golden(vae, manifest, case, mode, layout)


def _golden(vae, manifest, case, mode, layout):
    split, conv_mem, norm_mem = MODES[mode]
    vae.set_causal_slicing(split)
    vae.set_memory_limit(conv_mem, norm_mem)
    vae.channels_last = layout == "ndhwc"
    check = _assert_channels_last if layout == "ndhwc" else _assert_ncdhw_weight
    hooks = [m.register_forward_pre_hook(check) for m in vae.modules() if isinstance(m, CausalConv3d)]
    try:
        info = manifest["vae"]["cases"][case]
        d = load_file(str(GOLDEN / info["file"]))
        post = vae.encode(d["x"])
        assert list(post.mean.shape) == info["latent_shape"]
        r_mean, r_logvar = rel_l2(post.mean, d["posterior_mean"]), rel_l2(post.logvar, d["posterior_logvar"])
        z = d["z"]
        if case == "image":  # the official wrapper squeezes T = 1: decode a 4-D latent, get a 4-D image
            z = z.squeeze(2)
        decoded = vae.decode(z)
        assert list(decoded.shape) == info["decoded_shape"]
        r_dec = rel_l2(decoded, d["decoded"])
        print(f"{case}/{mode}: mean {r_mean:.2e} logvar {r_logvar:.2e} decoded {r_dec:.2e}")
        assert r_mean <= TOL and r_logvar <= TOL and r_dec <= TOL, (r_mean, r_logvar, r_dec)
        # mean, logvar = vae.encode(x) works too
        mean, logvar = post
        assert mean is post.mean and logvar is post.logvar
    finally:
        for h in hooks:
            h.remove()
        vae.channels_last = None
        vae.set_causal_slicing(4)
        vae.set_memory_limit(0.5, 0.5)


def test_latent_distribution_sample(vae):
    d = load_file(str(GOLDEN / "vae_case_image.safetensors"))
    post = vae.encode(d["x"])
    g = torch.Generator().manual_seed(0)
    s = post.sample(g)
    noise = torch.randn(post.mean.shape, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(s, post.mean + torch.exp(0.5 * post.logvar) * noise)
    assert post.mode() is post.mean
    assert vae.scaling_factor == pytest.approx(0.9152)


def test_rejects_bad_frame_count(vae):
    with pytest.raises(ValueError, match="4n \\+ 1"):
        vae.encode(torch.zeros(1, 3, 4, 16, 16))


def test_config_defaults_are_official():
    c = VAEConfig()
    assert c.block_out_channels == (128, 256, 512, 512) and c.norm_num_groups == 32 and c.latent_channels == 16
    assert c.spatial_factor == 8 and c.temporal_factor == 4 and c.split_size == 4


def test_batch_of_two_matches_golden(vae):
    """B > 1: every per-frame loop (GroupNorm, attention, depth-to-space) must keep samples apart."""
    d = load_file(str(GOLDEN / "vae_case_video.safetensors"))
    x = torch.cat([d["x"], -d["x"].flip(-1)])
    post = vae.encode(x)
    assert rel_l2(post.mean[:1], d["posterior_mean"]) <= TOL
    assert rel_l2(post.mean[1:], vae.encode(x[1:]).mean) <= TOL
    z = torch.cat([d["z"], d["z"].flip(-2)])
    out = vae.decode(z)
    assert rel_l2(out[:1], d["decoded"]) <= TOL
    assert rel_l2(out[1:], vae.decode(z[1:])) <= TOL


def test_tiled_channels_last_equals_ncdhw(vae, manifest):
    d = load_file(str(GOLDEN / manifest["vae"]["cases"]["video"]["file"]))
    out = {}
    for on in (False, True):
        vae.channels_last = on
        try:
            out[on] = (vae.encode_tiled(d["x"], tile=24, overlap=8).mean, vae.decode_tiled(d["z"], tile=4, overlap=2))
        finally:
            vae.channels_last = None
    assert rel_l2(out[True][0], out[False][0]) < 1e-6 and rel_l2(out[True][1], out[False][1]) < 1e-6
    assert out[True][1].is_contiguous() and out[True][0].is_contiguous()
