"""Every documentation reference in the product code, the tests and the docs points at something that exists.

* ``docs/NAME.md`` names a file of the repository;
* ``docs/NAME.md §N`` (and ``§M`` items that follow it in one list, ``§6 step 3``) names a numbered heading of that
  file (``## N.`` / ``### N.M``) and, for a step, a numbered item of that section;
* the old shorthand for the spec (the word SPEC then a section sign, without ``docs/…md``) is not used;
* no reference to notes kept outside the repository (``notes/…md``, ``offloading.md``).
"""
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = {".py", ".md", ".sh", ".cu", ".cuh", ".toml", ".txt"}
SKIP_DIRS = {"__pycache__", "data", "out", "test-output", "node_modules"}
SECTION = "\u00a7"

# "docs/X.md" not preceded by "<rev>:" (git object syntax names a file of another commit, which may be gone)
DOC_PATH = re.compile(r"(?<![\w:/.-])docs/([A-Za-z0-9_.-]+\.md)")
# "docs/X.md §1.2, §3 step 4" -> the file, then the section list
DOC_SECTIONS = re.compile(r"(?<![\w:/.-])docs/([A-Za-z0-9_.-]+\.md)`?,?\s*((?:(?:,|and|;)?\s*" + SECTION
                          + r"\s*\d+(?:\.\d+)*(?:\s+step\s+\d+)?\s*)+)")
ONE_SECTION = re.compile(SECTION + r"\s*(\d+(?:\.\d+)*)(?:\s+step\s+(\d+))?")
BARE_SPEC = re.compile(r"(?<![\w/])SPEC\s*" + SECTION)
OUTSIDE_NOTES = re.compile(r"(?<![\w/.-])(notes/[\w./-]+\.md|offloading\.md)")
HEADING = re.compile(r"^(#{1,6})\s+(\d+(?:\.\d+)*)[.)]?\s")


def _files():
    """The repository's own files (dot folders such as .venv, .git and the rig's ComfyUI are not walked)."""
    me = Path(__file__).resolve()
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS)
        for name in sorted(names):
            path = Path(folder) / name
            if path.suffix in SUFFIXES and path.resolve() != me:
                yield path.relative_to(ROOT)


def _sections(doc: Path):
    """{"1.2": [body lines]} for every numbered heading of ``doc``."""
    out, current, level, fenced = {}, None, 0, False
    for line in doc.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        m = None if fenced else HEADING.match(line)
        if m:
            current, level = m.group(2), len(m.group(1))
            out[current] = []
        elif not fenced and line.startswith("#") and current is not None \
                and len(line) - len(line.lstrip("#")) <= level:
            current = None  # an unnumbered heading at the same or a higher level ends the section
        elif current is not None:
            out[current].append(line)
    return out


def _section_body(sections, number):
    """The section's lines including those of its subsections (1 covers 1.1, 1.2, ...)."""
    return [line for key, body in sections.items() if key == number or key.startswith(number + ".") for line in body]


def _references():
    for rel in _files():
        text = (ROOT / rel).read_text(encoding="utf-8", errors="replace")
        for lineno, line in enumerate(text.splitlines(), 1):
            yield rel, lineno, line


def test_docs_folder_has_the_referenced_documents():
    assert (ROOT / "docs" / "SPEC.md").is_file() and (ROOT / "docs" / "PERFORMANCE.md").is_file()


def test_every_docs_reference_resolves():
    problems, checked, cache = [], 0, {}
    for rel, lineno, line in _references():
        where = f"{rel}:{lineno}"
        for m in DOC_PATH.finditer(line):
            if not (ROOT / "docs" / m.group(1)).is_file():
                problems.append(f"{where}: docs/{m.group(1)} does not exist")
        for m in DOC_SECTIONS.finditer(line):
            doc = ROOT / "docs" / m.group(1)
            if not doc.is_file():
                continue  # reported above
            sections = cache.setdefault(doc, _sections(doc))
            for s in ONE_SECTION.finditer(m.group(2)):
                checked += 1
                number, step = s.group(1), s.group(2)
                if number not in sections:
                    problems.append(f"{where}: docs/{m.group(1)} has no section {SECTION}{number}")
                elif step and not any(re.match(rf"\s*{step}\.\s", b) for b in _section_body(sections, number)):
                    problems.append(f"{where}: docs/{m.group(1)} {SECTION}{number} has no step {step}")
        if BARE_SPEC.search(line):
            problems.append(f"{where}: write 'docs/SPEC.md {SECTION}N' instead of the bare SPEC shorthand")
        for m in OUTSIDE_NOTES.finditer(line):
            if not (ROOT / m.group(1)).is_file():
                problems.append(f"{where}: {m.group(1)} is not in the repository")
    assert not problems, "\n".join(problems)
    assert checked >= 25  # the code cites the spec's sections this often; fewer means the pattern broke


@pytest.mark.parametrize("text, ok", [
    ("see docs/SPEC.md §1.7, §3 and §6 step 7", True),
    ("see docs/SPEC.md §9", False),
    ("see docs/SPEC.md §6 step 99", False),
    ("see docs/SPEC.md §1.9", False),
])
def test_the_checker_itself(text, ok):
    doc = ROOT / "docs" / "SPEC.md"
    sections = _sections(doc)
    m = DOC_SECTIONS.search(text)
    assert m is not None
    good = True
    for s in ONE_SECTION.finditer(m.group(2)):
        number, step = s.group(1), s.group(2)
        if number not in sections:
            good = False
        elif step and not any(re.match(rf"\s*{step}\.\s", b) for b in _section_body(sections, number)):
            good = False
    assert good is ok
