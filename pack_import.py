"""Import this checkout as a package outside ComfyUI (tests, scripts).

Inside ComfyUI the pack is imported by its folder name. Elsewhere we register the checkout under a fixed
name, ``seedvr2bw``, so that the relative imports inside the pack work from any folder name.
"""
import importlib.util
import sys
from pathlib import Path

PACK_NAME = "seedvr2bw"
PACK_ROOT = Path(__file__).resolve().parent


def import_pack(name: str = PACK_NAME):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        name, PACK_ROOT / "__init__.py", submodule_search_locations=[str(PACK_ROOT)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
