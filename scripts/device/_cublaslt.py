"""cuBLASLt through ctypes: one bf16/fp16 linear ``D = X @ W^T + bias`` whose output may be a column slice of a
wider matrix (row stride ldd > n), with the bias in the GEMM's epilogue.

Probe-only (scripts/device/l2_persist_probe.py: weight slabs multiplied into column slices of one output); first
written for the session 9 "slabs" kernel (commit cf7a84a), which was reverted.

Why: torch only puts the bias in cuBLASLt's epilogue when the output is contiguous (``addmm`` otherwise copies the
broadcast bias into the output first and multiplies with beta = 1: one more write and read of the output). The
NVFP4 fidelity path for large M multiplies the weight slab by slab straight into column slices of one output
(``linear.NVFP4Linear._fidelity_slabs``), so it needs this call. The library is the one torch already loaded.

Row-major ``D[m, n] = X[m, k] @ W[n, k]^T`` is column-major ``D^T (n x m, ld = ldd) = W (k x n, ld = ldw)^T @
X^T (k x m, ld = ldx)``: cuBLAS's A is W transposed, B is X, and the bias (length n = D^T's rows) is broadcast
along the columns, as the epilogue wants it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

import torch

log = logging.getLogger(__name__)

# cublasLt.h / cublas_api.h / library_types.h (stable ABI values)
_COMPUTE_32F = 68
_R_32F, _R_16F, _R_16BF = 0, 2, 14
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 3, 4, 7, 8
_EPILOGUE_DEFAULT, _EPILOGUE_BIAS = 1, 4
_PREF_MAX_WORKSPACE_BYTES = 1
_PREF_MIN_ALIGNMENT = (5, 6, 7, 8)          # A, B, C, D
WORKSPACE_BYTES = 32 << 20                   # what cuBLAS asks for on Hopper; shared by every call on a device
_DTYPES = {torch.bfloat16: _R_16BF, torch.float16: _R_16F}


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class LtError(RuntimeError):
    pass


_LIB: list = []          # [CDLL] or [None, reason]
_HANDLES: dict = {}      # device index -> (handle, workspace tensor)


def _library_path() -> str | None:
    """The libcublasLt torch loaded (its own wheel's copy), else whatever the loader finds."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if "libcublasLt.so" in line:
                    return line.split()[-1]
    except OSError:
        pass
    return ctypes.util.find_library("cublasLt")


def _lib():
    if not _LIB:
        try:
            torch.cuda.init()
            path = _library_path()
            if path is None:
                raise OSError("libcublasLt not found")
            lib = ctypes.CDLL(path)
            vp, i32, szt = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
            lib.cublasLtCreate.argtypes = [ctypes.POINTER(vp)]
            lib.cublasLtMatmulDescCreate.argtypes = [ctypes.POINTER(vp), i32, i32]
            lib.cublasLtMatmulDescSetAttribute.argtypes = [vp, i32, vp, szt]
            lib.cublasLtMatrixLayoutCreate.argtypes = [ctypes.POINTER(vp), i32, ctypes.c_uint64, ctypes.c_uint64,
                                                       ctypes.c_int64]
            lib.cublasLtMatmulPreferenceCreate.argtypes = [ctypes.POINTER(vp)]
            lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [vp, i32, vp, szt]
            lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [vp, vp, vp, vp, vp, vp, vp, i32,
                                                           ctypes.POINTER(_HeuristicResult), ctypes.POINTER(i32)]
            lib.cublasLtMatmul.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, szt, vp]
            for name in ("cublasLtMatmulDescDestroy", "cublasLtMatrixLayoutDestroy", "cublasLtMatmulPreferenceDestroy"):
                getattr(lib, name).argtypes = [vp]
            _LIB.append(lib)
        except (OSError, AttributeError, RuntimeError) as exc:
            _LIB.extend([None, f"{type(exc).__name__}: {exc}"])
    return _LIB[0]


def available() -> tuple[bool, str]:
    """(usable, reason): cuBLASLt can be called here."""
    if os.environ.get("SEEDVR2BW_CUBLASLT", "1") == "0":
        return False, "SEEDVR2BW_CUBLASLT=0"
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    if _lib() is None:
        return False, _LIB[1]
    return True, "ok"


def _check(status: int, what: str):
    if status != 0:
        raise LtError(f"{what} returned cuBLAS status {status}")


def _handle(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    ent = _HANDLES.get(index)
    if ent is None:
        lib = _lib()
        h = ctypes.c_void_p()
        with torch.cuda.device(index):
            _check(lib.cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
            ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{index}")
        ent = _HANDLES[index] = (h, ws)
    return ent


def alignment_of(*values: int) -> int:
    """The largest power of two <= 256 dividing every value (byte addresses, byte strides)."""
    a = 256
    for v in values:
        while a > 1 and v % a:
            a //= 2
    return a


class LtLinear:
    """``D[m, n] = X[m, k] @ W[n, k]^T (+ bias[n])`` for fixed shapes, strides and dtype: the descriptors and the
    algorithm are chosen once; per call: one or two ctypes calls. Row strides in elements: ``ldx`` >= k,
    ``ldw`` >= k, ``ldd`` >= n. ``align`` (bytes): every pointer passed later (and the bias pointer) is a multiple
    of it. The bias pointer is set per call: block swap re-points the bias tensor's storage between calls."""

    def __init__(self, m: int, n: int, k: int, ldx: int, ldw: int, ldd: int, dtype: torch.dtype,
                 device: torch.device, has_bias: bool = False, align: int = 256):
        if dtype not in _DTYPES:
            raise LtError(f"cuBLASLt linear: dtype {dtype} is not bf16/fp16")
        lib = _lib()
        if lib is None:
            raise LtError(f"cuBLASLt unavailable: {_LIB[1]}")
        self._lib, self.device = lib, device
        self._handle, self._ws = _handle(device)
        self.has_bias, self.align = has_bias, align
        t = _DTYPES[dtype]
        vp = ctypes.c_void_p
        self._desc, self._a, self._b, self._d = vp(), vp(), vp(), vp()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self._desc), _COMPUTE_32F, _R_32F), "MatmulDescCreate")
        self._set(_DESC_TRANSA, ctypes.c_int32(_OP_T))
        self._set(_DESC_TRANSB, ctypes.c_int32(_OP_N))
        if has_bias:
            self._set(_DESC_EPILOGUE, ctypes.c_uint32(_EPILOGUE_BIAS))
        else:
            self._set(_DESC_EPILOGUE, ctypes.c_uint32(_EPILOGUE_DEFAULT))
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self._a), t, k, n, ldw), "MatrixLayoutCreate A")
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self._b), t, k, m, ldx), "MatrixLayoutCreate B")
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self._d), t, n, m, ldd), "MatrixLayoutCreate D")
        pref = vp()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
        try:
            ws = ctypes.c_uint64(WORKSPACE_BYTES)
            _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), 8),
                   "PreferenceSetAttribute")
            for attr in _PREF_MIN_ALIGNMENT:
                a = ctypes.c_uint32(align)
                _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(a), 4),
                       "PreferenceSetAttribute")
            res, count = _HeuristicResult(), ctypes.c_int(0)
            _check(lib.cublasLtMatmulAlgoGetHeuristic(self._handle, self._desc, self._a, self._b, self._d, self._d,
                                                      pref, 1, ctypes.byref(res), ctypes.byref(count)),
                   "MatmulAlgoGetHeuristic")
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        if count.value < 1 or res.state != 0:
            raise LtError(f"cuBLASLt found no algorithm for {m}x{n}x{k} (ldd={ldd}, align={align})")
        self._algo = res.algo
        self._alpha, self._beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._ws_ptr, self._ws_size = self._ws.data_ptr(), WORKSPACE_BYTES

    def _set(self, attr: int, value):
        _check(self._lib.cublasLtMatmulDescSetAttribute(self._desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
               f"MatmulDescSetAttribute({attr})")

    def __call__(self, x_ptr: int, w_ptr: int, d_ptr: int, stream: int, bias_ptr: int | None = None):
        if self.has_bias:
            self._set(_DESC_BIAS_POINTER, ctypes.c_void_p(bias_ptr))
        _check(self._lib.cublasLtMatmul(self._handle, self._desc, ctypes.byref(self._alpha), w_ptr, self._a, x_ptr,
                                        self._b, ctypes.byref(self._beta), d_ptr, self._d, d_ptr, self._d,
                                        ctypes.byref(self._algo), self._ws_ptr, self._ws_size, stream),
               "cublasLtMatmul")

    def __del__(self):
        lib = getattr(self, "_lib", None)
        if lib is None:
            return
        for name, fn in (("_desc", "cublasLtMatmulDescDestroy"), ("_a", "cublasLtMatrixLayoutDestroy"),
                         ("_b", "cublasLtMatrixLayoutDestroy"), ("_d", "cublasLtMatrixLayoutDestroy")):
            h = getattr(self, name, None)
            if h is not None and h.value:
                getattr(lib, fn)(h)

