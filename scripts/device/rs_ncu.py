"""Device probe: one RS W4A16 kernel launch to profile under Nsight Compute (scripts/device/rs_ncu.sh).
    python scripts/device/rs_ncu.py --shape 3072x12288 --m 4096 --variant rs [--calls 3]"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import _pack  # noqa: E402,F401
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from rs_probe import quantized, variant  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="3072x12288")
ap.add_argument("--m", type=int, default=4096)
ap.add_argument("--variant", default="rs")
ap.add_argument("--calls", type=int, default=3)
a = ap.parse_args()
k, n = (int(v) for v in a.shape.split("x"))
dev = torch.device("cuda")
gen = torch.Generator().manual_seed(3)
t = quantized(n, k, gen, dev, adversarial=False)
x = torch.randn(a.m, k, generator=gen).to(dev, torch.bfloat16)
bias = (torch.randn(n, generator=gen) * 0.1).to(dev, torch.bfloat16)
fn = variant(a.variant, x, t, n, bias)
for _ in range(a.calls):
    fn()
torch.cuda.synchronize()
print("ran", a.variant, a.shape, a.m)
