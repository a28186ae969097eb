"""Every exception type the pack defines reports the short module name ``seedvr2bw`` (nodes/errors.py), so that
ComfyUI's error panel prints ``seedvr2bw.SeedVR2InputError`` and not the folder path of the pack."""
import ast
import builtins
from pathlib import Path

from seedvr2bw.nodes.errors import SHORT_MODULE, USER_ERRORS

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("models", "optimization", "training", "nodes")


def exception_classes_in_source() -> set:
    """Names of the classes the pack's source derives from an exception (builtin or the pack's own)."""
    known = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
    classes = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef):
                    bases = {b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                             if isinstance(b, (ast.Name, ast.Attribute))}
                    classes.append((node.name, bases))
    found, grew = set(), True
    while grew:
        grew = False
        for name, bases in classes:
            if name not in found and bases & (known | found):
                found.add(name)
                grew = True
    return found


def test_every_exception_class_is_listed():
    listed = {c.__name__ for c in USER_ERRORS}
    assert exception_classes_in_source() == listed, (
        "an exception class of the pack is missing from nodes/errors.py USER_ERRORS (or listed but gone): "
        f"source {sorted(exception_classes_in_source())}, listed {sorted(listed)}")


def test_short_module_name():
    for cls in USER_ERRORS:
        assert cls.__module__ == SHORT_MODULE == "seedvr2bw", cls
        assert f"{cls.__module__}.{cls.__qualname__}" == f"seedvr2bw.{cls.__name__}"
