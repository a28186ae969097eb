"""GGUF model files (numz's SeedVR2 GGUFs and other ComfyUI-GGUF / llama.cpp files): read, dequantize, run.

* ``read_gguf(path) -> (tensors, metadata)`` (``reader.py``): memory-mapped, zero-copy; quantized tensors as
  ``GGUFTensor`` (raw uint8 blocks, GGML type, torch shape), plain ones as torch tensors. Needs `gguf` (optional).
* ``dequantize(raw, qtype, shape, dtype)`` (``dequant.py``): pure torch, CPU or CUDA, bit-exact with
  ``gguf.quants.dequantize`` in float32 for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.
* ``GGUFLinear`` / ``replace_with_gguf_linears(model, tensors, keep)`` (``linear.py``): weights stay in their
  blocks, dequantized per forward to the input's dtype and device.
"""
from .format import QUANTIZED_QTYPES, SUPPORTED_QTYPES, GGUFError, QType  # noqa: F401
from .dequant import dequantize, dequantize_blocks, raw_nbytes  # noqa: F401
from .reader import GGUFPackageMissing, GGUFTensor, read_gguf  # noqa: F401
from .linear import GGUFLinear, make_keep_rule, replace_with_gguf_linears  # noqa: F401


def gguf_available() -> bool:
    """Whether the optional `gguf` package (needed by ``read_gguf`` only) is importable."""
    import importlib.util

    return importlib.util.find_spec("gguf") is not None
