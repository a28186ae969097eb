"""Writes README.md's settings table (between the ``settings-table`` marker comments) from the knob table,
``optimization/runtime/knobs.py``; ``--check`` exits 1 when README.md is out of date.

    python scripts/gen_settings_table.py [--check]
"""
import sys
from pathlib import Path

import _pack  # noqa: F401
from seedvr2bw.optimization.attention import CHOICES as ATTENTION_CHOICES
from seedvr2bw.optimization.nvfp4.dispatch import NVFP4_PATHS
from seedvr2bw.optimization.runtime import knobs
from seedvr2bw.optimization.runtime.device import PROFILES

README = Path(__file__).resolve().parents[1] / "README.md"
BEGIN, END = "<!-- settings-table: begin (scripts/gen_settings_table.py) -->", "<!-- settings-table: end -->"
NAMES = {"PROFILE": PROFILES, "NVFP4_GEMM": NVFP4_PATHS,
         "ATTENTION": tuple(c for c in ATTENTION_CHOICES if c != "auto")}


def render(text: str) -> str:
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{knobs.markdown_table(NAMES)}\n{END}{tail}"


def main(argv) -> int:
    text = README.read_text(encoding="utf-8")
    new = render(text)
    if "--check" in argv:
        if new != text:
            print("README.md's settings table is out of date: run python scripts/gen_settings_table.py")
            return 1
        return 0
    README.write_text(new, encoding="utf-8")
    print("wrote README.md's settings table")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
