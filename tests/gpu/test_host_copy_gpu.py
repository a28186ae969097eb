"""GPU: device -> host copies through pinned pieces equal a plain copy. Skips without CUDA."""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_copy_to_host_through_pinned_pieces():
    from seedvr2bw.optimization.runtime.host_copy import PIECE_BYTES, copy_to_host
    g = torch.Generator(device="cuda").manual_seed(0)
    src = torch.randn(5, 3, 1111, 2049, device="cuda", generator=g).permute(0, 2, 3, 1)   # not contiguous
    assert src.numel() * 4 > 3 * PIECE_BYTES
    dst = torch.empty(src.shape)
    assert copy_to_host(dst, src) is dst and torch.equal(dst, src.cpu())
    small = torch.randn(3, 7, device="cuda", generator=g)       # under one piece: a plain copy_
    assert torch.equal(copy_to_host(torch.empty(3, 7), small), small.cpu())
