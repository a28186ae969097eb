"""Compiling the Hopper kernels' CUDA sources on a machine without a GPU, for the host tests: NVRTC 13 (what
``torch.cuda._compile_kernel`` runs on users' machines; the nvidia-cuda-nvrtc wheel of requirements-test.txt) and
nvcc (when a CUDA toolkit is installed). Each returns ptxas' report, which the tests read for spills and for
serialized wgmma (C751x)."""
import ctypes
import glob
import os
import shutil
import subprocess

import pytest

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA toolkit) to compile for sm_90a")


def nvrtc_library():
    """libnvrtc (CUDA 13) from the nvidia-cuda-nvrtc wheel or the system, its builtins loaded first; or None."""
    roots = []
    try:
        import nvidia
        roots += [os.path.join(p, "cu13", "lib") for p in nvidia.__path__]
    except ImportError:
        pass
    roots += ["/usr/local/cuda/lib64"]
    for root in roots:
        lib = sorted(glob.glob(os.path.join(root, "libnvrtc.so.13*")))
        builtins = sorted(glob.glob(os.path.join(root, "libnvrtc-builtins.so.13*")))
        if lib and builtins:
            ctypes.CDLL(builtins[0], mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(lib[0])
    return None


def nvrtc_report(src: str) -> str:
    """Compile for sm_90a with NVRTC (skips the test without it); asserts success, returns the log."""
    lib = nvrtc_library()
    if lib is None:
        pytest.skip("needs NVRTC 13 (pip install nvidia-cuda-nvrtc)")
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"k.cu", 0, None, None) == 0
    opts = [b"--gpu-architecture=sm_90a", b"-Xptxas=-v"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    text = log.value.decode(errors="replace")
    assert rc == 0, text
    return text


def nvcc_report(src: str, tmp_path) -> str:
    """Compile for sm_90a with nvcc; asserts success, returns ptxas' resource report."""
    cu = tmp_path / "k.cu"
    cu.write_text(src)
    r = subprocess.run(["nvcc", "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "--resource-usage",
                        "-o", str(tmp_path / "k.cubin"), str(cu)], capture_output=True, text=True, timeout=300)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log
    return log


def assert_no_spills_or_serialized_wgmma(log: str):
    assert "0 bytes spill stores" in log and "0 bytes spill loads" in log, log
    assert "C751" not in log and "serialized" not in log, log
