"""Collects the V3 node classes of every feature module.

A feature module that fails to import (a missing optional dependency, say) is logged with its reason and
skipped; the other features still register.
"""
import importlib
import logging

_log = logging.getLogger(__name__)

FEATURE_MODULES = ("hardware", "seedvr2", "video", "blockswap", "nvfp4", "training", "diagnostic")


def all_nodes():
    try:  # the short exception type names of ComfyUI's error panel; the nodes work without them
        importlib.import_module(".errors", __name__)
    except Exception as exc:  # noqa: BLE001
        _log.error("[SeedVR2-BW] nodes/errors.py not loaded: %s: %s", type(exc).__name__, exc, exc_info=True)
    nodes = []
    for name in FEATURE_MODULES:
        try:
            module = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            _log.error("[SeedVR2-BW] nodes/%s.py not loaded: missing module %r. Fix: pip install -r requirements.txt",
                       name, exc.name)
            continue
        except Exception as exc:  # noqa: BLE001
            _log.error("[SeedVR2-BW] nodes/%s.py not loaded: %s: %s", name, type(exc).__name__, exc, exc_info=True)
            continue
        nodes.extend(module.NODES)
    return nodes
