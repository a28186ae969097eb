"""scripts/bench_vae.py's FLOP count (torch's FlopCounterMode on a meta-device VAE, no memory or compute): the
720p x 21 convolution totals the issue measured with hooks on the real model, and tiling's overlap adds work."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_vae as BV  # noqa: E402
from seedvr2bw.models.seedvr2.vae import SEEDVR2_VAE  # noqa: E402


def test_conv_flops_of_a_720p_clip():
    dec = BV.count_flops(SEEDVR2_VAE, torch.bfloat16, "decode", (1, 16, 6, 90, 160), False, 64, 8)
    enc = BV.count_flops(SEEDVR2_VAE, torch.bfloat16, "encode", (1, 3, 21, 720, 1280), False, 512, 64)
    assert abs(dec["conv"] / 460e12 - 1) < 0.01 and abs(enc["conv"] / 175e12 - 1) < 0.01, (dec, enc)
    assert dec["total"] > dec["conv"] and enc["total"] > enc["conv"]     # attention and linears counted too
    tiled = BV.count_flops(SEEDVR2_VAE, torch.bfloat16, "decode", (1, 16, 6, 90, 160), True, 64, 8)
    assert tiled["conv"] > dec["conv"]                                     # the tiles' overlaps are computed twice


def test_no_matmul_peak_without_a_gpu():
    assert BV.matmul_peak_tflops("cpu") is None


def test_planned_tiles_are_the_memory_plans():
    # --budgets times the tiles a run that may use B GiB gets: tiled at 8 GiB, one pass on an 80 GB card
    with torch.device("meta"):
        vae = BV.VideoAutoencoder(SEEDVR2_VAE).to(torch.bfloat16)
    enc8, dec8, _ = BV.planned_tiles(vae, 1920, 1080, 21, 8)
    assert enc8 != (0, 0) and dec8 != (0, 0)          # ((tile h, tile w), overlap); (0, 0): one pass
    enc80, dec80, _ = BV.planned_tiles(vae, 1280, 720, 21, 80)
    assert enc80 == (0, 0) and dec80 == (0, 0)
    # a planned tile is an (h, w) pair: the FLOP count takes it as the timed call does
    (tile, overlap) = BV.planned_tiles(vae, 1280, 720, 21, 8)[1]
    tiled = BV.count_flops(SEEDVR2_VAE, torch.bfloat16, "decode", (1, 16, 6, 90, 160), True, tile, overlap)
    whole = BV.count_flops(SEEDVR2_VAE, torch.bfloat16, "decode", (1, 16, 6, 90, 160), False, 0, 0)
    assert whole["conv"] < tiled["conv"] < 1.3 * whole["conv"]
