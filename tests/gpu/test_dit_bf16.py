"""GPU: the SeedVR2 DiT in bf16 (and fp32) against the fp32 golden vectors. Skips without CUDA."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from seedvr2bw.models.seedvr2.dit import load_dit
from seedvr2bw.optimization.attention import available_backends

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden"
MANIFEST = json.loads((GOLDEN / "manifest.json").read_text())


def rel_l2(a, ref):
    return float((a.double() - ref.double()).norm() / ref.double().norm())


def _run(variant, case, dtype, backend):
    tiny = MANIFEST["dit"]["tiny_models"][variant]
    model = load_dit(GOLDEN / tiny["weights_file"], device="cuda", dtype=dtype, attention_backend=backend)
    inp = load_file(GOLDEN / MANIFEST["dit"]["cases"][case]["inputs_file"])
    ref = load_file(GOLDEN / tiny["results"][case]["outputs_file"])["out"]
    T, H, W, C = inp["vid"].shape
    with torch.no_grad():
        out = model(inp["vid"].reshape(-1, C).cuda(), inp["txt"].cuda(), inp["vid_shape"].cuda(),
                    inp["txt_shape"].cuda(), inp["timestep"].cuda())
    assert out.dtype == dtype
    return rel_l2(out.float().cpu().reshape(ref.shape), ref)


def _backends():
    return [b for b in ("sdpa", "flash_attn", "torch_varlen", "sage") if b in available_backends("cuda")] if torch.cuda.is_available() else ["sdpa"]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("case", ["image", "video"])
@pytest.mark.parametrize("variant", ["3b", "7b"])
def test_bf16_close_to_fp32_golden(variant, case, backend):
    err = _run(variant, case, torch.bfloat16, backend)
    print(f"bf16 {variant}/{case}/{backend}: rel-L2 {err:.3e}")
    assert err <= 1e-2 if backend != "sage" else err <= 3e-2


@pytest.mark.parametrize("case", ["image", "video"])
@pytest.mark.parametrize("variant", ["3b", "7b"])
def test_fp32_on_gpu_matches_golden(variant, case):
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        err = _run(variant, case, torch.float32, "sdpa")
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
    print(f"fp32 {variant}/{case}/sdpa on GPU: rel-L2 {err:.3e}")
    assert err <= 1e-5
