"""One call of the warp-specialized W4A16 kernel (for a profiler): python scripts/device/ws_one.py K N M [config]"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import _pack  # noqa: E402,F401
import torch  # noqa: E402

from seedvr2bw.optimization.nvfp4 import format as fmt  # noqa: E402
from seedvr2bw.optimization.nvfp4 import ws_w4a16 as W  # noqa: E402

k, n, m = (int(v) for v in sys.argv[1:4])
cfg = tuple(int(v) for v in sys.argv[4].split(",")) if len(sys.argv) > 4 else None
t = fmt.quantize_nvfp4(torch.randn(n, k) * 0.02, return_tensor=True).to("cuda")
x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    W.ws_linear(x, t.packed, t.block_scale, t.global_scale, n, None, cfg)
torch.cuda.synchronize()
print("ok", W._DISABLED_REASON)
