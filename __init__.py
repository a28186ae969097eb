"""SeedVR2 Blackwell: a ComfyUI node pack (SeedVR2 upscaling, NVFP4 linears, BlockSwap, FLUX LoRA training).

ComfyUI imports this folder as a package (whatever its folder name) and calls ``comfy_entrypoint``.
Importing the package itself stays light: no ComfyUI, no model code. The library parts
(``models``, ``optimization``, ``training``) can be imported without ComfyUI being present.
"""
import logging

_log = logging.getLogger(__name__)
__version__ = "0.1.0"


async def comfy_entrypoint():
    """ComfyUI V3 entry point. A failure to import the nodes is logged with the reason and the fix,
    and the pack then registers nothing instead of breaking ComfyUI's start-up."""
    from comfy_api.latest import ComfyExtension

    try:
        from .nodes import all_nodes
        node_list = all_nodes()
    except Exception as exc:  # noqa: BLE001 - the user must see why, ComfyUI must keep running
        _log.error(
            "[SeedVR2-BW] the node pack failed to load: %s: %s. "
            "Fix: run `pip install -r requirements.txt` inside the python that runs ComfyUI, then restart. "
            "Run `python scripts/nvfp4_diagnostic.py` in this folder for details.",
            type(exc).__name__, exc, exc_info=True,
        )
        node_list = []

    class SeedVR2BlackwellExtension(ComfyExtension):
        async def get_node_list(self):
            return node_list

    return SeedVR2BlackwellExtension()
