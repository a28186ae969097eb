"""The rig's own policy: without a ComfyUI the real-ComfyUI tests skip locally (with the set-up command)
and FAIL under CI, so that CI can never go green by skipping them."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from .conftest import REPO

TARGET = "tests/comfyui/test_server.py::test_server_started_with_the_pack"


def _run(tmp_path, ci: str | None):
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["COMFYUI_DIR"] = str(tmp_path / "no-comfyui-here")
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", TARGET, "-q", "-rs", "-p", "no:cacheprovider"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("ci, expect_rc, expect_text", [
    (None, 0, "bash tests/rig/setup_comfyui.sh"),   # local: skipped, and told how to set it up
    ("true", 1, "[CI] no ComfyUI"),                   # CI: a failure, not a skip
])
def test_missing_comfyui_skips_locally_and_fails_in_ci(tmp_path, ci, expect_rc, expect_text):
    r = _run(tmp_path, ci)
    out = r.stdout + r.stderr
    assert r.returncode == expect_rc, out[-3000:]
    assert expect_text in out, out[-3000:]
    assert ("1 skipped" in out) == (ci is None), out[-3000:]
