"""NVFP4 / FP8 linear formats: exact CPU format code, quantized linears, checkpoints, Triton kernels.

See ``format.py`` for the stored layout (nibble order hi_first, 128x4 swizzled E4M3 block scales) and
``linear.py`` for the execution paths.
"""
from .format import (NIBBLE_ORDER, NVFP4Tensor, dequantize_nvfp4, quantize_nvfp4, swizzle_block_scales,  # noqa: F401
                     unswizzle_block_scales)
from .linear import (FP8Linear, NVFP4Linear, PATHS, make_keep_rule, quantize_model_linears,  # noqa: F401
                     replace_linears)
