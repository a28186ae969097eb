"""Write tests/data/ck_reference.safetensors: small inputs and what comfy-kitchen's eager backend makes of them.

    python tests/make_ck_reference.py          # needs comfy-kitchen (PyPI `comfy-kitchen`, 0.2.40 was used)

The tests compare our quantizers with comfy-kitchen where it imports, and with these stored bytes where it does
not, so a fresh clone without comfy-kitchen still fails when a bit changes. Keys, per case ``<name>``:
  nvfp4.<name>.x / .qdata / .block_scale (uint8 view of e4m3) / .scale   ``QuantizedTensor.from_float(x, NVFP4)``
  mxfp8.<name>.x / .qdata (uint8 view of e4m3) / .scale (uint8 E8M0)     ``QuantizedTensor.from_float(x, MXFP8)``
  int8.<name>.w / .qdata / .scale / .x / .y   TensorWiseINT8Layout ConvRot weight and ``int8_linear(x)`` = y
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

OUT = Path(__file__).resolve().parent / "data" / "ck_reference.safetensors"

NVFP4_CASES = {   # name -> (rows, cols, std, dtype); odd shapes exercise the padding
    "bf16": (48, 64, 0.02, torch.bfloat16),
    "bf16_pad": (33, 40, 0.003, torch.bfloat16),
    "fp16": (32, 96, 0.05, torch.float16),
    "fp16_pad": (20, 56, 0.5, torch.float16),
    "fp32": (32, 64, 1.0, torch.float32),
}
MXFP8_CASES = {
    "bf16": (48, 64, 0.02, torch.bfloat16),
    "fp16_pad": (33, 72, 0.5, torch.float16),
    "fp32": (32, 96, 1.0, torch.float32),
}
INT8_CASES = {    # name -> (out, in, group, x rows, dtype)
    "fp32_g64": (24, 128, 64, 5, torch.float32),
    "fp32_g256": (16, 256, 256, 3, torch.float32),
    "bf16_g64": (32, 64, 64, 7, torch.bfloat16),
}


def inputs(seed: int, rows: int, cols: int, std: float, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * std
    x[:, ::17] *= 8                                   # outliers: block scales of several sizes
    return x.to(dtype)


def main() -> None:
    import comfy_kitchen
    from comfy_kitchen.tensor import QuantizedTensor, get_layout_class
    nvfp4, mxfp8, int8 = (get_layout_class(n) for n in ("TensorCoreNVFP4Layout", "TensorCoreMXFP8Layout",
                                                         "TensorWiseINT8Layout"))
    out = {}
    with comfy_kitchen.registry.use_backend("eager"):
        for i, (name, (r, c, std, dt)) in enumerate(NVFP4_CASES.items()):
            x = inputs(i, r, c, std, dt)
            qdata, scale, block_scale = nvfp4.get_plain_tensors(QuantizedTensor.from_float(x, "TensorCoreNVFP4Layout"))
            out.update({f"nvfp4.{name}.x": x, f"nvfp4.{name}.qdata": qdata,
                        f"nvfp4.{name}.block_scale": block_scale.view(torch.uint8),
                        f"nvfp4.{name}.scale": scale.reshape(())})
        for i, (name, (r, c, std, dt)) in enumerate(MXFP8_CASES.items()):
            x = inputs(100 + i, r, c, std, dt)
            qdata, scale = mxfp8.get_plain_tensors(QuantizedTensor.from_float(x, "TensorCoreMXFP8Layout"))
            out.update({f"mxfp8.{name}.x": x, f"mxfp8.{name}.qdata": qdata.view(torch.uint8),
                        f"mxfp8.{name}.scale": scale.view(torch.uint8)})
        for i, (name, (n, k, group, m, dt)) in enumerate(INT8_CASES.items()):
            w = inputs(200 + i, n, k, 0.05, dt)
            x = inputs(300 + i, m, k, 1.0, dt)
            qdata, scale = int8.get_plain_tensors(QuantizedTensor.from_float(
                w, "TensorWiseINT8Layout", is_weight=True, per_channel=True, convrot=True, convrot_groupsize=group))
            y = comfy_kitchen.int8_linear(x, qdata, scale, None, dt, convrot=True, convrot_groupsize=group)
            out.update({f"int8.{name}.w": w, f"int8.{name}.qdata": qdata, f"int8.{name}.scale": scale,
                        f"int8.{name}.x": x, f"int8.{name}.y": y})
    from importlib.metadata import version
    save_file({k: v.contiguous() for k, v in out.items()}, str(OUT), {"comfy_kitchen": version("comfy-kitchen")})
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {len(out)} tensors)")


if __name__ == "__main__":
    main()
