"""scripts/bench_formats.py's conversions on the CPU: every format it times is made from a bf16 linear the way its
loader makes it, and its "dequantize + bf16" baseline computes the same product (the GPU timings: the device)."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_formats as BF  # noqa: E402


class Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(512, 256), torch.nn.Sequential(torch.nn.Linear(256, 512, bias=False)))
            for _ in range(2)).to(torch.bfloat16)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("fmt", BF.FORMATS[1:])
def test_each_format_and_its_dequantize_baseline(fmt):
    model = Blocks()
    x = torch.randn(40, 512).to(torch.bfloat16)
    model.requires_grad_(False)
    want = model(x).float()
    gen = torch.Generator().manual_seed(1)
    assert BF.swap_block_linears(model, BF.is_linear, lambda lin: BF.convert(lin, fmt, gen)) == 4
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    got = model(x).float()
    assert BF.swap_block_linears(model, BF.is_quantized, BF.DequantThenBf16) == 4
    base = model(x).float()
    assert torch.isfinite(got).all() and torch.isfinite(base).all()
    rel = float((got - base).norm() / base.norm())
    if fmt.startswith("q"):          # random GGUF blocks: the layer is itself dequantize + GEMM
        assert rel < 1e-2, rel
    else:                            # the same weights; activations quantized (fp8 / int8) or not
        assert rel < 0.06, (fmt, rel)
        assert float((got - want).norm() / want.norm()) < 0.25, fmt
