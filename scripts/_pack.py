"""Lets a script in scripts/ import the pack as `seedvr2bw` (see pack_import.py)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pack_import import import_pack  # noqa: E402

import_pack()


def git_commit() -> str:
    """The commit a benchmark ran on: $GIT_COMMIT (the device copy has no .git), else git, else "unknown"."""
    import os
    import subprocess
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    except Exception:  # noqa: BLE001 - no git on the machine
        out = ""
    return out or "unknown"
