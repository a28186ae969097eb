"""Every attention backend agrees with the reference (per-segment SDPA) on packed variable-length input."""
import math

import pytest
import torch

from seedvr2bw.optimization.attention import (
    BACKENDS,
    available_backends,
    backend_unavailable_reason,
    make_varlen_plan,
    resolve_backend,
    varlen_attention,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _packed(lens, heads=3, dim=32, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    q, k, v = (torch.randn(n, heads, dim, generator=g).to(device=device, dtype=dtype) for _ in range(3))
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=device)
    return q, k, v, cu, max(lens)


def _naive(q, k, v, cu):
    """Independent oracle: explicit softmax per segment in float64."""
    out = torch.empty_like(q, dtype=torch.float64)
    c = cu.tolist()
    for a, b in zip(c[:-1], c[1:]):
        qs, ks, vs = (t[a:b].double().transpose(0, 1) for t in (q, k, v))
        w = torch.softmax(qs @ ks.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1)
        out[a:b] = (w @ vs).transpose(0, 1)
    return out


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


# window-like layout: many equal segments, a few odd ones, one of length 1
LENS = [40, 40, 40, 17, 40, 9, 17, 1, 40]


def test_reference_matches_naive():
    q, k, v, cu, m = _packed(LENS)
    out = varlen_attention(q, k, v, cu, cu, m, m, backend="reference")
    assert rel(out, _naive(q, k, v, cu)) < 1e-6


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_backend_agrees_with_reference(backend):
    why = backend_unavailable_reason(backend, DEVICE)
    if why:
        pytest.skip(why)
    half = backend in ("flash_attn", "sage", "torch_varlen")
    dtype = torch.bfloat16 if half else torch.float32
    q, k, v, cu, m = _packed(LENS, dtype=dtype, device=DEVICE)
    ref = varlen_attention(q.float(), k.float(), v.float(), cu, cu, m, m, backend="reference")
    out = varlen_attention(q, k, v, cu, cu, m, m, backend=backend)
    assert out.shape == q.shape and out.dtype == q.dtype
    tol = 3e-2 if backend == "sage" else (1e-2 if half else 1e-6)
    assert rel(out, ref) < tol


def test_sdpa_with_plan_and_cross_lengths():
    # q and k segment lengths differ (cross attention layout); includes an empty query segment
    g = torch.Generator().manual_seed(1)
    lq, lk = [5, 5, 0, 7], [9, 9, 3, 4]
    q = torch.randn(sum(lq), 2, 16, generator=g)
    k = torch.randn(sum(lk), 2, 16, generator=g)
    v = torch.randn(sum(lk), 2, 16, generator=g)
    cq = torch.tensor([0, 5, 10, 10, 17], dtype=torch.int32)
    ck = torch.tensor([0, 9, 18, 21, 25], dtype=torch.int32)
    ref = varlen_attention(q, k, v, cq, ck, 7, 9, backend="reference")
    plan = make_varlen_plan(cq, ck)
    assert len(plan.groups) == 2  # (5, 9) twice -> one batched call; (7, 4); the empty one is dropped
    out = varlen_attention(q, k, v, cq, ck, 7, 9, backend="sdpa", plan=plan)
    assert rel(out, ref) < 1e-6
    assert rel(varlen_attention(q, k, v, cq, ck, 7, 9, backend="sdpa"), ref) < 1e-6


def test_single_segment_is_a_view():
    q, k, v, cu, m = _packed([64])
    plan = make_varlen_plan(cu, cu)
    assert plan.groups[0].q_start == 0
    ref = varlen_attention(q, k, v, cu, cu, m, m, backend="reference")
    assert rel(varlen_attention(q, k, v, cu, cu, m, m, backend="sdpa", plan=plan), ref) < 1e-6


def test_resolve_and_available():
    assert resolve_backend("auto", "cpu") == "sdpa"
    assert "sdpa" in available_backends("cpu") and "reference" in available_backends("cpu")
    assert "flash_attn" not in available_backends("cpu")
    with pytest.raises(RuntimeError, match="flash_attn"):
        resolve_backend("flash_attn", "cpu")
    assert "unknown" in backend_unavailable_reason("nope", "cpu")
    if torch.cuda.is_available():
        assert resolve_backend("auto", "cuda") in ("flash_attn", "torch_varlen", "sdpa")
        if backend_unavailable_reason("flash_attn", "cuda") is None:
            assert resolve_backend("auto", "cuda") == "flash_attn"


def test_bad_shapes_are_rejected():
    q = torch.randn(4, 8)
    with pytest.raises(ValueError, match="tokens, heads, head_dim"):
        varlen_attention(q, q, q, torch.tensor([0, 4]), torch.tensor([0, 4]), 4, 4, backend="sdpa")
