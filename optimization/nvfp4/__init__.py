"""NVFP4 / FP8 linear formats. ``format.py``: the stored layout (nibble order hi_first, 128x4 swizzled E4M3 block
scales); ``linear.py``: the layers; ``dispatch.py``: which kernel runs them; ``surgery.py``: putting them into a
model; ``checkpoint.py`` / ``convert.py``: ComfyUI's quantized checkpoints. See README.md."""
