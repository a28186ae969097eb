"""Where the test ComfyUI is, and the one rule for tests that need it: skip locally, FAIL under CI=true
(CI must never pass by skipping the real-ComfyUI tests).

ComfyUI is looked for in ``$COMFYUI_DIR``, else ``<repo>/.comfyui`` (set up by ``tests/rig/setup_comfyui.sh``).
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SETUP_CMD = "bash tests/rig/setup_comfyui.sh   (or: bash scripts/run_tests.sh, which runs it when needed)"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def need(condition: bool, reason: str) -> None:
    """Skip locally, fail in CI."""
    if condition:
        return
    if in_ci():
        pytest.fail(f"[CI] {reason}", pytrace=False)
    pytest.skip(reason)


def find_comfy_dir() -> Path | None:
    cand = Path(os.environ.get("COMFYUI_DIR") or REPO / ".comfyui").expanduser()
    if all((cand / p).exists() for p in ("main.py", "nodes.py", "comfy", "comfyui_version.py")):
        return cand.resolve()
    return None


def require_comfy() -> Path:
    """Puts ComfyUI on sys.path in CPU mode (``args.cpu`` must be set before comfy.model_management loads)."""
    d = find_comfy_dir()
    need(d is not None, f"no ComfyUI in {os.environ.get('COMFYUI_DIR') or REPO / '.comfyui'}; set it up with: {SETUP_CMD}")
    if str(d) not in sys.path:
        sys.path.insert(0, str(d))
    from comfy.cli_args import args
    if "comfy.model_management" not in sys.modules:
        args.cpu = True
    import comfy.model_management  # noqa: F401
    return d


def import_node_module(name: str):
    """``seedvr2bw.nodes.<name>`` with ComfyUI's ``comfy_api`` importable."""
    require_comfy()
    return importlib.import_module(f"seedvr2bw.nodes.{name}")
