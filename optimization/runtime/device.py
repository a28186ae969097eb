"""Facts about a device: what it is (``DeviceInfo``), its hardware profile, whether torch can run on it, and the
page-locked memory it may use. ``detect_device`` is the only place that asks the GPU; tests build ``DeviceInfo``s.
"""
from __future__ import annotations

import os
import platform
import re
import sys
from dataclasses import dataclass

import torch

from . import knobs

GiB = 1024 ** 3

PROFILES = (
    "blackwell_consumer", "blackwell_datacenter", "hopper", "ada", "ampere",
    "older_cuda", "unknown_cuda", "cpu", "non_nvidia",
)

CAPABILITY_PROFILES = {
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
    cudnn_version: int | None = None        # torch.backends.cudnn.version(), e.g. 91002 for 9.10.2

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.type, self.index) if self.index is not None else torch.device(self.type)


def host_memory_bytes() -> int:
    try:
        import psutil  # ComfyUI depends on it; optional for us
        return int(psutil.virtual_memory().total)
    except Exception:  # noqa: BLE001
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return 0


def free_device_bytes(device) -> int:
    """GPU memory a new tensor on ``device`` can take now: the driver's free memory plus the blocks torch's caching
    allocator holds unused (``mem_get_info`` alone counts those as taken, so a second run of the same work would
    see less and choose smaller tiles, new shapes that cuDNN then autotunes inside the run)."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def available_host_bytes() -> int:
    """System RAM a new allocation can take now (MemAvailable: free + reclaimable cache), 0 where unknown."""
    try:
        import psutil
        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
    return 0


def os_name() -> str:
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
    common = dict(host_memory=host_memory_bytes(), os_name=os_name(), torch_version=torch.__version__,
                  torch_cuda=torch.version.cuda)
    if device.type != "cuda":
        return DeviceInfo(type=device.type, index=device.index, name=device.type, **common)
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return DeviceInfo(
        type="cuda", index=index, name=props.name, capability=(props.major, props.minor),
        is_rocm=torch.version.hip is not None, arch_list=tuple(torch.cuda.get_arch_list()),
        total_memory=int(props.total_memory), cudnn_version=torch.backends.cudnn.version(), **common,
    )


def version_tuple(text: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string such as torch's "2.9.1+cu128"."""
    return tuple(int(p) for p in re.findall(r"\d+", text.split("+")[0])[:3])


def torch_skips_cudnn_conv3d(info: DeviceInfo) -> bool:
    """Whether torch runs half-precision NCDHW 3-D convolutions (kernel > 1) without cuDNN on this device, by
    im2col at many times the memory: torch 2.9.0 does so with cuDNN 9.8+, later torch with cuDNN 9.8 to 9.14
    (its guard against a cuDNN bug; channels-last inputs keep cuDNN)."""
    if info.type != "cuda" or info.is_rocm or not info.cudnn_version or info.cudnn_version < 90800:
        return False
    tv = version_tuple(info.torch_version)
    if tv[:2] < (2, 9):
        return False
    return tv[:3] == (2, 9, 0) or info.cudnn_version < 91500


def profile_for(info: DeviceInfo) -> str:
    if info.type == "cpu":
        return "cpu"
    if info.type != "cuda" or info.is_rocm:
        return "non_nvidia"
    cap = info.capability or (0, 0)
    if cap in CAPABILITY_PROFILES:
        return CAPABILITY_PROFILES[cap]
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
