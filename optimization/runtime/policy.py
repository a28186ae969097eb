"""Hardware policy: one object per device that says which fast paths apply, and why.

The device is mapped to a profile by its exact compute capability (``device.py``). Each profile proposes a GEMM
path for NVFP4 weights, an FP8 path, an attention backend, a pinned-memory cap, copy-stream use and TF32/cuDNN
settings. A path that needs special hardware turns on only after its self-test op passed on that device
(``selftests.py``); otherwise the next path in its fallback chain is tried and the failure is kept as the reason.
Every choice can be overridden through the ``SEEDVR2BW_<FIELD>`` knobs or a node input; an overridden path is
still self-tested so a wrong override degrades with a logged reason instead of producing garbage.
``Policy.summary()`` names every choice and prints the kernel table of the quantized linears (``nvfp4/dispatch``).

Nobody else detects the GPU: ask ``get_policy(device)``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping

import torch

from ..attention import resolve_backend
from ..nvfp4 import dispatch
from . import knobs
from . import selftests as selftest_memo
from .device import (GiB, PROFILES, DeviceInfo, arch_problem, default_pinned_pool_bytes, detect_device, profile_for,
                     torch_skips_cudnn_conv3d)

log = logging.getLogger(__name__)

# Which NVFP4 path each profile starts from; the chain continues down dispatch.NVFP4_PATHS.
PROFILE_NVFP4_START = {
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
_FP4_TENSOR_CORES = {"blackwell_consumer", "blackwell_datacenter"}


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
    vae_channels_last: bool = False
    reasons: Mapping[str, str] = field(default_factory=dict)
    arch_problem: str | None = None          # set when torch was not built for this GPU

    def summary(self) -> str:
        """The log line that names the profile and every choice, then the kernel table of the quantized linears."""
        d = self.device
        where = d.name or d.type
        if d.capability:
            where += f" sm_{d.capability[0]}{d.capability[1]}"
        parts = [
            f"nvfp4_gemm={self.nvfp4_gemm}", f"fp8_gemm={'on' if self.fp8_gemm else 'off'}",
            f"attention={self.attention}", f"pinned_pool={self.pinned_pool_bytes / GiB:.1f}GiB",
            f"copy_streams={self.copy_streams}", f"tf32={'on' if self.tf32 else 'off'}",
            f"cudnn_benchmark={'on' if self.cudnn_benchmark else 'off'}",
            f"vae_channels_last={'on' if self.vae_channels_last else 'off'}",
        ]
        why = "; ".join(f"{k}: {v}" for k, v in self.reasons.items())
        line = f"[SeedVR2-BW] profile={self.profile} ({where}) " + " ".join(parts)
        if why:
            line += f" | {why}"
        if self.arch_problem:
            line += f" | PROBLEM: {self.arch_problem}"
        return "\n".join([line, "quantized linears, kernel by rows M (bf16 activations):"] + self.kernel_table())

    def kernel_table(self) -> list[str]:
        """For each linear format and request, which kernel each M range gets on this device, and why (the sm_90
        kernels once their self-tests pass)."""
        gpu = self.device.type == "cuda" and self.arch_problem is None
        hopper = gpu and self.profile == "hopper"
        site = dispatch.Site(
            cuda=gpu, triton=gpu, policy_path=lambda: self.nvfp4_gemm,
            fp4_gemm=lambda: (self.profile in _FP4_TENSOR_CORES, f"no FP4 tensor cores on {self.profile}"),
            wgmma=lambda: hopper, rs=lambda: hopper, fp8=lambda: gpu and self.fp8_gemm,
            # a forecast: the INT8 layer runs torch._int_mm's own self-test at its first call and logs the outcome
            int_mm=lambda: self.device.type == "cpu" or (gpu and (self.device.capability or (0, 0)) >= (8, 0)),
            int8_fused=lambda: (True, ""))       # a forecast too: the layer self-tests its fused kernels likewise
        return dispatch.kernel_table(site)


# --------------------------------------------------------------------------- overrides

SelfTest = Callable[[str, DeviceInfo], "tuple[bool, str]"]

OVERRIDABLE = ("profile", "nvfp4_gemm", "fp8_gemm", "attention", "pinned_pool_bytes", "copy_streams", "tf32",
               "cudnn_benchmark", "vae_channels_last")


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
        if key == "nvfp4_gemm" and value not in dispatch.NVFP4_PATHS:
            raise ValueError(f"nvfp4_gemm override {value!r} is not one of {', '.join(dispatch.NVFP4_PATHS)}")


def _resolve_attention(requested: str, info: DeviceInfo) -> tuple[str, str]:
    try:
        name = resolve_backend(requested, info.torch_device)
    except Exception as exc:  # noqa: BLE001
        return resolve_backend("auto", info.torch_device), f"attention {requested!r} unavailable ({exc})"
    return name, ("auto: fastest available" if requested == "auto" else "override")


def registered_selftests() -> dict[str, SelfTest]:
    """The NVFP4 path and FP8 GEMM self-tests the linear formats registered, memoized per device."""
    return {"nvfp4": lambda path, info: selftest_memo.run("nvfp4", info.torch_device, path),
            "fp8": lambda _f, info: selftest_memo.run("fp8", info.torch_device)}


# --------------------------------------------------------------------------- the decision

def decide(info: DeviceInfo, overrides: Mapping | None = None,
           selftests: Mapping[str, SelfTest] | None = None) -> Policy:
    """Pure decision: device facts + overrides + self-test functions -> Policy (tests call this directly)."""
    overrides = dict(overrides or {})
    _validate_overrides(overrides)
    selftests = registered_selftests() if selftests is None else selftests
    reasons: dict[str, str] = {}

    profile = overrides.get("profile") or profile_for(info)
    if "profile" in overrides:
        reasons["profile"] = "override"
    problem = arch_problem(info)
    usable_gpu = problem is None

    # --- NVFP4 GEMM path: walk the chain from the profile's (or the override's) start; first passing self-test wins.
    start = overrides.get("nvfp4_gemm", PROFILE_NVFP4_START[profile])
    if not usable_gpu:
        start = "reference"
        reasons["nvfp4_gemm"] = "torch has no kernels for this GPU"
    chain = dispatch.NVFP4_PATHS[dispatch.NVFP4_PATHS.index(start):]
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
    # the VAE's activation layout: NDHWC wherever cuDNN runs the 3-D convolutions (PERFORMANCE §3: 0.78-0.89x the
    # NCDHW time, H200), and there torch may even skip cuDNN for NCDHW half-precision inputs
    if "vae_channels_last" in overrides:
        vae_cl, reasons["vae_channels_last"] = bool(overrides["vae_channels_last"]), "override"
    elif is_gpu and torch_skips_cudnn_conv3d(info):
        vae_cl = True
        reasons["vae_channels_last"] = (f"torch {info.torch_version} with cuDNN {info.cudnn_version} runs NCDHW "
                                        "half-precision 3-D convolutions without cuDNN (im2col, several times the "
                                        "memory); NDHWC keeps cuDNN")
    elif is_gpu and not info.is_rocm and info.cudnn_version:
        vae_cl = True
        reasons["vae_channels_last"] = "cuDNN's NDHWC convolutions skip the layout transposes (0.78-0.89x the time)"
    else:
        vae_cl = False
        reasons["vae_channels_last"] = "no cuDNN here: NCDHW"
    return Policy(profile=profile, device=info, nvfp4_gemm=nvfp4, fp8_gemm=fp8, attention=attention,
                  pinned_pool_bytes=int(pinned), copy_streams=int(copy_streams), tf32=bool(tf32),
                  cudnn_benchmark=bool(cudnn_benchmark), vae_channels_last=vae_cl, reasons=reasons,
                  arch_problem=problem)


@contextlib.contextmanager
def torch_settings(policy: Policy) -> Iterator[None]:
    """TF32 matmuls / convolutions and cuDNN autotuning as ``policy`` says, for the pack's own model calls only:
    torch keeps them process-wide, so they are set on entry and the caller's values restored on exit."""
    if policy.device.type != "cuda":
        yield
        return
    with scoped_flags(tf32=policy.tf32, cudnn_benchmark=policy.cudnn_benchmark):
        yield


@contextlib.contextmanager
def scoped_flags(tf32: bool, cudnn_benchmark: bool | None = None) -> Iterator[None]:
    """torch's process-wide TF32 (matmul and cuDNN) and, if given, cuDNN autotuning flags set for the ``with``
    block only; the caller's values come back on exit."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = (matmul.allow_tf32, cudnn.allow_tf32, cudnn.benchmark)
    matmul.allow_tf32 = cudnn.allow_tf32 = tf32
    if cudnn_benchmark is not None:
        cudnn.benchmark = cudnn_benchmark
    try:
        yield
    finally:
        matmul.allow_tf32, cudnn.allow_tf32, cudnn.benchmark = saved


# --------------------------------------------------------------------------- cached entry point

_cache: dict[tuple, Policy] = {}
_lock = threading.Lock()


def get_policy(device: torch.device | str | None = None, overrides: Mapping | None = None) -> Policy:
    """The policy for ``device`` (default: the current CUDA device, else CPU). Environment overrides apply
    first, then ``overrides`` (a node input). Computed once per device and override set; logged once."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    index = device.index if device.index is not None or device.type != "cuda" else torch.cuda.current_device()
    merged = {**read_env_overrides(), **(overrides or {})}
    key = (device.type, index, tuple(sorted(merged.items())))
    policy = _cache.get(key)
    if policy is not None:
        return policy
    with _lock:
        policy = _cache.get(key)
        if policy is None:
            policy = decide(detect_device(device), merged)
            _cache[key] = policy
            (log.error if policy.arch_problem else log.info)("%s", policy.summary())
    return policy


def reset_policy_cache() -> None:
    with _lock:
        _cache.clear()


def with_overrides(policy: Policy, **changes) -> Policy:
    """A copy with some fields changed (used by tests and by nodes that pin one choice)."""
    return dataclasses.replace(policy, **changes)
