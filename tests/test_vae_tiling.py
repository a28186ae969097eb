"""Tiling, exact causal temporal slicing, the memory-limited paths and bounded memory of tiled decode.

Spatial tiles of the real VAE are never exact: its per-frame GroupNorm statistics and mid-block attention span the
whole frame. So the tiling engine is checked for exactness on local operations (where tiles don't interact, or
the blend margin covers the receptive field), and on the VAE for: a single tile being bit-identical to the untiled
path, and multi-tile results converging as tiles grow.
"""
import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from seedvr2bw.models.seedvr2.vae import VAEConfig, VAECancelled, VideoAutoencoder
from seedvr2bw.models.seedvr2.vae.autoencoder import temporal_chunks
from seedvr2bw.models.seedvr2.vae import causal_conv
from seedvr2bw.models.seedvr2.vae.causal_conv import CausalConv3d, TemporalCache, conv3d_limited
from seedvr2bw.models.seedvr2.vae.norm import causal_group_norm
from seedvr2bw.models.seedvr2.vae.tiling import blend_weights, decode_tiled, tile_spans


def rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def vae():
    torch.manual_seed(0)
    cfg = VAEConfig(block_out_channels=(4, 8, 8, 8), latent_channels=4, norm_num_groups=2)
    m = VideoAutoencoder(cfg).eval().requires_grad_(False)
    with torch.no_grad():  # livelier than the default init: norm scales near 1, small biases everywhere
        for name, p in m.named_parameters():
            if p.ndim == 1:
                p.copy_((1 + 0.2 * torch.randn_like(p)) if "norm" in name else 0.1 * torch.randn_like(p))
    return m


def smooth(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, c, t, h, w = shape
    x = torch.rand(b, c, t, max(2, h // 8), max(2, w // 8), generator=g) * 2 - 1
    return F.interpolate(x, size=(t, h, w), mode="trilinear")


# ------------------------------------------------------------------------------------------ geometry and blending
@pytest.mark.parametrize("size,tile,overlap", [(10, 4, 1), (37, 8, 3), (16, 16, 4), (17, 16, 4), (5, 8, 2), (64, 20, 6)])
def test_tile_spans_and_weights(size, tile, overlap):
    spans = tile_spans(size, tile, overlap)
    assert spans[0][0] == 0 and spans[-1][1] == size
    for (a0, b0), (a1, b1) in zip(spans, spans[1:]):
        assert b0 - a0 == min(tile, size) and b0 - a1 >= overlap and a1 > a0
    for margin in (0, 1, 2):
        total = torch.zeros(size, dtype=torch.float64)
        ws = blend_weights(spans, size, margin)
        for (a, b), w in zip(spans, ws):
            assert w.shape == (b - a,) and (w >= 0).all()
            total[a:b] += w
        torch.testing.assert_close(total, torch.ones(size, dtype=torch.float64), rtol=0, atol=1e-12)


def test_temporal_chunk_layout():
    assert temporal_chunks(17, 5, 4) == [(0, 5), (5, 9), (9, 13), (13, 17)]
    assert temporal_chunks(5, 5, 4) == [(0, 5)]          # official: slicing only when T - 1 > split
    assert temporal_chunks(3, 2, 1) == [(0, 2), (2, 3)]
    assert temporal_chunks(9, 5, None) == [(0, 9)]


# ------------------------------------------------------------------------------------------ memory-limited paths
@pytest.mark.parametrize("kernel,stride,pad", [((3, 3, 3), (1, 1, 1), (1, 1, 1, 1)), ((3, 3, 3), (2, 2, 2), (0, 1, 0, 1)),
                                               ((1, 3, 3), (1, 2, 2), (0, 1, 0, 1))])
def test_conv_banded_equals_plain(kernel, stride, pad, monkeypatch):
    torch.manual_seed(0)
    x = torch.randn(1, 5, 7, 19, 23)
    w = torch.randn(6, 5, *kernel)
    b = torch.randn(6)
    ref = F.conv3d(F.pad(x, (pad[2], pad[3], pad[0], pad[1])), w, b, stride)
    calls = []
    real = F.conv3d
    monkeypatch.setattr(F, "conv3d", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    out = conv3d_limited(x, w, b, stride, pad, max_bytes=x.numel() * 4 / 6)
    assert len(calls) > 6 and any(s[-1] < x.shape[-1] for s in calls)   # split along H and recursed into W
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_conv_bands_keep_one_sample_under_the_index_limit(monkeypatch):
    """Without a memory limit a conv is still cut into bands when one sample of its input or output would pass
    the 32-bit index limit (torch then leaves cuDNN); the bands give the plain result."""
    torch.manual_seed(0)
    x = torch.randn(2, 4, 5, 17, 13)
    w, b = torch.randn(8, 4, 3, 3, 3), torch.randn(8)
    ref = F.conv3d(F.pad(x, (1, 1, 1, 1)), w, b)
    calls = []
    real = F.conv3d
    monkeypatch.setattr(F, "conv3d", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    conv3d_limited(x, w, b, (1, 1, 1), (1, 1, 1, 1))
    assert len(calls) == 1                                  # under the limit: one call
    calls.clear()
    limit = 8 * 3 * 17 * 13 // 2                             # about half of one sample's output
    monkeypatch.setattr(causal_conv, "INDEX_LIMIT", limit)
    out = conv3d_limited(x, w, b, (1, 1, 1), (1, 1, 1, 1))
    assert len(calls) >= 2
    assert all(s[1] * s[2] * s[3] * s[4] <= limit for s in calls)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limit", [math.inf, 0.0])
def test_group_norm_matches_official_formula(dtype, limit):
    """Official causal_norm_wrapper: rearrange to ((b t) c h w); over norm_max_mem, F.group_norm on 2 (fp32) or
    4 (16-bit) chunks of whole groups. Ours works frame batch by frame batch and must give the same numbers."""
    torch.manual_seed(0)
    norm = torch.nn.GroupNorm(8, 32, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.normal_(1, 0.2), norm.bias.normal_(0, 0.1)
    x = (torch.randn(2, 32, 5, 9, 11) * 3 + 1).to(dtype)
    x4 = x.transpose(1, 2).reshape(10, 32, 9, 11)
    if limit == 0.0:
        n = 4 if dtype == torch.bfloat16 else 2
        ref = torch.cat([F.group_norm(a, 8 // n, w_, b_, 1e-6) for a, w_, b_ in
                         zip(x4.chunk(n, 1), norm.weight.chunk(n), norm.bias.chunk(n))], 1)
    else:
        ref = norm(x4)
    ref = ref.view(2, 5, 32, 9, 11).transpose(1, 2)
    out = causal_group_norm(x, norm, limit, frame_batch_bytes=3 * 32 * 9 * 11 * x.element_size())
    assert torch.equal(out, ref) or rel_l2(out, ref) < 1e-6


# ------------------------------------------------------------------------------------------ exact temporal slicing
@pytest.mark.parametrize("stride", [1, 2])
def test_causal_conv_chunks_exact(stride):
    torch.manual_seed(0)
    conv = CausalConv3d(3, 4, 3, stride=(stride, 1, 1), padding=1).eval()
    x = torch.randn(1, 3, 13, 6, 5)
    with torch.no_grad():
        one = conv(x)
        cache = TemporalCache()
        parts = [conv(x[:, :, a:b], cache) for a, b in [(0, 5), (5, 9), (9, 13)]]
    assert torch.equal(torch.cat(parts, 2), one)


def test_temporal_slicing_exact(vae):
    x = smooth((1, 3, 13, 16, 16))
    try:
        vae.set_causal_slicing(None)
        one = vae.encode(x).mean
        z = torch.randn(1, 4, 4, 2, 3, generator=torch.Generator().manual_seed(1))
        dec_one = vae.decode(z)
        for split in (4, 8):
            vae.set_causal_slicing(split)
            assert rel_l2(vae.encode(x).mean, one) < 1e-6
            assert rel_l2(vae.decode(z), dec_one) < 1e-6
    finally:
        vae.set_causal_slicing(4)
    assert one.shape == (1, 4, 4, 2, 2) and dec_one.shape == (1, 3, 13, 16, 24)


# ------------------------------------------------------------------------------------------ tiling engine, local ops
class LocalDecoder:
    """Stand-in with the decoder's geometry whose output is local: a 3x3 latent conv (receptive field 1 latent,
    zero padded at the frame border) or a pointwise map, then nearest x8 upsampling; frame f of the output comes
    from latent (f + 3) // 4."""
    spatial_factor, temporal_factor, dtype, device = 8, 4, torch.float32, torch.device("cpu")

    def __init__(self, receptive):
        self.config = VAEConfig(out_channels=3)
        self.k = torch.randn(3, 4, 1, 3, 3, generator=torch.Generator().manual_seed(2)) if receptive else None

    def iter_decode(self, z, should_stop=None):
        y = F.conv3d(z, self.k, padding=(0, 1, 1)) if self.k is not None else z[:, :3] * 2 + 1
        y = y[:, :, [(f + 3) // 4 for f in range(4 * (z.shape[2] - 1) + 1)]]
        yield 0, y.repeat_interleave(8, 3).repeat_interleave(8, 4)


def test_tiles_that_do_not_interact_are_exact():
    fake = LocalDecoder(receptive=False)
    z = torch.randn(1, 4, 3, 12, 8)
    ref = next(fake.iter_decode(z))[1]
    assert tile_spans(12, 4, 0) == [(0, 4), (4, 8), (8, 12)]
    assert torch.equal(decode_tiled(fake, z, tile=4, overlap=0), ref)     # disjoint tiles: weights exactly 1
    torch.testing.assert_close(decode_tiled(fake, z, tile=5, overlap=2), ref, rtol=1e-6, atol=1e-6)


def test_overlap_covering_receptive_field_is_exact():
    fake = LocalDecoder(receptive=True)
    z = torch.randn(1, 4, 2, 14, 11)
    ref = next(fake.iter_decode(z))[1]
    out = decode_tiled(fake, z, tile=6, overlap=3, margin=1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # without the margin the tile borders (which lack their neighbour's context) leak into the blend
    assert rel_l2(decode_tiled(fake, z, tile=6, overlap=3, margin=0), ref) > 1e-3


# ------------------------------------------------------------------------------------------ tiling of the VAE
def test_single_tile_is_bit_identical(vae):
    x = smooth((1, 3, 5, 24, 32))
    post = vae.encode(x)
    assert torch.equal(vae.encode_tiled(x, tile=64, overlap=16).mean, post.mean)
    z = post.mean
    assert torch.equal(vae.decode_tiled(z, tile=8, overlap=2), vae.decode(z))


def test_multi_tile_close_and_converging(vae):
    x = smooth((1, 3, 5, 64, 96), seed=3)
    post = vae.encode(x)
    z = post.mean
    ref = vae.decode(z)
    errs = {}
    for tile in (4, 6, 10):
        out = vae.decode_tiled(z, tile=tile, overlap=2)
        assert out.shape == ref.shape and torch.isfinite(out).all()
        errs[tile] = rel_l2(out, ref)
    enc_err = rel_l2(vae.encode_tiled(x, tile=64, overlap=16).mean, post.mean)
    print("tiled decode rel-L2 by tile:", errs, "tiled encode:", enc_err)
    assert errs[10] < errs[4] and errs[10] < 0.5 and enc_err < 0.5
    with pytest.raises(ValueError, match="divisible by 8"):
        vae.encode_tiled(torch.zeros(1, 3, 1, 20, 16), tile=8, overlap=0)


def test_should_stop_cancels(vae):
    z = torch.randn(1, 4, 3, 4, 4)
    calls = []

    def stop_on_second():
        calls.append(1)
        return len(calls) >= 2

    with pytest.raises(VAECancelled):
        vae.decode(z, should_stop=stop_on_second)      # second temporal chunk
    calls.clear()
    with pytest.raises(VAECancelled):
        vae.decode_tiled(z, tile=2, overlap=1, should_stop=stop_on_second)
    calls.clear()
    with pytest.raises(VAECancelled):
        vae.encode(torch.zeros(1, 3, 9, 16, 16), should_stop=stop_on_second)


# ------------------------------------------------------------------------------------------ bounded memory
class LiveBytes(TorchDispatchMode):
    """Peak bytes of CPU tensor storages created by aten ops while active (storages freed when their last
    tracked tensor dies). Kernel-internal scratch is not seen; it is bounded by the conv/norm limits."""

    def __init__(self, ignore=()):
        super().__init__()
        self.refs, self.sizes, self.cur, self.peak = {}, {}, 0, 0

    def _dead(self, key):
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.cur -= self.sizes.pop(key)
            del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                st = t.untyped_storage()
                key = st.data_ptr()
                if key == 0:
                    continue
                if key not in self.refs:
                    self.refs[key], self.sizes[key] = 0, st.nbytes()
                    self.cur += st.nbytes()
                    self.peak = max(self.peak, self.cur)
                self.refs[key] += 1
                weakref.finalize(t, self._dead, key)
        return out


def largest_module_output(vae, fn):
    biggest = [0]
    def seen(m, i, o):      # an up block returns (output, the bias it lacks)
        biggest[0] = max([biggest[0]] + [t.numel() for t in tree_flatten(o)[0] if isinstance(t, torch.Tensor)])
    hooks = [m.register_forward_hook(seen) for m in vae.modules() if m is not vae]
    try:
        out = fn()
    finally:
        for h in hooks:
            h.remove()
    return biggest[0], out


def test_tiled_decode_memory_bounded(vae):
    vae.set_memory_limit(None, None)
    sizes, peaks, untiled = {}, {}, {}
    try:
        for n in (6, 12):
            z = torch.randn(1, 4, 1, n, n, generator=torch.Generator().manual_seed(5))
            sizes[n], _ = largest_module_output(vae, lambda: vae.decode_tiled(z, tile=4, overlap=1))
            untiled[n], _ = largest_module_output(vae, lambda: vae.decode(z))
            with LiveBytes() as lb:
                out = vae.decode_tiled(z, tile=4, overlap=1)
            peaks[n] = lb.peak - out.numel() * out.element_size()   # minus the preallocated result itself
            del out
    finally:
        vae.set_memory_limit(0.5, 0.5)
    print("largest intermediate (elements) tiled:", sizes, "untiled:", untiled, "peak live bytes - output:", peaks)
    assert sizes[12] == sizes[6]               # one tile's working set, whatever the frame size
    assert untiled[12] >= 3.5 * untiled[6]     # while the untiled one grows with the area
    assert peaks[12] <= 1.25 * peaks[6]


