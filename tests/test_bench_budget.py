"""The benches' VRAM budgets on the CPU: scripts/bench_video.fill_gpu_to's arithmetic on a simulated GPU, and
scripts/bench_flux_lora.bench_budget's row on the tiny FLUX (the GPU run: the device)."""
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from comfy_env import require_comfy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_video as BV  # noqa: E402

GIB = 1 << 30


class SimulatedGpu:
    """A GPU as torch.cuda reports it: ``free`` to the driver, ``allocated`` by tensors, ``stuck`` reserved by torch
    but not allocated and not handed back by empty_cache (holes in live segments), ``late`` freed to the driver
    while the first fill tensor is allocated (a release the fill's first reading missed)."""

    def __init__(self, monkeypatch, free, stuck=0, late=0):
        self.free, self.allocated, self.stuck, self.late = free, 0, stuck, late
        meta_empty = torch.empty

        def empty(n, dtype=None, device=None):
            self.free -= n
            self.allocated += n
            self.free, self.late = self.free + self.late, 0
            return meta_empty(n, dtype=dtype, device="meta")
        monkeypatch.setattr(torch, "empty", empty)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (self.free, 80 * GIB))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.allocated + self.stuck)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    def usable(self):
        return self.free + self.stuck


def test_fill_counts_torch_cache_as_usable(monkeypatch, capsys):
    gpu = SimulatedGpu(monkeypatch, free=60 * GIB, stuck=2 * GIB)
    hold = BV.fill_gpu_to(16, "cuda")
    assert [t.numel() for t in hold] == [46 * GIB]
    assert gpu.usable() == 16 * GIB and gpu.free == 14 * GIB
    assert "the pack sees 16.00 GiB usable (14.00 GiB free + 2.00 GiB in torch's cache" in capsys.readouterr().out


def test_fill_tops_up_a_release_during_the_fill(monkeypatch):
    gpu = SimulatedGpu(monkeypatch, free=60 * GIB, late=3 * GIB)
    hold = BV.fill_gpu_to(12, "cuda")
    assert [t.numel() for t in hold] == [48 * GIB, 3 * GIB]
    assert gpu.usable() == 12 * GIB


def test_fill_leaves_slack_and_small_gpus_alone(monkeypatch):
    gpu = SimulatedGpu(monkeypatch, free=16 * GIB + BV.FILL_SLACK)
    assert BV.fill_gpu_to(16, "cuda") == []
    gpu.free = 6 * GIB
    assert BV.fill_gpu_to(8, "cuda") == [] and gpu.allocated == 0


def test_budget_row_on_tiny_flux(tmp_path):
    require_comfy()
    import bench_flux_lora as B
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    mp = B.build_model(B.TINY, cpu, torch.float32)
    r = B.bench_budget(mp, 64, 8.0, B.TINY, cpu, warmup=1, steps=3, outdir=str(tmp_path))
    assert r["budget_gib"] == 8.0 and r["usable_gib_after_fill"] is None   # nothing is filled on the CPU
    assert len(r["step_s"]) == 3
    assert r["loss_decreasing"] is True and r["val_loss_after"] < r["val_loss_before"]
    assert r["lora_keys_missing"] == 0
    # the count comes from ComfyUI's loader: a key it cannot place is counted
    lora = load_file(r["lora_file"])
    lora["lora_unet_no_such_block.lora_down.weight"] = torch.zeros(4, 8)
    save_file(lora, str(tmp_path / "extra.safetensors"))
    assert B.lora_keys_missing(mp, str(tmp_path / "extra.safetensors")) == 1
