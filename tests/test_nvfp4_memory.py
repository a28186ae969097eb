"""Weight memory of a real-size SeedVR2 7B DiT in NVFP4, from the real shapes (tests/data/keys_dit_7b.json).

No bf16 model is materialised: each linear weight is quantized on its own (one random tensor per distinct
shape, then the storage of that real NVFP4Linear is counted for every layer of that shape).
"""
import json

import torch

from seedvr2bw.optimization.nvfp4 import format as fmt
from seedvr2bw.optimization.nvfp4.linear import NVFP4Linear
from seedvr2bw.optimization.nvfp4.surgery import make_keep_rule
from conftest import DATA


def test_seedvr2_7b_nvfp4_weight_memory():
    keys = json.loads((DATA / "keys_dit_7b.json").read_text())
    rule = make_keep_rule()
    linears = {}
    other = 0
    for e in keys:
        name, shape = e["name"], e["shape"]
        if name.endswith(".weight") and len(shape) == 2:
            linears[name[: -len(".weight")]] = tuple(shape)
        else:
            n = 1
            for s in shape:
                n *= s
            other += n
    measured = {}
    q_params = q_bytes = kept_params = 0
    for layer, (n, k) in linears.items():
        mod = torch.nn.Linear(1, 1)
        mod.in_features, mod.out_features = k, n
        if rule(layer, mod):
            kept_params += n * k
            continue
        if (n, k) not in measured:
            w = torch.randn(n, k) * 0.02
            lin = NVFP4Linear.from_nvfp4(fmt.quantize_nvfp4(w, return_tensor=True), bias=None)
            measured[(n, k)] = lin.weight_nbytes()
            assert measured[(n, k)] == fmt.nvfp4_storage_bytes(n, k)
            del w, lin
        q_params += n * k
        q_bytes += measured[(n, k)]
    per_param = q_bytes / q_params
    n_layers = sum(1 for layer in linears if not rule(layer, torch.nn.Linear(16, 16)))
    padding = n_layers * 4 / q_params          # the 4-byte global scale per layer; these shapes need no padding
    print(f"7B DiT: {q_params / 1e9:.3f} B params quantized in {len(measured)} shapes, {q_bytes / 2**30:.2f} GiB, "
          f"{per_param:.6f} B/param; kept {kept_params / 1e6:.1f} M linear params + {other / 1e6:.1f} M others")
    assert q_params > 6e9                                  # the blocks' linears are the bulk of the 7B
    assert per_param <= 0.5625 + padding + 1e-12
    total_bf16 = 2 * (q_params + kept_params + other)
    total_mixed = q_bytes + 2 * (kept_params + other)
    assert total_mixed / total_bf16 < 0.30
