"""The training memory plan (training/memory_plan.py) on fake devices of B GiB: calibrated against the measured
FLUX.1 peaks, fits every budget of the issue's ladder, keeps the user's choices, and names settings that fit when
none does. Pure arithmetic: no GPU, no model loaded (the tiny model only for flux_dims and one short run)."""
import sys
from pathlib import Path

import pytest
import torch

import seedvr2bw.training.memory_plan as M

sys.path.insert(0, str(Path(__file__).resolve().parent))

GiB = M.GiB
H100 = dict(host=128 * GiB, fp8_tensorcores=True, nvfp4=True)


def plan(vram_gib, host=128 * GiB, **req):
    return M.plan_training(M.FluxDims(), M.PlanRequest(**req), M.DeviceBudget(vram=int(vram_gib * GiB), host=host))


@pytest.mark.parametrize("precision,selective,measured", [
    ("bf16", "on", 38.2), ("bf16", "off", 25.2), ("fp8", "on", 28.2), ("fp8", "off", 15.1), ("nvfp4", "on", 23.4)])
def test_estimates_match_the_measured_peaks(precision, selective, measured):
    """docs/PERFORMANCE.md §6: full FLUX.1, rank 16, 1024², batch 1 (peak = max_memory_allocated, no headroom)."""
    p = plan(200, base_precision=precision, blocks_to_swap=0, selective=selective)
    est = (p.gpu_bytes - M.HEADROOM) / GiB
    assert abs(est - measured) / measured < 0.05, (est, measured)


@pytest.mark.parametrize("budget", [80, 40, 24, 16, 12, 10, 8])
def test_every_budget_of_the_ladder_fits(budget):
    p = plan(budget)
    assert p.gpu_bytes <= budget * GiB and p.host_bytes <= 128 * GiB
    assert p.batch_size == 1 and p.blocks_to_swap >= 0
    if budget >= 40:
        assert p.precision == "as_loaded" and p.blocks_to_swap == 0 and p.selective_blocks > 0
    if budget == 24:   # fp8 base resident, beside part of the selective outputs (kohya: 24 GB with fp8 base)
        assert p.precision == "fp8" and p.blocks_to_swap == 0
    if budget == 16:   # NVFP4 resident 0.587 s/step against fp8 with 21 blocks swapped 0.73-0.86 (PERFORMANCE §6)
        assert p.precision == "nvfp4" and p.blocks_to_swap == 0
    if budget <= 12:
        assert p.blocks_to_swap > 0
    assert p.line().startswith("[FluxLoraTrain] memory plan: ") and "\n" not in p.line()


def test_the_users_choices_are_kept():
    p = plan(80, base_precision="bf16", blocks_to_swap=10, selective="off")
    assert (p.precision, p.blocks_to_swap, p.selective_blocks) == ("as_loaded", 10, 0)
    p = plan(24, base_precision="nvfp4")
    assert p.precision == "nvfp4" and p.blocks_to_swap == 0
    # NVFP4 only where the GPU computes it; fp8 only where the base is not already stored in 8 bits
    cpu_like = M.DeviceBudget(vram=16 * GiB, host=128 * GiB, nvfp4=False)
    assert M.plan_training(M.FluxDims(), M.PlanRequest(), cpu_like).precision != "nvfp4"
    fp8_loaded = M.FluxDims(stored_bytes=1.0)
    assert M.plan_training(fp8_loaded, M.PlanRequest(), M.DeviceBudget(vram=24 * GiB, host=128 * GiB)).precision \
        in ("as_loaded", "nvfp4")


def test_a_choice_that_does_not_fit_names_the_fix():
    with pytest.raises(M.TrainMemoryError, match=r"does not fit in 12\.0 GiB.*base as loaded, 0 blocks swapped.*"
                                                 r"Fix: set base_precision, blocks_to_swap and selective_checkpointing "
                                                 r"to auto"):
        plan(12, base_precision="bf16", blocks_to_swap=0)


def test_nothing_fits_names_the_smallest_settings():
    with pytest.raises(M.TrainMemoryError) as e:
        plan(6)
    msg = str(e.value)
    assert "does not fit in 6.0 GiB of VRAM" in msg and "57 blocks swapped" in msg
    assert "Fix: train at resolution 768" in msg
    with pytest.raises(M.TrainMemoryError, match="need .* GiB host RAM.*Fix"):
        plan(16, host=8 * GiB)


def test_batch_within_the_limit_keeps_the_effective_batch():
    p = plan(24, batch_size=4, grad_accum=2)
    assert 4 % p.batch_size == 0 and p.batch_size * p.grad_accum == 8
    big = plan(200, batch_size=4)
    assert big.batch_size == 4 and big.grad_accum == 1


def test_cpu_takes_the_settings_as_given():
    p = M.plan_training(M.FluxDims(), M.PlanRequest(blocks_to_swap=-1, batch_size=2), M.DeviceBudget(vram=None))
    assert (p.precision, p.blocks_to_swap, p.batch_size, p.selective_budget) == ("as_loaded", 0, 2, None)
    assert "CPU" in p.line()


def test_plan_applied_to_the_tiny_model_trains(tmp_path):
    from test_training_helpers import FakeCLIP, FakeVAE, make_image_folder, require_comfy, tiny_flux_patcher
    require_comfy()
    torch.set_num_threads(1)
    import seedvr2bw.training as T
    mp = tiny_flux_patcher()
    dm = mp.model.diffusion_model
    dims = M.flux_dims(dm)
    assert (dims.hidden, dims.double_blocks, dims.single_blocks, dims.stored_bytes) == (64, 2, 2, 4.0)
    assert sum(dims.block_params()) <= sum(p.numel() for b in list(dm.double_blocks) + list(dm.single_blocks)
                                           for p in b.parameters())
    req = M.PlanRequest(resolution=64, rank=4, base_precision="auto", blocks_to_swap=-1)
    p = M.plan_training(dims, req, M.DeviceBudget(vram=3 * GiB, host=64 * GiB))
    assert p.blocks_to_swap == 0 and p.selective_blocks == 4 and p.selective_budget > 0
    folder = make_image_folder(tmp_path / "ds", n=2)
    ds = T.encode_dataset(T.DatasetSpec(folder=str(folder), resolution=64), FakeVAE(), FakeCLIP())
    cfg = p.apply(T.TrainConfig(rank=4, alpha=4, steps=2, compute_dtype="fp32", output_dir=str(tmp_path / "o"),
                                blocks_to_swap=-1))
    assert cfg.blocks_to_swap == 0 and cfg.selective_budget_gib > 0
    tr = T.FluxLoraTrainer(dm, cfg, ds, latent_format=mp.model.latent_format, device="cpu")
    tr.run()
    assert tr.forward.selective_by_shape and all(n == 4 for n in tr.forward.selective_by_shape.values())
    tr.close()
