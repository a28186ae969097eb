"""The work folder of a streaming upscale, next to its output: the finished units of each chunk (encoded frames,
weighted overlap arrays) and a manifest naming the input (fingerprint), the settings and the model. A unit exists
only once whole: every file is written under a temporary name and renamed, so a killed process leaves whole units
and partial files that the next run ignores. A rerun with the same manifest key continues from what is there;
anything else starts over.
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np

MANIFEST = "manifest.json"


def work_dir_for(out_path: str) -> str:
    out_path = os.path.abspath(out_path.rstrip("/\\"))
    return os.path.join(os.path.dirname(out_path), f".{os.path.basename(out_path)}.seedvr2-work")


def _atomic_json(path: str, data: dict) -> None:
    tmp = path + ".partial"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def file_id(path: str) -> str:
    """A model file as a resume key names it: path, size and modification time (a replaced file does not resume)."""
    try:
        st = os.stat(path)
    except OSError:
        return str(path)
    return f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}"


def unfinished_output(folder: str, prefix: str, key: dict):
    """The output path of an unfinished job in ``folder`` whose name starts with ``prefix`` and whose manifest has
    ``key`` (so a rerun of the same job resumes it), or None."""
    if not os.path.isdir(folder):
        return None
    want = json.loads(json.dumps(key))
    for name in sorted(os.listdir(folder)):
        if not (name.startswith("." + prefix) and name.endswith(".seedvr2-work")):
            continue
        try:
            with open(os.path.join(folder, name, MANIFEST)) as f:
                if json.load(f).get("key") == want:
                    return os.path.join(folder, name[1:-len(".seedvr2-work")])
        except (OSError, ValueError):
            continue
    return None


class WorkDir:
    def __init__(self, out_path: str, key: dict):
        """``key``: everything the output depends on (input fingerprint, settings, model identity)."""
        self.path = work_dir_for(out_path)
        self.key = key
        self.resumed = False

    def open(self, resume: bool) -> "WorkDir":
        """Keeps a folder whose manifest has this key (``resume``), else starts an empty one."""
        man = os.path.join(self.path, MANIFEST)
        if resume and os.path.isfile(man):
            try:
                with open(man) as f:
                    same = json.load(f).get("key") == json.loads(json.dumps(self.key))
            except (OSError, ValueError):
                same = False
            if same:
                self.resumed = True
                return self
        if os.path.isdir(self.path):
            shutil.rmtree(self.path)
        os.makedirs(self.path)
        _atomic_json(man, {"key": self.key})
        return self

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def temp_path(self, name: str) -> str:
        return os.path.join(self.path, f"{name}.partial")

    def has(self, name: str) -> bool:
        return os.path.exists(self.file(name))

    def save_array(self, name: str, a: np.ndarray) -> None:
        tmp = self.temp_path(name)
        with open(tmp, "wb") as f:
            np.save(f, a)
        os.replace(tmp, self.file(name))

    def load_array(self, name: str) -> np.ndarray:
        return np.load(self.file(name))

    def delete(self, *names: str) -> None:
        for n in names:
            if self.has(n):
                os.remove(self.file(n))

    def finished_units(self) -> list[str]:
        return sorted(n for n in os.listdir(self.path) if not n.endswith(".partial") and n != MANIFEST)
