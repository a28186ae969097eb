#!/usr/bin/env python
"""The SeedVR2 DiT step for every file format users have, against bf16 and against dequantize + bf16, in one run.

Random weights of the real shapes (``bench_seedvr2.random_dit``); each format's layers are made from the same bf16
weights the way its loader makes them: ``fp8`` (cast and scaled_mm modes), ``nvfp4`` (the hardware policy's path,
and ``nvfp4_fidelity``), ``mxfp8``, ``int8`` (ConvRot), GGUF ``q8_0`` / ``q4_0`` / ``q4_k`` (random block bytes with
valid fp16 scales: dequantization costs the same whatever the values). fp16 / fp32 files run as bf16 (the loader
casts them) and are not listed. Only the linears of the transformer blocks are converted, as in the released files
(their input and output layers stay in 16 bits). For each format the same layers also run as "dequantize + bf16":
the format's own dequantize each call, then one bf16 GEMM (what a loader without kernels for the format does).

    python scripts/bench_formats.py --model 7b --case 720p:21 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import _pack  # noqa: F401  (registers the checkout as `seedvr2bw`)
import torch
import torch.nn.functional as F

from bench_seedvr2 import RESOLUTIONS, TXT_LEN, cuda_time, latent_grid, random_dit
from seedvr2bw.models.seedvr2.dit import SEEDVR2_3B, SEEDVR2_7B
from seedvr2bw.optimization.gguf.format import QUANT_SIZES, QType
from seedvr2bw.optimization.gguf.linear import GGUFLinear
from seedvr2bw.optimization.nvfp4.int8 import Int8Linear
from seedvr2bw.optimization.nvfp4.linear import FP8Linear, NVFP4Linear
from seedvr2bw.optimization.nvfp4.mxfp8 import MXFP8Linear

FORMATS = ("bf16", "fp8_cast", "fp8_scaled_mm", "nvfp4", "nvfp4_fidelity", "mxfp8", "int8", "q8_0", "q4_0", "q4_k")
# byte offsets of the fp16 scale fields in one block of each GGUF type (the rest may be any bytes)
GGUF_FP16_FIELDS = {"q8_0": (QType.Q8_0, (0,)), "q4_0": (QType.Q4_0, (0,)), "q4_k": (QType.Q4_K, (0, 2))}


def random_gguf(linear: torch.nn.Linear, qtype: QType, fp16_at, gen) -> GGUFLinear:
    """A GGUF layer of ``linear``'s shape with random block bytes and small positive fp16 scales."""
    n, k = linear.weight.shape
    block, size = QUANT_SIZES[qtype]
    dev = linear.weight.device
    raw = torch.randint(0, 256, (n * k // block, size), dtype=torch.uint8, device=dev, generator=gen)
    scales = (torch.rand(raw.shape[0], len(fp16_at), device=dev, generator=gen) * 1e-3 + 1e-4).half()
    for j, at in enumerate(fp16_at):
        raw[:, at:at + 2] = scales[:, j:j + 1].contiguous().view(torch.uint8)
    m = GGUFLinear(k, n, qtype, bias=False, device="meta")
    m.weight = raw
    if linear.bias is not None:
        m.bias = torch.nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    return m


def convert(linear: torch.nn.Linear, fmt: str, gen) -> torch.nn.Module:
    if fmt in ("fp8_cast", "fp8_scaled_mm"):
        return FP8Linear.from_linear(linear, mode=fmt[4:])
    if fmt in ("nvfp4", "nvfp4_fidelity"):
        return NVFP4Linear.from_linear(linear, path="auto" if fmt == "nvfp4" else "fidelity")
    if fmt == "mxfp8":
        return MXFP8Linear.from_linear(linear)
    if fmt == "int8":
        return Int8Linear.from_linear(linear, convrot_group=256)
    qtype, fields = GGUF_FP16_FIELDS[fmt]
    return random_gguf(linear, qtype, fields, gen)


class DequantThenBf16(torch.nn.Module):
    """The baseline: ``layer``'s weight dequantized to bf16 on every call, then one bf16 GEMM."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer
        self.in_features, self.out_features = layer.in_features, layer.out_features

    def forward(self, x):
        w = self.layer.dequantize_weight(torch.bfloat16)
        b = self.layer.bias
        return F.linear(x, w.to(x.device), None if b is None else b.to(x.dtype))


def swap_block_linears(model, which, make) -> int:
    """Every module of the transformer blocks for which ``which(module)`` holds becomes ``make(module)``."""
    found = [(block, name, mod) for block in model.blocks for name, mod in block.named_modules()
             if name and which(mod)]
    for block, name, mod in found:
        parent_name, _, attr = name.rpartition(".")
        setattr(block.get_submodule(parent_name) if parent_name else block, attr, make(mod))
    return len(found)


def is_linear(mod) -> bool:
    return isinstance(mod, torch.nn.Linear) and not hasattr(mod, "dequantize_weight")


def is_quantized(mod) -> bool:
    return callable(getattr(mod, "dequantize_weight", None)) and not isinstance(mod, DequantThenBf16)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="7b", choices=["3b", "7b"])
    ap.add_argument("--case", default="720p:21")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--commit", default=os.environ.get("GIT_COMMIT", ""))
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    cfg = SEEDVR2_7B if args.model == "7b" else SEEDVR2_3B
    res, frames = args.case.split(":")
    _, (T, H, W) = latent_grid(*RESOLUTIONS[res], int(frames))
    vid = torch.randn(T * H * W, cfg.vid_in_channels, device="cuda", dtype=torch.bfloat16)
    txt = torch.randn(TXT_LEN, cfg.txt_in_dim, device="cuda", dtype=torch.bfloat16)
    shapes = (torch.tensor([[T, H, W]], device="cuda"), torch.tensor([[TXT_LEN]], device="cuda"),
              torch.tensor([1000.0], device="cuda"))
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": args.commit,
            "model": args.model, "case": args.case}
    print(info, flush=True)
    rows, bf16_s = [], None

    def step(model):
        with torch.no_grad():
            return cuda_time(lambda: model(vid, txt, *shapes), args.warmup, args.iters)

    for fmt in args.formats.split(","):
        model = random_dit(cfg, "auto")
        gen = torch.Generator(device="cuda").manual_seed(1)
        row = {"format": fmt}
        try:
            if fmt != "bf16":
                n = swap_block_linears(model, is_linear, lambda lin: convert(lin, fmt, gen))
                row["layers"] = n
            torch.cuda.empty_cache()
            row["weights_gib"] = sum(t.numel() * t.element_size() for t in
                                     list(model.parameters()) + list(model.buffers())) / 2 ** 30
            med, times = step(model)
            row.update(step_s=med, times_s=times)
            if fmt == "bf16":
                bf16_s = med
            else:
                swap_block_linears(model, is_quantized, DequantThenBf16)
                dq, dq_times = step(model)
                row.update(dequant_bf16_s=dq, dequant_times_s=dq_times, vs_dequant=med / dq)
        except torch.cuda.OutOfMemoryError as exc:
            row["error"] = f"OOM: {str(exc)[:160]}"
        except Exception as exc:  # noqa: BLE001 - one failing format must not end the run
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        if bf16_s and "step_s" in row:
            row["vs_bf16"] = row["step_s"] / bf16_s
        rows.append(row)
        print(f"{fmt:15s} " + (row.get("error") or
              f"step {row['step_s']:.3f} s ({row.get('vs_bf16', 1):.2f}x bf16)" +
              (f", dequantize + bf16 {row['dequant_bf16_s']:.3f} s (format / that {row['vs_dequant']:.2f})"
               if "dequant_bf16_s" in row else "") + f", weights {row['weights_gib']:.2f} GiB"), flush=True)
        del model
        torch.cuda.empty_cache()
    slow = [r["format"] for r in rows if r.get("vs_dequant", 0) > 1.0]
    print(f"slower than dequantize + bf16: {', '.join(slow) or 'none'}; median step "
          f"{statistics.median(r['step_s'] for r in rows if 'step_s' in r):.3f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
