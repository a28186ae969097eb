"""The VAE split by rows over 2 and 3 CPU processes (gloo): encode and decode of the golden tiny VAE equal the
single-process VAE within fp32 rounding on every rank, for a video (time chunks and their causal cache) and an
image; bands are cut on whole rows of every resolution."""
from __future__ import annotations

import pytest
import torch

from conftest import DATA
from gloo_ranks import run_ranks
from seedvr2bw.models.seedvr2.vae.loader import load_vae
from seedvr2bw.models.seedvr2.vae.row_parallel import bands

WEIGHTS = DATA / "golden" / "vae_tiny_weights.safetensors"
TOL = 2e-5          # relative to the largest output value: statistics and attention summed in another order


def _vae():
    return load_vae(WEIGHTS, norm_num_groups=2)


def _inputs():
    g = torch.Generator().manual_seed(0)
    return {"video_x": torch.rand(1, 3, 9, 56, 40, generator=g) * 2 - 1,
            "image_x": torch.rand(1, 3, 1, 72, 48, generator=g) * 2 - 1,
            "video_z": torch.randn(1, 16, 3, 7, 5, generator=g),
            "image_z": torch.randn(1, 16, 1, 9, 6, generator=g)}


def _on_rank(rank, world, channels_last=False):
    from seedvr2bw.models.seedvr2.vae.row_parallel import decode_rows, encode_rows
    vae, inp, out = _vae(), _inputs(), {}
    vae.channels_last = channels_last
    with torch.no_grad():
        for case in ("video", "image"):
            out[f"{case}.encode"] = encode_rows(vae, inp[f"{case}_x"]).moments
            out[f"{case}.decode"] = decode_rows(vae, inp[f"{case}_z"])
    return out


def _on_rank_ndhwc(rank, world):
    return _on_rank(rank, world, channels_last=True)


@pytest.fixture(scope="module", params=[(2, "ncdhw"), (3, "ncdhw"), (2, "ndhwc")], ids=str)
def ranks(request, tmp_path_factory):
    world, layout = request.param
    fn = _on_rank_ndhwc if layout == "ndhwc" else _on_rank
    return world, run_ranks(fn, world, tmp_path_factory.mktemp(f"vae_rows{world}{layout}"))


@pytest.fixture(scope="module")
def single():
    vae, inp = _vae(), _inputs()
    with torch.no_grad():
        return {f"{c}.encode": vae.encode(inp[f"{c}_x"]).moments for c in ("video", "image")} | \
               {f"{c}.decode": vae.decode(inp[f"{c}_z"]) for c in ("video", "image")}


@pytest.mark.parametrize("what", ["video.encode", "video.decode", "image.encode", "image.decode"])
def test_row_split_equals_one_process(ranks, single, what):
    world, results = ranks
    ref, out = single[what], results[0][what]
    for r in range(1, world):
        assert torch.equal(results[r][what], out), "every rank returns the same whole output"
    assert out.shape == ref.shape
    rel = float((out - ref).abs().max()) / float(ref.abs().max())
    print(f"{world} ranks, {what}: largest difference {rel:.2e} of the largest value")
    assert rel <= TOL


def test_bands_cover_every_row_on_whole_units():
    assert bands(56, 3, 8) == [(0, 16), (16, 40), (40, 56)]
    assert bands(7, 2) == [(0, 4), (4, 7)]
    for rows, world, unit in [(1080, 4, 8), (30, 3, 1), (17, 2, 8)]:
        b = bands(rows, world, unit)
        assert b[0][0] == 0 and b[-1][1] == rows and all(a1 == b0 for (_, a1), (b0, _) in zip(b, b[1:]))
        assert all(a % unit == 0 and a1 > a for a, a1 in b)
    with pytest.raises(ValueError, match="fewer GPUs"):
        bands(16, 3, 8)


def _band_moments(rank, world):
    """Each rank's band of a frame's rows: its (mean, M2) per (sample, group, frame), gathered and merged as the
    fused GroupNorm's ``combine`` does."""
    from seedvr2bw.models.seedvr2.vae.row_parallel import split_rows, current
    from seedvr2bw.optimization.fused.reference import merge_moments
    x = torch.randn(2, 8, 3, 13, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64).float() * 3 + 2
    r0, r1 = bands(13, world)[rank]
    xg = x[..., r0:r1, :].reshape(2, 4, 2, 3, r1 - r0, 5).permute(0, 1, 3, 2, 4, 5).reshape(24, -1)
    local = torch.stack([xg.mean(1), (xg - xg.mean(1, keepdim=True)).square().sum(1)], dim=1)
    with split_rows():
        part, counts = current().gather_moments(local, xg.shape[1])
    return {"mean": merge_moments(part, counts)[0], "m2": merge_moments(part, counts)[1], "counts": counts}


@pytest.mark.parametrize("world", [2, 3])
def test_gathered_band_moments_give_the_frames_statistics(world, tmp_path):
    got = run_ranks(_band_moments, world, tmp_path)
    x = torch.randn(2, 8, 3, 13, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64).float() * 3 + 2
    xg = x.reshape(2, 4, 2, 3, 13, 5).permute(0, 1, 3, 2, 4, 5).reshape(24, -1)
    for r in got.values():
        assert r["counts"].tolist() == [2.0 * (b - a) * 5 for a, b in bands(13, world)]
        torch.testing.assert_close(r["mean"], xg.mean(1), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(r["m2"], (xg - xg.mean(1, keepdim=True)).square().sum(1), rtol=1e-5, atol=1e-5)
