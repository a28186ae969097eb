"""SDPA kernel order for code that calls F.scaled_dot_product_attention directly (FLUX training)."""
import pytest
import torch

from seedvr2bw.optimization.attention import sdpa_priority as sp


def test_cpu_keeps_torch_order(monkeypatch):
    monkeypatch.delenv(sp.ENV, raising=False)
    backends, why = sp.preferred_backends("cpu")
    assert backends is None and "CPU" in why
    with sp.sdpa_priority(backends):   # no-op context
        q = torch.randn(1, 2, 8, 16)
        assert torch.allclose(torch.nn.functional.scaled_dot_product_attention(q, q, q),
                              torch.softmax(q @ q.transpose(-1, -2) / 4, -1) @ q, atol=1e-5)


def test_bad_override_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv(sp.ENV, "fastest")
    with pytest.raises(ValueError, match=r"SEEDVR2BW_SDPA='fastest'.*auto, cudnn, flash, default"):
        sp.preferred_backends("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs on the device machine)")
def test_cuda_order_and_values(monkeypatch):
    from torch.nn.attention import SDPBackend
    monkeypatch.setenv(sp.ENV, "auto")
    backends, why = sp.preferred_backends("cuda")
    ok, _ = sp.cudnn_selftest(torch.cuda.current_device())
    assert (backends is not None and backends[0] == SDPBackend.CUDNN_ATTENTION) == ok, why
    q, k, v = (torch.randn(1, 24, 1280, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with sp.sdpa_priority(backends):
        got = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-2
    monkeypatch.setenv(sp.ENV, "flash")
    assert sp.preferred_backends("cuda")[0] is None
