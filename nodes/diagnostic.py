"""The pre-flight diagnostic as a node: the same report as ``python scripts/nvfp4_diagnostic.py``."""
from __future__ import annotations

from comfy_api.latest import io

from ..optimization.diagnostics import render_json, render_text, run_diagnostics
from .types import CATEGORY


class Diagnostic(io.ComfyNode):
    """Measures pinned/pageable bandwidth, copy/compute overlap, NVFP4/FP8 GEMM paths, attention backends and
    whether BlockSwap copies would hide behind compute; PASS/WARN/FAIL/SKIP with the number behind each."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SeedVR2BW_Diagnostic",
            display_name="Pre-flight Diagnostic (SeedVR2-BW)",
            category=CATEGORY,
            description="Measures whether this machine gets the pack's fast paths (same report as "
                        "scripts/nvfp4_diagnostic.py). Uses ~1 GiB of VRAM and pinned RAM while it runs.",
            inputs=[
                io.Boolean.Input("quick", default=True,
                                 tooltip="Smaller buffers and fewer repetitions (a few seconds); off: the full run."),
                io.Boolean.Input("details", default=True, tooltip="Show the detail line under every check."),
            ],
            outputs=[io.String.Output(display_name="report"), io.String.Output(display_name="json")],
            is_output_node=True,
            not_idempotent=True,
        )

    @classmethod
    def execute(cls, quick: bool = True, details: bool = True) -> io.NodeOutput:
        device = None
        progress = None
        try:
            import comfy.model_management as mm
            import comfy.utils
            device = mm.get_torch_device()
            bar = comfy.utils.ProgressBar(40)

            def progress(_result):
                mm.throw_exception_if_processing_interrupted()
                bar.update(1)
        except ImportError:  # outside ComfyUI (tests): default device, no progress bar
            pass
        report = run_diagnostics(device=device, quick=quick, progress=progress)
        text = render_text(report, verbose=details)
        return io.NodeOutput(text, render_json(report), ui={"text": [text]})


NODES = [Diagnostic]
