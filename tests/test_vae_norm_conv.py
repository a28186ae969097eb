"""norm_silu_conv (models/seedvr2/vae/norm.py): the normalised frames written behind the causal conv's prefix give
the same result, bit for bit, as normalising and then letting the conv extend its input, in both layouts, for the
first chunk (replicated head frames) and a later one (the previous chunk's memory)."""
import pytest
import torch

from seedvr2bw.models.seedvr2.vae.causal_conv import CausalConv3d, TemporalCache
from seedvr2bw.models.seedvr2.vae.norm import causal_group_norm, norm_silu_conv


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last_3d])
def test_norm_silu_conv_equals_norm_then_conv(layout):
    torch.manual_seed(0)
    norm = torch.nn.GroupNorm(4, 8, eps=1e-6)
    torch.nn.init.normal_(norm.weight)
    torch.nn.init.normal_(norm.bias)
    conv = CausalConv3d(8, 6, 3, padding=1)
    chunks = [torch.randn(1, 8, t, 6, 7).contiguous(memory_format=layout) for t in (5, 4)]
    ref_cache, new_cache = TemporalCache(), TemporalCache()
    for x in chunks:
        ref = conv(causal_group_norm(x, norm, silu=True), ref_cache)
        got = norm_silu_conv(x, norm, conv, new_cache)
        assert torch.equal(got, ref)
        assert got.is_contiguous(memory_format=layout)
        ref_cache.next_chunk()
        new_cache.next_chunk()
    assert torch.equal(new_cache.get(conv), ref_cache.get(conv))   # the memory the next chunk would get


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_sum_conv_equals_the_replicated_head(dtype):
    """head_sum_conv: the conv of [f0, f0, f0, f1, ...] from [f0, f0, f1, ...], frame 0 through the summed temporal
    taps (a high and a low 16-bit part): float32 within the order of its sums; bfloat16 no further from the float32
    conv than the conv of the replicated frames is (its sum of taps is not rounded to one 16-bit weight)."""
    from seedvr2bw.models.seedvr2.vae.causal_conv import head_sum_conv
    g = torch.Generator().manual_seed(0)
    for t in (1, 4):
        x = torch.randn(1, 16, t, 5, 6, generator=g).to(dtype)
        w = (torch.randn(8, 16, 3, 3, 3, generator=g) * 0.3).to(dtype)
        b = torch.randn(8, generator=g).to(dtype)
        three = torch.cat([x[:, :, :1], x[:, :, :1], x], 2)
        want = torch.nn.functional.conv3d(three.float(), w.float(), b.float(), padding=(0, 1, 1))
        plain = torch.nn.functional.conv3d(three, w, b, padding=(0, 1, 1))
        got = head_sum_conv(three[:, :, 1:], w, b, (1, 1, 1), (0, 1, 1))
        assert got.shape == want.shape and got.dtype == dtype
        err, floor = ((got.float() - want).norm() / want.norm()).item(), ((plain.float() - want).norm() / want.norm()).item()
        assert err <= (1e-6 if dtype == torch.float32 else 1.01 * floor), (t, err, floor)


def test_first_chunk_head_sum_through_the_model_paths():
    """SEEDVR2BW_VAE_HEAD_SUM on: one replicated frame in the causal convs' input at the first chunk (the input buffer,
    the conv's own extension), and the next chunk's memory as before: the first chunks of norm_silu_conv and of a
    plain conv call equal the float32 conv of the replicated frames, and so does the chunk after."""
    from seedvr2bw.optimization.runtime import knobs
    torch.manual_seed(0)
    norm = torch.nn.GroupNorm(4, 8, eps=1e-6)
    conv = CausalConv3d(8, 6, 3, padding=1)
    x = torch.randn(1, 8, 7, 6, 5)
    with torch.no_grad():
        want = conv(causal_group_norm(x, norm, silu=True))          # one pass, two replicated frames
        with knobs.override(VAE_HEAD_SUM=True):
            assert conv.sums_head()
            cache, parts = TemporalCache(), []
            for a, b in ((0, 3), (3, 7)):
                parts.append(norm_silu_conv(x[:, :, a:b], norm, conv, cache))
                cache.next_chunk()
            assert cache.get(conv).shape[2] == 2
            whole = conv(causal_group_norm(x, norm, silu=True))
    assert (torch.cat(parts, 2) - want).abs().max() < 1e-5 and (whole - want).abs().max() < 1e-5
