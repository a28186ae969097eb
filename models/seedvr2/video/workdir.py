"""The work folder of a streaming upscale, next to its output: one encoded segment per finished chunk, the
blended-but-unwritten overlap of the last one, and a manifest naming the input (fingerprint), the settings and the
chunks done. A rerun with the same input and settings continues after the last complete chunk; anything else
starts over. Every file is written to a temporary name and renamed, so a killed process leaves only whole files.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import numpy as np

MANIFEST = "manifest.json"


def work_dir_for(out_path: str) -> str:
    out_path = os.path.abspath(out_path.rstrip("/\\"))
    return os.path.join(os.path.dirname(out_path), f".{os.path.basename(out_path)}.seedvr2-work")


def _atomic_json(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class WorkDir:
    def __init__(self, out_path: str, key: dict):
        """``key``: everything the output depends on (input fingerprint, settings, model identity)."""
        self.path = work_dir_for(out_path)
        self.key = key
        self.chunks: list[dict] = []     # {"index", "start", "end", "segment", "written_end"} in order
        self.resumed = False

    # ------------------------------------------------------------------ lifecycle
    def open(self, resume: bool) -> "WorkDir":
        """Loads a matching manifest (``resume``) or starts an empty folder."""
        man = os.path.join(self.path, MANIFEST)
        if resume and os.path.isfile(man):
            try:
                with open(man) as f:
                    data = json.load(f)
            except (OSError, ValueError):
                data = {}
            if data.get("key") == self.key:
                self.chunks = [c for c in data.get("chunks", []) if self._complete(c)]
                self.resumed = bool(self.chunks)
                return self
        if os.path.isdir(self.path):
            shutil.rmtree(self.path)
        os.makedirs(self.path)
        self._save()
        return self

    def _complete(self, c: dict) -> bool:
        return os.path.exists(os.path.join(self.path, c["segment"]))

    def _save(self) -> None:
        _atomic_json(os.path.join(self.path, MANIFEST), {"key": self.key, "chunks": self.chunks})

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    # ------------------------------------------------------------------ chunks
    def segment_name(self, index: int, ext: str) -> str:
        return f"seg_{index:06d}{ext}"

    def temp_path(self, name: str) -> str:
        return os.path.join(self.path, f"{name}.partial")

    def commit_chunk(self, index: int, start: int, end: int, written_end: int, segment: str,
                     tail: Optional[np.ndarray]) -> None:
        """Records a finished chunk: its segment (already renamed into place) and the overlap frames it hands to
        the next chunk (weighted, float32); older tails are deleted."""
        tail_name = f"tail_{index:06d}.npy"
        if tail is not None:
            tmp = os.path.join(self.path, tail_name + ".partial")
            with open(tmp, "wb") as f:
                np.save(f, tail)
            os.replace(tmp, os.path.join(self.path, tail_name))
        self.chunks.append({"index": index, "start": start, "end": end, "written_end": written_end,
                            "segment": segment, "tail": tail_name if tail is not None else None})
        self._save()
        for c in self.chunks[:-1]:
            if c.get("tail"):
                p = os.path.join(self.path, c["tail"])
                if os.path.exists(p):
                    os.remove(p)

    def done(self, index: int) -> Optional[dict]:
        return self.chunks[index] if index < len(self.chunks) else None

    def tail(self, index: int) -> Optional[np.ndarray]:
        c = self.chunks[index]
        return np.load(os.path.join(self.path, c["tail"])) if c.get("tail") else None

    def segments(self) -> list[str]:
        return [os.path.join(self.path, c["segment"]) for c in self.chunks]
