"""System checks: Python, PyTorch and its CUDA build, the driver, the GPU, the hardware policy, optional packages
and the ComfyUI tree. None of them measures anything on the GPU."""
from __future__ import annotations

import ctypes
import os
import importlib.metadata as md
import importlib.util
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from ..runtime import device as devinfo
from ..runtime import knobs, policy as hw_policy
from .result import FAIL, PASS, SKIP, WARN, CheckResult

SECTION = "System"


def check_python(ctx) -> CheckResult:
    v = sys.version_info
    value = f"{v.major}.{v.minor}.{v.micro}"
    detail = f"{platform.python_implementation()} {value} at {sys.executable}"
    if (v.major, v.minor) >= (3, 10):
        return CheckResult("Python", PASS, value, "", detail)
    if (v.major, v.minor) >= (3, 9):
        return CheckResult("Python", WARN, value, "", detail + "; ComfyUI and this pack are tested on 3.10-3.13")
    return CheckResult("Python", FAIL, value, "", detail + "; Python >= 3.10 is needed")


def check_torch(ctx) -> CheckResult:
    ver = torch.__version__
    cuda = torch.version.cuda
    hip = getattr(torch.version, "hip", None)
    build = f"CUDA {cuda}" if cuda else (f"ROCm {hip}" if hip else "CPU-only build")
    data = {"torch": ver, "torch_cuda": cuda, "torch_hip": hip,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "has_float4_e2m1fn_x2": hasattr(torch, "float4_e2m1fn_x2"),
            "has_F_scaled_mm": hasattr(torch.nn.functional, "scaled_mm")}
    detail = f"torch {ver} ({build}); float4_e2m1fn_x2 {'present' if data['has_float4_e2m1fn_x2'] else 'missing'}"
    vt = devinfo.version_tuple(ver)
    if vt < (2, 1):
        return CheckResult("PyTorch", FAIL, ver, "", detail + "; torch >= 2.1 is needed", data=data)
    if vt < (2, 7):
        return CheckResult("PyTorch", WARN, ver, "", detail + "; torch >= 2.7 (CUDA 12.8) is needed for the FP4 "
                           "tensor-core GEMM and for Blackwell GPUs", data=data)
    if not cuda and not hip:
        return CheckResult("PyTorch", WARN, ver, "", detail + "; CPU-only build: the GPU fast paths are unavailable. "
                           "Install a CUDA build: pip install torch --index-url https://download.pytorch.org/whl/cu128",
                           data=data)
    return CheckResult("PyTorch", PASS, ver, "", detail, data=data)


def _driver_cuda_version() -> int | None:
    """The CUDA version the installed driver supports (cuDriverGetVersion), e.g. 13000 for 13.0."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        v = ctypes.c_int(0)
        try:
            if lib.cuDriverGetVersion(ctypes.byref(v)) == 0:
                return v.value
        except Exception:  # noqa: BLE001
            return None
    return None


def _nvidia_smi_driver() -> str | None:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except Exception:  # noqa: BLE001
        return None


def check_cuda_driver(ctx) -> CheckResult:
    name = "CUDA driver / runtime"
    runtime = torch.version.cuda
    drv = _driver_cuda_version()
    release = _nvidia_smi_driver() if (drv or ctx.is_cuda) else None
    data = {"runtime": runtime, "driver_cuda": None if drv is None else f"{drv // 1000}.{(drv % 1000) // 10}",
            "driver_release": release}
    if drv is None and not ctx.is_cuda:
        return CheckResult(name, SKIP, runtime, "", "no NVIDIA driver found (no libcuda); torch's CUDA runtime: "
                           f"{runtime or 'none (CPU build)'}", data=data)
    value = f"driver {release or '?'} (CUDA {data['driver_cuda'] or '?'}), runtime {runtime or 'none'}"
    if not runtime:
        return CheckResult(name, WARN, value, "", "an NVIDIA driver is installed but torch is a CPU-only build: "
                           "install a CUDA build of torch", data=data)
    if drv is not None and devinfo.version_tuple(data["driver_cuda"]) < devinfo.version_tuple(runtime)[:2]:
        # CUDA minor-version compatibility lets a 12.x runtime run on any 12.y driver for most kernels; a major
        # mismatch never works.
        same_major = devinfo.version_tuple(data["driver_cuda"])[0] == devinfo.version_tuple(runtime)[0]
        return CheckResult(name, WARN if same_major else FAIL, value, "",
                           f"the driver supports CUDA {data['driver_cuda']} but torch was built with CUDA {runtime}: "
                           "update the NVIDIA driver (r580+ for CUDA 13, r570+ for CUDA 12.8)", data=data)
    return CheckResult(name, PASS, value, "", "the driver supports torch's CUDA runtime", data=data)


def check_gpu(ctx) -> CheckResult:
    if not ctx.is_cuda:
        why = "torch.cuda.is_available() is False" + ("" if torch.version.cuda else " (CPU-only torch build)")
        return CheckResult("GPU", SKIP, None, "", f"no CUDA device: {why}; all GPU checks are skipped")
    idx = ctx.device.index if ctx.device.index is not None else torch.cuda.current_device()
    p = torch.cuda.get_device_properties(idx)
    cap = f"{p.major}.{p.minor}"
    free, total = torch.cuda.mem_get_info(idx)
    data = {"name": p.name, "capability": [p.major, p.minor], "sm": f"sm_{p.major}{p.minor}",
            "total_memory_gib": round(p.total_memory / 2**30, 2), "free_memory_gib": round(free / 2**30, 2),
            "multiprocessors": p.multi_processor_count, "device_count": torch.cuda.device_count()}
    ctx.measured["free_vram_bytes"] = free
    ctx.measured["total_vram_bytes"] = total
    detail = (f"{p.name}, compute capability {cap} (sm_{p.major}{p.minor}), {p.multi_processor_count} SMs, "
              f"{data['total_memory_gib']:.1f} GiB ({data['free_memory_gib']:.1f} GiB free)")
    return CheckResult("GPU", PASS, f"{p.name} sm_{p.major}{p.minor}", "", detail, data=data)


def check_arch_support(ctx) -> CheckResult:
    name = "torch kernels for this GPU"
    if not ctx.is_cuda:
        return CheckResult(name, SKIP, None, "", "no CUDA device")
    info = devinfo.detect_device(ctx.device)
    problem = devinfo.arch_problem(info)
    data = {"arch_list": list(info.arch_list), "capability": list(info.capability or ())}
    if problem:
        ctx.measured["arch_problem"] = problem
        return CheckResult(name, FAIL, "missing", "", problem, data=data)
    return CheckResult(name, PASS, "present", "", f"torch arch list {' '.join(info.arch_list)} covers "
                       f"sm_{info.capability[0]}{info.capability[1]}", data=data)


def check_policy(ctx) -> CheckResult:
    policy = hw_policy.get_policy(ctx.device)
    ctx.measured["policy"] = policy
    data = {"profile": policy.profile, "nvfp4_gemm": policy.nvfp4_gemm, "fp8_gemm": policy.fp8_gemm,
            "attention": policy.attention, "pinned_pool_bytes": policy.pinned_pool_bytes,
            "copy_streams": policy.copy_streams, "tf32": policy.tf32, "cudnn_benchmark": policy.cudnn_benchmark,
            "reasons": dict(policy.reasons), "summary": policy.summary(), "arch_problem": policy.arch_problem,
            "kernel_table": policy.kernel_table()}
    detail = policy.summary()
    status = PASS
    if policy.arch_problem:
        status = FAIL
    elif policy.profile in ("unknown_cuda", "older_cuda", "non_nvidia") and ctx.is_cuda:
        status = WARN
        detail += " | this GPU has no profile of its own: the pack runs its generic fallbacks"
    return CheckResult("hardware policy", status, policy.profile, "", detail, data=data)


# (import name, distribution names to look up, what it gives the pack)
OPTIONAL_PACKAGES = (
    ("safetensors", ("safetensors",), "checkpoint loading (required)"),
    ("einops", ("einops",), "listed in requirements.txt; the pack's code does not import it today"),
    ("omegaconf", ("omegaconf",), "listed in requirements.txt; the pack's code does not import it today"),
    ("triton", ("triton", "pytorch-triton", "triton-windows"), "fused kernels (NVFP4 quantize, SageAttention)"),
    ("flash_attn", ("flash-attn", "flash_attn"), "flash_attn attention backend"),
    ("sageattention", ("sageattention",), "sage attention backend"),
    ("modelopt", ("nvidia-modelopt", "modelopt"), "NVFP4 calibration with ModelOpt"),
    ("prodigyopt", ("prodigyopt",), "Prodigy optimizer for LoRA training"),
    ("bitsandbytes", ("bitsandbytes",), "8-bit optimizers for LoRA training"),
    ("comfy_kitchen", ("comfy-kitchen", "comfy_kitchen"), "ComfyUI's quantized-tensor kernels"),
)
REQUIRED_PACKAGES = {"safetensors"}


def _dist_version(dists) -> str | None:
    for d in dists:
        try:
            return md.version(d)
        except md.PackageNotFoundError:
            continue
    return None


def check_packages(ctx) -> list[CheckResult]:
    out = []
    for mod, dists, what in OPTIONAL_PACKAGES:
        name = f"package {mod}"
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        version = _dist_version(dists) if found else None
        if found:
            out.append(CheckResult(name, PASS, version or "unknown version", "", what))
        elif mod in REQUIRED_PACKAGES:
            out.append(CheckResult(name, FAIL, None, "", f"not installed; needed for {what}. Fix: pip install {dists[0]}"))
        else:
            out.append(CheckResult(name, SKIP, None, "", f"not installed (optional: {what})"))
    return out


def find_comfyui_version(pack_root) -> tuple[str | None, str | None]:
    """(version, path) of the ComfyUI tree this pack sits in (ComfyUI/custom_nodes/<pack>/), if any."""
    roots = [pack_root, Path(os.path.abspath(__file__)).parents[2]]  # resolved, and as reached (symlinked packs)
    # the shell's logical working directory keeps a symlinked pack's path (os.getcwd() resolves links)
    pwd = knobs.external("PWD")
    try:
        logical = Path(pwd) if pwd and os.path.samefile(pwd, os.getcwd()) else Path(os.getcwd())
    except OSError:
        logical = Path(os.getcwd())
    if sys.argv and sys.argv[0].endswith(".py"):
        script = Path(sys.argv[0])
        script = script if script.is_absolute() else logical / script
        roots.append(Path(os.path.normpath(script)).parents[1])  # <pack>/scripts/<this>.py -> <pack>
    roots.append(logical)
    candidates = []
    for root in roots:
        path = root.parent.parent / "comfyui_version.py"  # ComfyUI/custom_nodes/<pack>/ -> ComfyUI/
        if path not in candidates:
            candidates.append(path)
    for path in candidates:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError:
            continue
        m = re.search(r"__version__\s*=\s*['\"]([^'\"]+)['\"]", text)
        return (m.group(1) if m else "unknown"), str(path.parent)
    mod = sys.modules.get("comfyui_version")
    if mod is not None and getattr(mod, "__version__", None):
        return mod.__version__, getattr(mod, "__file__", None)
    return None, None


def check_comfyui(ctx) -> CheckResult:
    version, where = find_comfyui_version(ctx.pack_root)
    if version is None:
        return CheckResult("ComfyUI", SKIP, None, "", f"not run from a ComfyUI tree (no comfyui_version.py two "
                           f"folders above {ctx.pack_root})")
    status = PASS
    detail = f"ComfyUI {version} at {where}"
    vt = devinfo.version_tuple(version) if version != "unknown" else ()
    if vt and vt < (0, 3, 75):
        status = WARN
        detail += "; the pack's V3 nodes are tested with ComfyUI >= 0.3.75: update ComfyUI"
    return CheckResult("ComfyUI", status, version, "", detail, data={"path": where})


CHECKS = (check_python, check_torch, check_cuda_driver, check_gpu, check_arch_support, check_policy,
          check_comfyui)
PACKAGE_CHECKS = (check_packages,)
