"""Session fixtures that bring up a real ComfyUI with this pack: in-process (``comfy_inprocess``) and as a
server (``comfy_server``).

ComfyUI is looked for in ``$COMFYUI_DIR``, else ``<repo>/.comfyui``. When it is not there the tests that
need it are skipped locally, with the command that sets it up; under CI (``CI=true``) they FAIL instead:
CI must never pass by skipping the real-ComfyUI tests.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from comfy_env import SETUP_CMD, find_comfy_dir, need  # noqa: E402
from rig.server import ComfyServer, make_pack_folder  # noqa: E402

UI_OUT = REPO / "test-output" / "ui"
# the second rig, ComfyUI 0.19.3 (tests/rig/setup_comfyui_next.sh, from ../shared where it is there)
NEXT_TARBALL = REPO.parent / "shared" / "comfyui_0.19.3" / "comfyui-0.19.3-seedvr2.tar.gz"
NEXT_TREE = REPO / ".comfyui-0.19.3" / "ComfyUI"
NEXT_PYTHON = REPO / ".venv-comfyui-0.19.3" / "bin" / "python"
NEXT_SETUP = "bash tests/rig/setup_comfyui_next.sh   (bash scripts/run_tests.sh runs it)"


@pytest.fixture(scope="session")
def comfy_dir() -> Path:
    d = find_comfy_dir()
    need(d is not None, f"no ComfyUI in {os.environ.get('COMFYUI_DIR') or REPO / '.comfyui'}; set it up with: {SETUP_CMD}")
    try:
        import aiohttp  # noqa: F401
        import comfyui_frontend_package  # noqa: F401
    except ImportError as exc:
        need(False, f"ComfyUI's requirements are missing in {sys.executable} ({exc}); run: {SETUP_CMD}")
    return d


@pytest.fixture(scope="session")
def pack_parent(tmp_path_factory) -> Path:
    """A custom_nodes folder holding the checkout under an unusual folder name (a symlink)."""
    return make_pack_folder(REPO, tmp_path_factory.mktemp("custom_nodes"))


@pytest.fixture(scope="session")
def comfy_inprocess(comfy_dir, pack_parent, tmp_path_factory):
    from rig.comfy_inprocess import ComfyInProcess
    work = tmp_path_factory.mktemp("inprocess")
    for sub in ("output", "input", "temp"):
        (work / sub).mkdir()
    return ComfyInProcess.get(comfy_dir, custom_node_dirs=[pack_parent], output_dir=work / "output",
                              input_dir=work / "input", temp_dir=work / "temp")


@pytest.fixture(scope="session")
def pack_node_ids(comfy_inprocess) -> list[str]:
    """Every node id the pack defines, read from the pack itself (nodes.all_nodes())."""
    from seedvr2bw.nodes import all_nodes
    return sorted(cls.GET_SCHEMA().node_id for cls in all_nodes())


@pytest.fixture(scope="session")
def comfy_server(comfy_dir, pack_parent, tmp_path_factory):
    srv = ComfyServer(comfy_dir, custom_node_dirs=[pack_parent], workdir=tmp_path_factory.mktemp("server"))
    srv.start()
    yield srv
    alive = srv.alive()
    srv.stop()
    assert alive, f"the ComfyUI server died during the session:\n{srv.log_tail()}"


@pytest.fixture(scope="session")
def next_rig():
    """(tree, python) of ComfyUI 0.19.3; skipped with the reason where ../shared has no 0.19.3 (a user's fresh clone),
    failed under CI where the tree is there but not set up."""
    if not NEXT_TARBALL.is_file():
        pytest.skip(f"no ComfyUI 0.19.3 here ({NEXT_TARBALL} is absent: ../shared is not beside this clone)")
    need(NEXT_TREE.joinpath("comfyui_version.py").is_file() and NEXT_PYTHON.is_file(),
         f"the ComfyUI 0.19.3 rig is not set up in {NEXT_TREE.parent}; run: {NEXT_SETUP}")
    return NEXT_TREE, NEXT_PYTHON


@pytest.fixture(scope="session")
def next_server(next_rig, pack_parent, tmp_path_factory):
    """A ComfyUI 0.19.3 server (its own venv) with the pack, one for the session."""
    tree, python = next_rig
    srv = ComfyServer(tree, custom_node_dirs=[pack_parent], workdir=tmp_path_factory.mktemp("server_0193"),
                      python=str(python))
    srv.start(timeout=300)
    yield srv
    alive = srv.alive()
    srv.stop()
    assert alive, f"the ComfyUI 0.19.3 server died during the tests:\n{srv.log_tail()}"


@pytest.fixture(scope="session")
def ui_out_dir() -> Path:
    UI_OUT.mkdir(parents=True, exist_ok=True)
    return UI_OUT
