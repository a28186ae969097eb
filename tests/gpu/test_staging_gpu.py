"""Staged models and the memory plan on a real GPU: a run planned for a budget (blocks streamed, VAE tiled, both
models staged per phase) equals the resident run with the same tiles bit for bit, pins once and keeps host memory
flat over repeated runs, leaves nothing on the GPU, and leaves torch's process-wide settings alone. Skipped without
CUDA."""
import gc

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from seedvr2bw.models.seedvr2 import pipeline as P  # noqa: E402
from seedvr2bw.models.seedvr2.staging import Staging  # noqa: E402
from seedvr2bw.optimization.blockswap import CudaBackend, PinnedPool  # noqa: E402
from seedvr2bw.optimization.blockswap.staging import StagedModel  # noqa: E402

from test_pipeline import _real_models  # noqa: E402

DEV = torch.device("cuda")


def gpu_bytes_in_use() -> int:
    """Bytes allocated on the GPU, less cuBLAS's workspaces (torch allocates one per handle and stream on the first
    GEMM there and keeps it: not the pack's)."""
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    return torch.cuda.memory_allocated(DEV)


def settings_now():
    return (torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32,
            torch.get_float32_matmul_precision(), torch.backends.cudnn.deterministic)


def test_staged_run_equals_resident_and_pins_once():
    dit, vae = _real_models("7b")
    dit, vae = dit.to(torch.bfloat16), vae.to(torch.bfloat16)
    frames = torch.rand(9, 48, 80, 3, generator=torch.Generator().manual_seed(1))
    txt = torch.randn(3, 24, generator=torch.Generator().manual_seed(2))
    s = P.UpscaleSettings(resolution=96, batch_size=9, tiling=P.VAETiling(encode="on", decode="on", encode_tile=96,
                                                                             decode_tile=96, overlap=32))
    before = settings_now()
    pool = PinnedPool(1 << 30)
    staging = Staging(dit, vae, pool=pool, small_bytes=0)        # the tiny models' tensors are all small
    mem = staging.plan(P.plan(frames, s), s, DEV, budget=8 << 30, blocks_to_swap=2, vae_dtype=torch.bfloat16)
    assert len(mem.swapped) == 2 and mem.encode_tiles != (0, 0)
    allocated0 = gpu_bytes_in_use()
    outs = []
    for _ in range(3):
        outs.append(P.upscale(frames, dit, vae, txt, device=DEV, dit_dtype=torch.bfloat16, vae_dtype=torch.bfloat16,
                              hooks=staging.hooks(DEV, mem), memory=mem))
        staging.vae_off()
        assert gpu_bytes_in_use() <= allocated0 + (1 << 20)     # nothing left on the GPU
    pinned = pool.pinned_bytes
    # resident with the same plan: both models on the GPU the whole time
    staging.vae.to_device(DEV)
    staging.dit.staged.to_device(DEV, ())
    ref = P.upscale(frames, dit, vae, txt, device=DEV, dit_dtype=torch.bfloat16, vae_dtype=torch.bfloat16, memory=mem)
    staging.dit.release()
    staging.vae_off()
    for out in outs:
        assert torch.equal(out, ref)
    assert pool.pinned_bytes == pinned                          # pinned once, kept
    assert settings_now() == before
    staging.close()
    del staging
    gc.collect()
    assert pool.pinned_bytes == 0
    assert CudaBackend.registered_bytes() == 0


class _Blocks(torch.nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.blocks = torch.nn.ModuleList(layers)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("swapped", [(), (1, 2)])
def test_nvfp4_fp8_speed_layers_leave_nothing_on_the_gpu_after_release(swapped):
    """NVFP4 layers on fp8_speed derive an FP8 copy of their weights on the GPU and record launch plans; after the
    stager releases the model every GPU byte it took is free again, resident or streamed, run after run, and the
    outputs do not change (a plan recorded in one run reads the FP8 copy the next run derives)."""
    from seedvr2bw.optimization.nvfp4.linear import NVFP4Linear
    g = torch.Generator().manual_seed(0)
    layers = [NVFP4Linear.from_linear(torch.nn.Linear(512, 512, dtype=torch.bfloat16).requires_grad_(False),
                                      path="fp8_speed") for _ in range(4)]
    for lin in layers:
        lin.weight.data = lin.weight.data.clone()       # own storage (the arena packs it)
    model = _Blocks(layers)
    x = torch.randn(256, 512, generator=g).to(DEV, torch.bfloat16)
    staged = StagedModel(model, "blocks", pool=PinnedPool(1 << 30), small_bytes=0)
    before = gpu_bytes_in_use()
    outs = []
    for _ in range(3):
        staged.to_device(DEV, swapped)
        with torch.inference_mode():
            outs.append(model(x).float().cpu())
        staged.release()
        assert gpu_bytes_in_use() - before <= 0, "GPU bytes kept after release"
    assert any(p is not None for layer in layers for p in layer.plans.values()), "no launch plan: nothing tested"
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    staged.close()
