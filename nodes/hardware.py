"""Nodes that show what the hardware policy chose, and a GEMM throughput probe."""
from __future__ import annotations

import time

import torch
from comfy_api.latest import io

from ..optimization.attention import CHOICES as ATTENTION_CHOICES
from ..optimization.nvfp4.dispatch import NVFP4_PATHS
from ..optimization.runtime import policy
from .types import CATEGORY


def _policy_overrides(nvfp4_gemm: str, attention: str) -> dict:
    out = {}
    if nvfp4_gemm != "auto":
        out["nvfp4_gemm"] = nvfp4_gemm
    if attention != "auto":
        out["attention"] = attention
    return out


class HardwareInfo(io.ComfyNode):
    """Shows the hardware profile and every choice the pack makes on this machine, with the reasons."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SeedVR2BW_HardwareInfo",
            display_name="Hardware Policy (SeedVR2-BW)",
            category=CATEGORY,
            description="Which GEMM path, attention backend, pinned-memory cap and TF32 settings this GPU gets, and why.",
            inputs=[
                io.Combo.Input("nvfp4_gemm", options=["auto", *NVFP4_PATHS], default="auto",
                               tooltip="Force an NVFP4 GEMM path (still self-tested; falls back with a reason)."),
                io.Combo.Input("attention", options=list(ATTENTION_CHOICES),
                               default="auto"),
            ],
            outputs=[io.String.Output(display_name="report")],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, nvfp4_gemm: str, attention: str) -> io.NodeOutput:
        import comfy.model_management as mm
        text = policy.get_policy(mm.get_torch_device(), _policy_overrides(nvfp4_gemm, attention)).summary()
        return io.NodeOutput(text, ui={"text": [text]})


class GemmBenchmark(io.ComfyNode):
    """Runs square matrix products for a given time and reports the achieved TFLOP/s. Interruptible."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SeedVR2BW_GemmBenchmark",
            display_name="GEMM Throughput Probe (SeedVR2-BW)",
            category=CATEGORY,
            description="Measures matrix-multiply throughput on ComfyUI's device (bf16 on GPU, fp32 on CPU).",
            inputs=[
                io.Float.Input("seconds", default=2.0, min=0.1, max=600.0, step=0.1),
                io.Int.Input("size", default=1024, min=64, max=16384, step=64),
            ],
            outputs=[io.String.Output(display_name="report")],
            is_output_node=True,
            not_idempotent=True,
        )

    @classmethod
    def execute(cls, seconds: float, size: int) -> io.NodeOutput:
        import comfy.model_management as mm
        import comfy.utils
        device = mm.get_torch_device()
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        steps = max(1, int(seconds * 10))  # progress/interrupt point every ~0.1 s
        bar = comfy.utils.ProgressBar(steps)
        flops = 0.0
        start = time.perf_counter()
        for step in range(steps):
            slice_end = start + seconds * (step + 1) / steps
            while True:
                a @ b
                flops += 2.0 * size ** 3
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if time.perf_counter() >= slice_end:
                    break
            mm.throw_exception_if_processing_interrupted()
            bar.update_absolute(step + 1, steps)
        elapsed = time.perf_counter() - start
        text = f"{size}x{size} {str(dtype).removeprefix('torch.')} on {device}: {flops / elapsed / 1e12:.3f} TFLOP/s over {elapsed:.2f} s"
        return io.NodeOutput(text, ui={"text": [text]})


NODES = [HardwareInfo, GemmBenchmark]
