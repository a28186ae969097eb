"""Whether a checkpointed block is being recomputed for its backward, which follows right away.

Inside that recompute the fp8-dequant / NVFP4 autograd functions of ``quant.py`` keep the weight they dequantized
for the backward (one dequantization instead of two per Linear and step; the extra memory is one block's weights,
freed with its backward). A plain forward never enters it, so the model is never held dequantized as a whole.
"""
from __future__ import annotations


class RecomputeScope:
    """Context manager around a block's recompute (``flux_forward``); ``depth`` > 0 inside (nestable).

    A plain attribute, not a property: the quantized Linears read it on every call."""

    __slots__ = ("depth",)

    def __init__(self):
        self.depth = 0

    def __enter__(self):
        self.depth += 1
        return self

    def __exit__(self, *exc):
        self.depth -= 1
        return False


# the one scope the block checkpoint enters and the quantized base reads
recompute = RecomputeScope()
