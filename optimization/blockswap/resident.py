"""The default block runner: every block stays where it is (on the GPU)."""
from __future__ import annotations


class ResidentRunner:
    """`for block in runner.iterate(self.blocks): ...` yields the blocks as they are.

    `reverse=True` yields them last to first (training: backward order with the same runner).
    """

    swapped_indices: list = []
    closed = False

    def iterate(self, blocks, reverse: bool = False):
        seq = range(len(blocks) - 1, -1, -1) if reverse else range(len(blocks))
        for i in seq:
            yield blocks[i]

    def close(self, restore_device=None) -> None:  # same interface as BlockSwapRunner
        return None

    def stats(self) -> dict:
        return {"runner": "resident"}

    def __repr__(self):
        return "ResidentRunner()"
