"""The reference NVFP4 implementations our format is tested against, imported once for all NVFP4 tests.

comfy-kitchen (PyPI `comfy-kitchen`: its eager backend runs on CPU) and nvidia-modelopt (PyPI
`nvidia-modelopt`: `NVFP4QTensor.quantize` is plain PyTorch). Both are in the test group of pyproject.toml;
tests that need one skip with the reason when it is missing.
"""
import pytest

try:
    import comfy_kitchen
    from comfy_kitchen import float_utils as ck_fu
    from comfy_kitchen.backends.eager import quantization as ck_q
    from comfy_kitchen.tensor import QuantizedTensor, TensorCoreNVFP4Layout
except Exception as exc:  # noqa: BLE001
    comfy_kitchen = ck_fu = ck_q = QuantizedTensor = TensorCoreNVFP4Layout = None
    CK_WHY = f"comfy-kitchen not importable ({type(exc).__name__}: {exc}); pip install comfy-kitchen"
else:
    CK_WHY = ""

try:
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
except Exception as exc:  # noqa: BLE001
    NVFP4QTensor = None
    MO_WHY = f"nvidia-modelopt not importable ({type(exc).__name__}: {exc}); pip install nvidia-modelopt"
else:
    MO_WHY = ""

needs_ck = pytest.mark.skipif(ck_q is None, reason=CK_WHY)
needs_mo = pytest.mark.skipif(NVFP4QTensor is None, reason=MO_WHY)
