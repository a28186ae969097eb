"""Hardware policy: one object per device that says which fast paths apply, and why.

The device is mapped to a profile by its exact compute capability. Each profile proposes a GEMM path for
NVFP4 weights, an FP8 path, an attention backend, a pinned-memory cap, copy-stream use and TF32/cuDNN
settings. A path that needs special hardware turns on only after its self-test op passed on that device;
otherwise the next path in its fallback chain is tried and the failure is kept as the reason. Every choice
can be overridden through ``SEEDVR2BW_<FIELD>`` environment variables or a node input; an overridden path
is still self-tested so a wrong override degrades with a logged reason instead of producing garbage.

Nobody else detects the GPU: ask ``get_policy(device)``.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import platform
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from .runtime import knobs

log = logging.getLogger(__name__)

# NVFP4 GEMM paths, fastest first. `reference` (dequantize + matmul in the input dtype) runs anywhere.
NVFP4_PATHS = ("fp4_tensorcore", "fp8_speed", "fidelity", "reference")

PROFILES = (
    "blackwell_consumer", "blackwell_datacenter", "hopper", "ada", "ampere",
    "older_cuda", "unknown_cuda", "cpu", "non_nvidia",
)

_CAPABILITY_PROFILES = {
    (12, 0): "blackwell_consumer",   # RTX 50xx, RTX PRO 6000 Blackwell
    (12, 1): "blackwell_consumer",   # GB10 (DGX Spark)
    (10, 0): "blackwell_datacenter",  # B200 / GB200
    (10, 3): "blackwell_datacenter",  # B300 / GB300
    (9, 0): "hopper",
    (8, 9): "ada",
    (8, 0): "ampere",
    (8, 6): "ampere",
    (8, 7): "ampere",                # Jetson Orin
}

# Which NVFP4 path each profile starts from; the chain continues down NVFP4_PATHS.
_PROFILE_NVFP4_START = {
    "blackwell_consumer": "fp4_tensorcore",
    "blackwell_datacenter": "fp4_tensorcore",
    "hopper": "fp8_speed",
    "ada": "fp8_speed",
    "ampere": "fidelity",
    "older_cuda": "fidelity",
    "unknown_cuda": "fidelity",
    "non_nvidia": "fidelity",
    "cpu": "reference",
}
_FP8_TENSOR_CORES = {"blackwell_consumer", "blackwell_datacenter", "hopper", "ada"}
_TF32_CAPABLE = {"blackwell_consumer", "blackwell_datacenter", "hopper", "ada", "ampere", "unknown_cuda"}

GiB = 1024 ** 3


@dataclass(frozen=True)
class DeviceInfo:
    """What the policy needs to know about a device; built by ``detect_device`` or by tests."""
    type: str                               # "cuda", "cpu", "mps", "xpu", ...
    index: int | None = None
    name: str = ""
    capability: tuple[int, int] | None = None
    is_rocm: bool = False
    arch_list: tuple[str, ...] = ()         # torch.cuda.get_arch_list()
    total_memory: int = 0                   # device memory, bytes
    host_memory: int = 0                    # system RAM, bytes
    os_name: str = "linux"                  # "linux", "windows", "wsl", "darwin"
    torch_version: str = ""
    torch_cuda: str | None = None           # torch.version.cuda

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.type, self.index) if self.index is not None else torch.device(self.type)


@dataclass(frozen=True)
class Policy:
    profile: str
    device: DeviceInfo
    nvfp4_gemm: str
    fp8_gemm: bool
    attention: str
    pinned_pool_bytes: int
    copy_streams: int
    tf32: bool
    cudnn_benchmark: bool
    reasons: Mapping[str, str] = field(default_factory=dict)
    arch_problem: str | None = None          # set when torch was not built for this GPU

    def summary(self) -> str:
        """The one log line that names the profile and every choice."""
        d = self.device
        where = d.name or d.type
        if d.capability:
            where += f" sm_{d.capability[0]}{d.capability[1]}"
        parts = [
            f"nvfp4_gemm={self.nvfp4_gemm}", f"fp8_gemm={'on' if self.fp8_gemm else 'off'}",
            f"attention={self.attention}", f"pinned_pool={self.pinned_pool_bytes / GiB:.1f}GiB",
            f"copy_streams={self.copy_streams}", f"tf32={'on' if self.tf32 else 'off'}",
            f"cudnn_benchmark={'on' if self.cudnn_benchmark else 'off'}",
        ]
        why = "; ".join(f"{k}: {v}" for k, v in self.reasons.items())
        line = f"[SeedVR2-BW] profile={self.profile} ({where}) " + " ".join(parts)
        if why:
            line += f" | {why}"
        if self.arch_problem:
            line += f" | PROBLEM: {self.arch_problem}"
        return line


# --------------------------------------------------------------------------- detection

def _host_memory_bytes() -> int:
    try:
        import psutil  # ComfyUI depends on it; optional for us
        return int(psutil.virtual_memory().total)
    except Exception:  # noqa: BLE001
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return 0


def _os_name() -> str:
    if sys.platform.startswith("win"):
        return "windows"
    if sys.platform == "darwin":
        return "darwin"
    if "microsoft" in platform.release().lower() or knobs.external("WSL_DISTRO_NAME"):
        return "wsl"
    return "linux"


def detect_device(device: torch.device | str | None = None) -> DeviceInfo:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    common = dict(host_memory=_host_memory_bytes(), os_name=_os_name(), torch_version=torch.__version__,
                  torch_cuda=torch.version.cuda)
    if device.type != "cuda":
        return DeviceInfo(type=device.type, index=device.index, name=device.type, **common)
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return DeviceInfo(
        type="cuda", index=index, name=props.name, capability=(props.major, props.minor),
        is_rocm=torch.version.hip is not None, arch_list=tuple(torch.cuda.get_arch_list()),
        total_memory=int(props.total_memory), **common,
    )


def profile_for(info: DeviceInfo) -> str:
    if info.type == "cpu":
        return "cpu"
    if info.type != "cuda" or info.is_rocm:
        return "non_nvidia"
    cap = info.capability or (0, 0)
    if cap in _CAPABILITY_PROFILES:
        return _CAPABILITY_PROFILES[cap]
    return "older_cuda" if cap < (8, 0) else "unknown_cuda"


def arch_problem(info: DeviceInfo) -> str | None:
    """Was torch built with kernels this GPU can run? If not, say exactly what to install.

    A cubin for sm_XY runs on sm_XZ with Z >= Y (same major); PTX for compute_XY is JIT-compiled for any newer
    GPU. Without either, every kernel launch fails with "no kernel image is available for execution".
    """
    if info.type != "cuda" or info.is_rocm or not info.capability or not info.arch_list:
        return None
    major, minor = info.capability
    for arch in info.arch_list:
        kind, _, num = arch.partition("_")
        digits = "".join(ch for ch in num if ch.isdigit())
        if len(digits) < 2:
            continue
        a_major, a_minor = int(digits[:-1]), int(digits[-1])
        if kind == "sm" and num.endswith("a") and (a_major, a_minor) == (major, minor):
            return None  # arch-specific cubin: this exact GPU only
        if kind == "sm" and not num.endswith("a") and a_major == major and a_minor <= minor:
            return None
        if kind == "compute" and (a_major, a_minor) <= (major, minor):
            return None
    need = "12.8" if major >= 10 else "12.1"
    index = "cu128" if major >= 10 else "cu126"
    return (
        f"PyTorch {info.torch_version} (CUDA {info.torch_cuda}) was built for {', '.join(info.arch_list)} and has no "
        f"kernels for this GPU (sm_{major}{minor}); it would fail with 'no kernel image is available'. Install a build "
        f"with CUDA >= {need} into the python that runs ComfyUI: "
        f"pip install --upgrade torch torchvision torchaudio --index-url https://download.pytorch.org/whl/{index}"
    )


def default_pinned_pool_bytes(info: DeviceInfo) -> int:
    """Cap on page-locked host memory. Windows' WDDM pool is about half of RAM and pinning near it starves the
    system; WSL2 pins fail above roughly a gigabyte; Linux can pin most of RAM but must leave room for the OS
    and the model's own host copy."""
    ram = info.host_memory
    if info.type != "cuda" or ram <= 0:
        return 0
    if info.os_name == "windows":
        return int(ram * 0.40)
    if info.os_name == "wsl":
        return 1 * GiB
    return int(max(0, min(ram * 0.5, ram - 8 * GiB)))


# --------------------------------------------------------------------------- self-tests

SelfTest = Callable[[str, DeviceInfo], "tuple[bool, str]"]


def _default_selftests() -> dict[str, SelfTest]:
    from . import selftest
    return {"nvfp4": selftest.nvfp4_gemm_selftest, "fp8": selftest.fp8_gemm_selftest}


OVERRIDABLE = ("profile", "nvfp4_gemm", "fp8_gemm", "attention", "pinned_pool_bytes", "copy_streams", "tf32",
               "cudnn_benchmark")


def read_env_overrides(environ: Mapping[str, str] | None = None) -> dict:
    """The ``SEEDVR2BW_<FIELD>`` knobs that are set (``environ``: parse these variables instead of the process's);
    a bad value raises with the variable's name."""
    values = {n.upper(): knobs.get(n.upper()) for n in OVERRIDABLE} if environ is None else knobs.parse(environ)
    return {n: values[n.upper()] for n in OVERRIDABLE if values[n.upper()] is not None}


def _validate_overrides(overrides: Mapping) -> None:
    for key, value in overrides.items():
        if key not in OVERRIDABLE:
            raise ValueError(f"unknown policy override {key!r}; valid: {', '.join(OVERRIDABLE)}")
        if key == "profile" and value not in PROFILES:
            raise ValueError(f"profile override {value!r} is not one of {', '.join(PROFILES)}")
        if key == "nvfp4_gemm" and value not in NVFP4_PATHS:
            raise ValueError(f"nvfp4_gemm override {value!r} is not one of {', '.join(NVFP4_PATHS)}")


def _resolve_attention(requested: str, info: DeviceInfo) -> tuple[str, str]:
    try:
        from .attention import resolve_backend
    except Exception as exc:  # noqa: BLE001 - attention module missing: plain SDPA is always there
        return "sdpa", f"attention backends unavailable ({exc}); using torch SDPA"
    try:
        name = resolve_backend(requested, info.torch_device)
    except Exception as exc:  # noqa: BLE001
        return resolve_backend("auto", info.torch_device), f"attention {requested!r} unavailable ({exc})"
    return name, ("auto: fastest available" if requested == "auto" else "override")


def decide(info: DeviceInfo, overrides: Mapping | None = None,
           selftests: Mapping[str, SelfTest] | None = None) -> Policy:
    """Pure decision: device facts + overrides + self-test functions -> Policy (tests call this directly)."""
    overrides = dict(overrides or {})
    _validate_overrides(overrides)
    selftests = _default_selftests() if selftests is None else selftests
    reasons: dict[str, str] = {}

    profile = overrides.get("profile") or profile_for(info)
    if "profile" in overrides:
        reasons["profile"] = "override"
    problem = arch_problem(info)
    usable_gpu = problem is None

    # --- NVFP4 GEMM path: walk the chain from the profile's (or the override's) start; first passing self-test wins.
    start = overrides.get("nvfp4_gemm", _PROFILE_NVFP4_START[profile])
    if not usable_gpu:
        start = "reference"
        reasons["nvfp4_gemm"] = "torch has no kernels for this GPU"
    chain = NVFP4_PATHS[NVFP4_PATHS.index(start):]
    failures = []
    nvfp4 = "reference"
    for path in chain:
        if path == "reference":
            break
        t0 = time.perf_counter()
        ok, why = selftests["nvfp4"](path, info)
        took = time.perf_counter() - t0
        if ok:
            nvfp4 = path
            break
        failures.append(f"{path} failed self-test ({why})")
    if "nvfp4_gemm" not in reasons:
        origin = "override" if "nvfp4_gemm" in overrides else f"{profile} default"
        passed = f", self-test passed in {took:.2f} s" if nvfp4 != "reference" else ""
        reasons["nvfp4_gemm"] = "; ".join(failures + [f"{nvfp4} ({origin}{passed})"])
    if failures:
        for f in failures:
            log.warning("[SeedVR2-BW] NVFP4 %s; falling back", f)

    # --- FP8 tensor-core GEMM
    want_fp8 = overrides.get("fp8_gemm", profile in _FP8_TENSOR_CORES) and usable_gpu and info.type == "cuda"
    fp8 = False
    if want_fp8:
        t0 = time.perf_counter()
        ok, why = selftests["fp8"]("fp8", info)
        fp8 = ok
        reasons["fp8_gemm"] = f"self-test passed in {time.perf_counter() - t0:.2f} s" if ok else \
            f"self-test failed ({why})"
        if not ok:
            log.warning("[SeedVR2-BW] FP8 GEMM self-test failed (%s); FP8 GEMM off", why)
    elif not usable_gpu:
        reasons["fp8_gemm"] = "torch has no kernels for this GPU"
    else:
        reasons["fp8_gemm"] = "override" if "fp8_gemm" in overrides else "no FP8 tensor cores on this profile"

    attention, why = _resolve_attention(overrides.get("attention", "auto"), info)
    reasons["attention"] = why

    is_gpu = info.type == "cuda" and usable_gpu
    pinned = overrides.get("pinned_pool_bytes", default_pinned_pool_bytes(info) if is_gpu else 0)
    copy_streams = overrides.get("copy_streams", 1 if is_gpu else 0)
    tf32 = overrides.get("tf32", profile in _TF32_CAPABLE)
    cudnn_benchmark = overrides.get("cudnn_benchmark", is_gpu and not info.is_rocm)
    return Policy(profile=profile, device=info, nvfp4_gemm=nvfp4, fp8_gemm=fp8, attention=attention,
                  pinned_pool_bytes=int(pinned), copy_streams=int(copy_streams), tf32=bool(tf32),
                  cudnn_benchmark=bool(cudnn_benchmark), reasons=reasons, arch_problem=problem)


def apply_torch_settings(policy: Policy) -> None:
    """TF32 and cuDNN settings are process-wide in torch; set them once from the policy."""
    if policy.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = policy.tf32
        torch.backends.cudnn.allow_tf32 = policy.tf32
        torch.backends.cudnn.benchmark = policy.cudnn_benchmark


# --------------------------------------------------------------------------- cached entry point

_cache: dict[tuple, Policy] = {}
_lock = threading.Lock()


def get_policy(device: torch.device | str | None = None, overrides: Mapping | None = None) -> Policy:
    """The policy for ``device`` (default: the current CUDA device, else CPU). Environment overrides apply
    first, then ``overrides`` (a node input). Computed once per device and override set; logged once."""
    info = detect_device(device)
    merged = {**read_env_overrides(), **(overrides or {})}
    key = (info.type, info.index, tuple(sorted(merged.items())))
    with _lock:
        policy = _cache.get(key)
        if policy is None:
            policy = decide(info, merged)
            _cache[key] = policy
            apply_torch_settings(policy)
            (log.error if policy.arch_problem else log.info)("%s", policy.summary())
    return policy


def reset_policy_cache() -> None:
    with _lock:
        _cache.clear()


def with_overrides(policy: Policy, **changes) -> Policy:
    """A copy with some fields changed (used by tests and by nodes that pin one choice)."""
    return dataclasses.replace(policy, **changes)
