"""Lets a script in scripts/ import the pack as `seedvr2bw` (see pack_import.py)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pack_import import import_pack  # noqa: E402

import_pack()
