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
