"""The whole upscale sequence parallel (``pipeline.upscale(..., group=...)``: the DiT's windows and the VAE's rows
split over the ranks) on 2 and 3 CPU processes over gloo, with the golden tiny 7B and VAE: every rank returns the
single-process output within fp32 rounding, for a clip and a still, and
for a still too small to split (every rank then runs the whole step); a stop asked by one rank stops
every rank with SeedVR2Cancelled, in the DiT step and in the VAE."""
from __future__ import annotations

import pytest
import torch

from conftest import DATA
from gloo_ranks import run_ranks
from seedvr2bw.models.seedvr2 import pipeline as P
from seedvr2bw.models.seedvr2.dit.loader import load_dit
from seedvr2bw.models.seedvr2.vae import load_vae

GOLDEN = DATA / "golden"
TOL = 1e-4          # pixels in [0, 1]; the DiT and the VAE each differ from one process by ~1e-6 relative


def _models():
    dit = load_dit(str(GOLDEN / "dit_7b_tiny_weights.safetensors"), attention_backend="sdpa")
    return dit, load_vae(str(GOLDEN / "vae_tiny_weights.safetensors"), norm_num_groups=2)


def _cases():
    g = torch.Generator().manual_seed(0)
    txt = torch.randn(3, 24, generator=g)
    # the clip's 3 latent frames give 3 DiT windows, the still's 36 x 52 latents 4: split over the ranks; the small
    # still has 1 window and 16 pixel rows (2 latent rows): every rank runs its whole DiT step, and at 3 ranks its
    # whole VAE calls too
    return txt, {"clip": (torch.rand(9, 40, 56, 3, generator=g), P.UpscaleSettings(resolution=80, batch_size=9)),
                 "still": (torch.rand(1, 144, 208, 3, generator=g), P.UpscaleSettings(resolution=288)),
                 "small": (torch.rand(1, 8, 12, 3, generator=g), P.UpscaleSettings(resolution=16))}


def _on_rank(rank, world):
    import torch.distributed as dist
    dit, vae = _models()
    txt, cases = _cases()
    out = {}
    for name, (frames, settings) in cases.items():
        out[name] = P.upscale(frames, dit, vae, txt, settings, group=dist.group.WORLD)
    for phase, at in (("dit", 4), ("vae", 2)):      # the last rank asks to stop at its at-th check
        calls = [0]

        def stop():
            calls[0] += 1
            return rank == world - 1 and calls[0] >= at
        try:
            P.upscale(cases["clip"][0], dit, vae, txt, cases["clip"][1], group=dist.group.WORLD, should_stop=stop)
            out[f"stopped_{phase}"] = torch.tensor([0])
        except P.SeedVR2Cancelled:
            out[f"stopped_{phase}"] = torch.tensor([1])
    return out


@pytest.fixture(scope="module", params=[2, 3])
def ranks(request, tmp_path_factory):
    world = request.param
    return world, run_ranks(_on_rank, world, tmp_path_factory.mktemp(f"sp_upscale{world}"))


@pytest.fixture(scope="module")
def single():
    dit, vae = _models()
    txt, cases = _cases()
    return {name: P.upscale(frames, dit, vae, txt, settings) for name, (frames, settings) in cases.items()}


@pytest.mark.parametrize("case", ["clip", "still", "small"])
def test_sequence_parallel_upscale_equals_one_process(ranks, single, case):
    world, results = ranks
    out, ref = results[0][case], single[case]
    for r in range(1, world):
        assert torch.equal(results[r][case], out)
    assert out.shape == ref.shape
    diff = float((out - ref).abs().max())
    print(f"{world} ranks, {case} {tuple(out.shape)}: largest pixel difference {diff:.2e}")
    assert diff <= TOL


@pytest.mark.parametrize("phase", ["dit", "vae"])
def test_one_rank_asking_to_stop_stops_every_rank(ranks, phase):
    world, results = ranks
    assert all(int(results[r][f"stopped_{phase}"]) == 1 for r in range(world))
