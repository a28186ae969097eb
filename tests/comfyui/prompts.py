"""API-format prompts that mix the pack's nodes with ComfyUI core nodes, shared by the in-process and the
server tests.

To cover a new node, add a ``PackPrompt`` to ``PACK_PROMPTS``: a name, the node ids it needs, a function
returning the prompt and a check of the outputs (the ``ui`` dict per output node, as /history shows it).
A prompt whose node ids are not all registered fails the test (a node that should exist but does not load
is a bug), unless ``optional=True`` (then it is skipped with the reason).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

# Node ids that must exist whatever else the pack grows; the full list comes from nodes.all_nodes().
REQUIRED_NODE_IDS = {"SeedVR2BW_HardwareInfo", "SeedVR2BW_GemmBenchmark"}
LONG_NODE_ID = "SeedVR2BW_GemmBenchmark"


def _texts(outputs: dict, node: str) -> list[str]:
    return list((outputs.get(node) or {}).get("text") or [])


def hardware_report_prompt() -> dict:
    """Pack STRING -> core StringConcatenate -> core PreviewAny; the pack node is an output node too."""
    return {
        "1": {"class_type": "SeedVR2BW_HardwareInfo", "inputs": {"nvfp4_gemm": "auto", "attention": "auto"}},
        "2": {"class_type": "StringConcatenate",
              "inputs": {"string_a": "report: ", "string_b": ["1", 0], "delimiter": ""}},
        "3": {"class_type": "PreviewAny", "inputs": {"source": ["2", 0]}},
    }


def check_hardware_report(outputs: dict) -> None:
    preview = _texts(outputs, "3")
    assert preview and preview[0].startswith("report: "), outputs
    own = _texts(outputs, "1")
    assert own and own[0] and own[0] in preview[0], outputs
    assert "cpu" in preview[0].lower(), f"the CPU machine should get the cpu profile: {preview[0]}"


def benchmark_prompt(seconds: float = 0.5, size: int = 64) -> dict:
    return {
        "1": {"class_type": LONG_NODE_ID, "inputs": {"seconds": seconds, "size": size}},
        "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}},
    }


def check_benchmark(outputs: dict) -> None:
    text = _texts(outputs, "2")
    assert text and "TFLOP/s" in text[0], outputs


def core_only_prompt(text: str = "core nodes still work") -> dict:
    return {
        "1": {"class_type": "StringConcatenate", "inputs": {"string_a": text, "string_b": "!", "delimiter": ""}},
        "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}},
    }


def image_roundtrip_prompt(middle: dict | None = None, prefix: str = "seedvr2bw_test") -> dict:
    """EmptyImage -> [a pack IMAGE->IMAGE node given as {"class_type", "inputs"} with the image input
    named in inputs as the placeholder ["0", 0]] -> SaveImage. Ready for IMAGE nodes."""
    prompt = {"1": {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 48, "batch_size": 1, "color": 0x336699}}}
    src = ["1", 0]
    if middle is not None:
        inputs = {k: (src if v == ["0", 0] else v) for k, v in middle["inputs"].items()}
        prompt["2"] = {"class_type": middle["class_type"], "inputs": inputs}
        src = ["2", 0]
    prompt["9"] = {"class_type": "SaveImage", "inputs": {"images": src, "filename_prefix": prefix}}
    return prompt


@dataclasses.dataclass
class PackPrompt:
    name: str
    node_ids: set
    build: Callable[[], dict]
    check: Callable[[dict], None]
    optional: bool = False
    timeout: float = 120.0


PACK_PROMPTS = [
    PackPrompt("hardware_report", {"SeedVR2BW_HardwareInfo"}, hardware_report_prompt, check_hardware_report),
    PackPrompt("gemm_benchmark", {"SeedVR2BW_GemmBenchmark"}, benchmark_prompt, check_benchmark),
]
