"""Scene cuts, found cheaply on the decoded frames: a chunk of the streaming upscale never spans a cut (a
cross-fade or the model's temporal context across a cut would smear one shot into the next).

A frame's signature is the mean colour of each cell of an 8 × 8 grid; a cut is a frame whose signature differs
from the previous frame's by more than ``threshold`` (mean absolute difference, colours in [0, 1]). Camera motion
and lighting changes inside a shot stay well below the default; a hard cut between two shots lands far above it.
"""
from __future__ import annotations

import numpy as np

GRID = 8
DEFAULT_THRESHOLD = 0.12


def signature(frame: np.ndarray) -> np.ndarray:
    """(H, W, 3) in [0, 1] -> (GRID, GRID, 3) cell means (cells split as evenly as the size allows)."""
    h, w = frame.shape[:2]
    ys = np.linspace(0, h, GRID + 1).astype(int)
    xs = np.linspace(0, w, GRID + 1).astype(int)
    rows = np.add.reduceat(frame.astype(np.float32), ys[:-1], axis=0) / np.diff(ys)[:, None, None]
    cells = np.add.reduceat(rows, xs[:-1], axis=1) / np.diff(xs)[None, :, None]
    return cells


class CutDetector:
    """Feed frames in order; ``is_cut(frame)`` says whether this frame starts a new shot."""

    def __init__(self, threshold: float = DEFAULT_THRESHOLD):
        self.threshold = float(threshold)
        self.prev = None

    def is_cut(self, frame: np.ndarray) -> bool:
        sig = signature(frame)
        prev, self.prev = self.prev, sig
        if prev is None or self.threshold <= 0:
            return False
        return float(np.abs(sig - prev).mean()) > self.threshold
