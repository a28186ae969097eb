"""The memory plan of a run (models/seedvr2/memory.py) on a fake device of B GiB: what it decides at each budget,
that what it puts on the GPU fits the budget, and the error when nothing fits."""
import pytest
import torch

from seedvr2bw.models.seedvr2 import pipeline as P
from seedvr2bw.models.seedvr2.memory import (DiTFootprint, MemoryPlan, SeedVR2MemoryError, dit_activation_bytes,
                                             dit_tokens, margin_bytes, plan_memory)

GiB = 1 << 30
MiB = 1 << 20
HOST = 64 * GiB
# the 7B DiT: 36 blocks of 453 MiB in bf16 (3.55x less as NVFP4, which holds a 1-byte-per-weight FP8 copy on fp8_speed)
BF16_7B = DiTFootprint((453 * MiB,) * 36, (0,) * 36, 200 * MiB, 3072)
NVFP4_7B = DiTFootprint((128 * MiB,) * 36, (227 * MiB,) * 36, 60 * MiB, 3072, nvfp4=True)
BF16_3B = DiTFootprint((248 * MiB,) * 32, (0,) * 32, 150 * MiB, 2560)
FP8_7B = DiTFootprint((220 * MiB,) * 36, (0,) * 36, 100 * MiB, 3072, scratch=72 * MiB)
VAE = 500 * MiB


def frames(n, h=360, w=640):
    return torch.zeros(n, h, w, 3)


def mem(n=21, res=720, dit=BF16_7B, budget=8, h=360, w=640, **kw):
    s = P.UpscaleSettings(resolution=res, batch_size=P.next_4n1(n), **kw)
    run = P.plan(frames(n, h, w), s)
    return run, plan_memory(run, s, dit, VAE, None if budget is None else int(budget * GiB), host_available=HOST)


def on_gpu(run, m: MemoryPlan, dit=BF16_7B):
    """Bytes of each phase by the plan's own accounting, to hold against the budget: the DiT step keeps room for
    cached-but-unusable memory in proportion to its activations (measured up to 0.7x on an H100)."""
    dit_phase = m.dit_gpu_bytes + m.dit_activation_bytes + max(margin_bytes(m.budget),
                                                                0.7 * m.dit_activation_bytes)
    return max(dit_phase, VAE + max(m.vae_peak_bytes) + margin_bytes(m.budget))


@pytest.mark.parametrize("dit", [BF16_7B, NVFP4_7B, BF16_3B, FP8_7B], ids=["7b-bf16", "7b-nvfp4", "3b-bf16", "7b-fp8"])
@pytest.mark.parametrize("budget", [6, 8, 12, 16, 24, 32])
@pytest.mark.parametrize("case", [(21, 720), (1, 1080), (21, 1080)])
def test_every_budget_from_6_to_32_gib_gets_a_plan_that_fits(dit, budget, case):
    n, res = case
    run, m = mem(n, res, dit, budget)
    assert on_gpu(run, m, dit) <= budget * GiB, m.line()
    assert m.settings.batch_size <= P.next_4n1(n)
    assert "memory plan" in m.line()


def test_big_gpu_keeps_everything_resident_and_one_pass():
    run, m = mem(budget=80)
    assert m.swapped == () and m.encode_tiles == (0, 0) and m.decode_tiles == (0, 0)
    assert m.settings.batch_size == 21 and m.vae_stays and m.nvfp4_path is None


def test_smaller_budget_streams_more_blocks_and_tiles():
    counts = [len(mem(budget=b)[1].swapped) for b in (32, 16, 12, 8, 6)]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] > 20
    _, m8 = mem(budget=8)
    assert m8.decode_tiles != (0, 0)                          # 720p decode does not fit 8 GiB in one pass


def test_fp8_copies_of_nvfp4_are_counted():
    """The default NVFP4 path on Hopper/Ada keeps an FP8 copy per resident layer: 12 GiB cannot hold all 36 blocks
    (4.6 GiB stored + 8 GiB derived), which is what ran out of memory before."""
    _, m = mem(dit=NVFP4_7B, budget=12)
    assert 0 < len(m.swapped) < 36 and m.nvfp4_path is None
    assert m.dit_gpu_bytes + m.dit_activation_bytes + margin_bytes(m.budget) <= 12 * GiB


def test_the_shared_scratch_weight_is_counted_with_the_activations():
    """An fp8 file runs its cast path through one scratch weight per device: the plan keeps room for it."""
    fp8 = DiTFootprint((227 * MiB,) * 36, (0,) * 36, 100 * MiB, 3072)
    _, without = mem(dit=fp8, budget=8)
    _, with_scratch = mem(dit=DiTFootprint(fp8.block_bytes, fp8.block_extra, fp8.other_bytes, fp8.dim,
                                           scratch=288 * MiB), budget=8)
    assert with_scratch.dit_activation_bytes == without.dit_activation_bytes + 288 * MiB
    assert len(with_scratch.swapped) > len(without.swapped)
    assert with_scratch.dit_gpu_bytes + with_scratch.dit_activation_bytes + margin_bytes(8 * GiB) <= 8 * GiB


def test_nvfp4_falls_back_to_fidelity_when_fp8_copies_cannot_fit():
    big_extra = DiTFootprint((128 * MiB,) * 36, (3 * GiB,) * 36, 60 * MiB, 3072, nvfp4=True)
    _, m = mem(dit=big_extra, budget=8)
    assert m.nvfp4_path == "fidelity" and "fidelity" in m.line()


def test_batch_shrinks_when_one_chunk_cannot_fit():
    _, m = mem(21, 1080, BF16_7B, 4.5, h=540, w=960, temporal_overlap=4)
    assert m.settings.batch_size < 21 and (m.settings.batch_size - 1) % 4 == 0
    assert m.settings.temporal_overlap < m.settings.batch_size
    assert "batch_size 21 ->" in m.line()


def test_fixed_blockswap_count_is_kept():
    run = P.plan(frames(5), P.UpscaleSettings(resolution=720, batch_size=5))
    m = plan_memory(run, run and P.UpscaleSettings(resolution=720, batch_size=5), BF16_7B, VAE, 24 * GiB,
                    host_available=HOST, blocks_to_swap=12)
    assert len(m.swapped) == 12


def test_impossible_budget_names_what_fits():
    with pytest.raises(SeedVR2MemoryError, match="VRAM") as e:
        mem(1, 1080, BF16_7B, 1.2)
    assert "GiB" in str(e.value)
    with pytest.raises(SeedVR2MemoryError, match="shortest edge of about"):
        mem(1, 4096, BF16_7B, 3, h=1024, w=1024)


def test_user_tiling_settings_are_kept():
    s = P.UpscaleSettings(resolution=720, batch_size=5, tiling=P.VAETiling(encode="off", decode="on",
                                                                            decode_tile=512, overlap=64))
    run = P.plan(frames(5), s)
    m = plan_memory(run, s, BF16_7B, VAE, 80 * GiB, host_available=HOST)
    assert m.encode_tiles == (0, 0) and m.decode_tiles == ((64, 64), 8)


def test_no_budget_on_cpu():
    _, m = mem(budget=None)
    assert m.budget is None and m.swapped == () and m.encode_tiles == (0, 0)
    assert "CPU" in m.line()


def test_host_ram_is_part_of_the_plan():
    s = P.UpscaleSettings(resolution=1080, batch_size=5)
    run = P.plan(frames(300), s)
    with pytest.raises(SeedVR2MemoryError, match="Video File"):
        plan_memory(run, s, BF16_7B, VAE, 24 * GiB, host_available=8 * GiB)


def test_output_size_limited_like_the_widgets():
    with pytest.raises(P.SeedVR2InputError, match="16384"):
        P.plan(torch.zeros(1, 2048, 2048, 3), P.UpscaleSettings(scale_factor=16.0))
    with pytest.raises(P.SeedVR2InputError, match="max_resolution"):
        P.plan(torch.zeros(1, 64, 2048, 3), P.UpscaleSettings(resolution=1080))


def test_activation_model_grows_with_tokens():
    assert dit_tokens(21, 720, 1280) == 6 * 45 * 80
    assert dit_activation_bytes(dit_tokens(21, 1088, 1920), 3072) > dit_activation_bytes(dit_tokens(21, 720, 1280), 3072)


def test_staged_run_equals_resident_run_with_the_same_tiles():
    """The golden tiny models through the pipeline as the node stages them (DiTStager: blocks streamed as the plan
    says, a staged VAE), against both models resident with the same plan: equal bit for bit, twice."""
    from seedvr2bw.models.seedvr2.staging import DiTStager
    from seedvr2bw.optimization.blockswap import FakeBackend, PinnedPool
    from seedvr2bw.optimization.blockswap.staging import StagedModel
    from test_pipeline import _real_models

    dit, vae = _real_models("3b")
    frames = torch.rand(5, 24, 40, 3, generator=torch.Generator().manual_seed(3))
    txt = torch.randn(3, 24, generator=torch.Generator().manual_seed(4))
    s = P.UpscaleSettings(resolution=48, batch_size=5, tiling=P.VAETiling(encode="on", decode="on", encode_tile=32,
                                                                             decode_tile=32, overlap=16))
    run = P.plan(frames, s)
    pool = PinnedPool(1 << 30)
    dst = DiTStager(dit, pool=pool, small_bytes=0)
    vst = StagedModel(vae, blocks_attr=None, pool=pool, small_bytes=0)
    m = plan_memory(run, s, dst.footprint("cpu"), 0, 64 * GiB, host_available=HOST, blocks_to_swap=2)
    assert len(m.swapped) == 2 and m.encode_tiles != (0, 0) and m.decode_tiles != (0, 0)
    ref = P.upscale(frames, dit, vae, txt, memory=m)
    be = FakeBackend()
    hooks = P.PipelineHooks(before_encode=lambda: vst.to_device("cpu", backend=be),
                            before_dit=lambda: (vst.release(), dst.attach("cpu", m, backend=be)),
                            after_dit=dst.release, before_decode=lambda: vst.to_device("cpu", backend=be))
    for _ in range(2):
        out = P.upscale(frames, dit, vae, txt, memory=m, hooks=hooks)
        vst.release()
        assert torch.equal(out, ref)
    streamed = {e[2][0] for e in be.log if e[0] == "copy" and e[2][1] != "resident"}
    assert streamed == {f"blocks.{i}" for i in m.swapped}


def test_a_blockswap_reserve_is_kept_for_activations():
    _, plain = mem(budget=12)
    s = P.UpscaleSettings(resolution=720, batch_size=21)
    run = P.plan(frames(21), s)
    m = plan_memory(run, s, BF16_7B, VAE, 12 * GiB, host_available=HOST, reserve=5 * GiB)
    assert m.dit_activation_bytes == 5 * GiB and len(m.swapped) > len(plain.swapped)


def test_vae_peak_model_follows_the_bands_and_single_images():
    """Measured on an H100: the plan's small conv bands shrink the fixed part of a VAE call's peak, and a single
    image peaks at about 4/7 (decode) and 3/7 (encode) of a video chunk per pixel; the plan then tiles less."""
    from seedvr2bw.models.seedvr2.vae.tiling import estimate_decode_bytes, estimate_encode_bytes
    tile = (90, 160)
    official, banded = estimate_decode_bytes(tile), estimate_decode_bytes(tile, conv_bytes=128 * MiB)
    assert banded < official and abs(banded / GiB - (17.7 * 0.9216 + 0.34)) < 0.3
    assert estimate_decode_bytes(tile, conv_bytes=512 * MiB) == official        # the official limits: as before
    image = estimate_decode_bytes(tile, conv_bytes=128 * MiB, one_frame=True)
    assert abs(image / GiB - (10.1 * 0.9216 + 0.34)) < 0.3
    assert estimate_encode_bytes((720, 1280), conv_bytes=128 * MiB, one_frame=True) < \
        0.5 * estimate_encode_bytes((720, 1280), conv_bytes=128 * MiB)
    _, video = mem(21, 1080, budget=8, h=540, w=960)
    _, still = mem(1, 1080, budget=8, h=540, w=960)
    area = lambda t: t[0][0] * t[0][1] if t[0] else 10 ** 9                    # noqa: E731
    assert area(still.decode_tiles) > area(video.decode_tiles)
    assert area(still.encode_tiles) > area(video.encode_tiles)


# Whole-conv decode working sets (peak less what was allocated before the call, GiB), 21 frames, H100, bf16,
# the tiles of `bench_vae.py --conv-limits none --budgets 8,12` and earlier tile probes, at 8019564: (latent tile,
# measured)
WHOLE_DECODE_PEAKS = [((50, 60), 3.10), ((40, 66), 2.75), ((90, 46), 4.19), ((72, 56), 4.09), ((90, 60), 5.40),
                      ((72, 86), 6.16), ((90, 160), 13.81)]


# The same for encoding, at 01200c2: (pixel tile, measured)
WHOLE_ENCODE_PEAKS = [((720, 480), 3.25), ((720, 672), 4.54), ((576, 688), 3.74), ((1080, 528), 5.37),
                      ((720, 1280), 8.63), ((1080, 1920), 19.43)]


def test_whole_conv_encode_peak_model_fits_the_measurements():
    """The whole-conv encode model within 5 % of every measured working set and, with VAE_PEAK_FACTOR, above each;
    tiles below the measured ones keep the official-limit model."""
    import math
    from seedvr2bw.models.seedvr2.memory import VAE_PEAK_FACTOR
    from seedvr2bw.models.seedvr2.vae.tiling import estimate_encode_bytes
    for tile, got in WHOLE_ENCODE_PEAKS:
        est = estimate_encode_bytes(tile, conv_bytes=math.inf) / GiB
        assert abs(est / got - 1) < 0.05 and est * VAE_PEAK_FACTOR > got, (tile, est, got)
        assert est < estimate_encode_bytes(tile) / GiB
    assert estimate_encode_bytes((256, 256), conv_bytes=math.inf) == estimate_encode_bytes((256, 256))


def test_whole_conv_decode_peak_model_fits_the_measurements():
    """The memory model of a decode with whole convs (``conv_bytes`` inf) within 6 % of every measured working set,
    and with the plan's VAE_PEAK_FACTOR above each; below the measured tiles and for a one-sample conv past the
    32-bit index limit (1080p in one pass: 40.76 GiB measured) it keeps the official-limit model."""
    import math
    from seedvr2bw.models.seedvr2.memory import VAE_PEAK_FACTOR
    from seedvr2bw.models.seedvr2.vae.tiling import estimate_decode_bytes
    for tile, got in WHOLE_DECODE_PEAKS:
        est = estimate_decode_bytes(tile, conv_bytes=math.inf) / GiB
        assert abs(est / got - 1) < 0.06 and est * VAE_PEAK_FACTOR > got, (tile, est, got)
    for tile in ((30, 40), (135, 240)):
        assert estimate_decode_bytes(tile, conv_bytes=math.inf) == estimate_decode_bytes(tile)
    assert estimate_decode_bytes((135, 240)) * VAE_PEAK_FACTOR / GiB > 40.76


def test_convs_run_whole_where_their_tiles_cost_little_more_area():
    """NDHWC (``whole_convs``): no conv bands where the tiles the whole-conv estimate picks fit and process at most
    WHOLE_CONV_AREA times the banded tiles' area (720p at 8 GiB: tiles as large, no bands); where they would be much
    smaller (3 GiB) the plan keeps its bands. NCDHW keeps bands always."""
    from seedvr2bw.models.seedvr2.memory import WHOLE_CONV_AREA
    from seedvr2bw.models.seedvr2.vae.tiling import tile_area_ratio
    s = P.UpscaleSettings(resolution=720, batch_size=21)
    run = P.plan(frames(21), s)
    plans = {(b, whole): plan_memory(run, s, BF16_7B, VAE, b * GiB, host_available=HOST, whole_convs=whole)
             for b in (3, 8, 32) for whole in (False, True)}
    big = plans[32, True]
    assert big.vae_conv_bytes is None and "VAE convs whole" in big.line()
    assert big.decode_tiles == plans[32, False].decode_tiles == (0, 0)
    assert all(plans[b, False].vae_conv_bytes for b in (3, 8, 32))
    area = lambda k, m: tile_area_ratio(k, getattr(m, f"{k}_tiles"), *run.model)        # noqa: E731
    small, banded = plans[8, True], plans[8, False]            # 720p tiles at 8 GiB
    assert small.vae_conv_bytes is None and small.decode_tiles != (0, 0)
    for k in ("encode", "decode"):
        assert area(k, banded) <= area(k, small) <= WHOLE_CONV_AREA * area(k, banded)
    tiny = plans[3, True]
    assert tiny.vae_conv_bytes == plans[3, False].vae_conv_bytes and tiny.decode_tiles == plans[3, False].decode_tiles
    for m in plans.values():
        assert on_gpu(run, m) <= m.budget


def test_tile_area_ratio():
    from seedvr2bw.models.seedvr2.vae.tiling import tile_area_ratio
    assert tile_area_ratio("decode", (0, 0), 720, 1280) == 1.0
    # latent 90 x 160 in tiles of 90 x 46 overlapping by 8: one row, 4 columns (0, 38, 76, 114) -> 90 x 184
    assert tile_area_ratio("decode", ((90, 46), 8), 720, 1280) == 184 / 160
    # pixels 720 x 1280 in 720 x 480 tiles overlapping by 64: 3 columns
    assert tile_area_ratio("encode", ((720, 480), 64), 720, 1280) == 3 * 480 / 1280


@pytest.mark.parametrize("budget", [8, 12, 24])
@pytest.mark.parametrize("whole", [False, True])
def test_the_vae_part_of_the_plan_is_plan_vae(budget, whole):
    # one rule: the run's plan takes its VAE tiles, peaks and conv bands from plan_vae, which scripts/bench_vae.py
    # --budgets times on its own
    from seedvr2bw.models.seedvr2.memory import plan_vae
    s = P.UpscaleSettings(resolution=1080, batch_size=21)
    run = P.plan(frames(21, 540, 960), s)
    m = plan_memory(run, s, BF16_7B, VAE, budget * GiB, host_available=HOST, whole_convs=whole)
    v = plan_vae(run, budget * GiB, VAE, whole_convs=whole)
    assert (m.encode_tiles, m.decode_tiles, m.vae_peak_bytes, m.vae_conv_bytes) == \
        (v.encode_tiles, v.decode_tiles, v.peak_bytes, v.conv_bytes)
    assert max(v.peak_bytes) <= budget * GiB - margin_bytes(budget * GiB) - VAE
    if budget == 8:
        assert v.decode_tiles != (0, 0)          # a 1080p x 21 decode does not fit 8 GiB in one pass
