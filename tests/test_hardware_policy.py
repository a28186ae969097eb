"""Hardware policy: every profile with mocked device facts, self-test fallbacks, overrides, arch check."""
import logging

import pytest

from seedvr2bw.optimization.nvfp4 import selftest
from seedvr2bw.optimization.nvfp4.dispatch import NVFP4_PATHS
from seedvr2bw.optimization.runtime import device, selftests
from seedvr2bw.optimization.runtime import policy as hw

GiB = device.GiB


def cuda(cap, name="GPU", arch=("sm_80", "sm_86", "sm_90", "sm_100", "sm_120"), os_name="linux", ram=64 * GiB,
         rocm=False):
    return device.DeviceInfo(type="cuda", index=0, name=name, capability=cap, arch_list=arch, host_memory=ram,
                         total_memory=32 * GiB, os_name=os_name, is_rocm=rocm, torch_version="2.13.0",
                         torch_cuda="13.0")


def passing(calls=None):
    def nvfp4(path, info):
        if calls is not None:
            calls.append(path)
        return True, "ok"
    return {"nvfp4": nvfp4, "fp8": lambda f, i: (True, "ok")}


def failing(paths=(), fp8=False):
    """Self-tests where the NVFP4 paths in ``paths`` fail, and FP8 fails unless ``fp8``."""
    return {"nvfp4": lambda p, i: (p not in paths, "mismatch" if p in paths else "ok"),
            "fp8": lambda f, i: (fp8, "ok" if fp8 else "no kernel")}


EXPECTED = [
    # capability, profile, nvfp4 path, fp8, tf32
    ((12, 0), "blackwell_consumer", "fp4_tensorcore", True, True),
    ((12, 1), "blackwell_consumer", "fp4_tensorcore", True, True),
    ((10, 0), "blackwell_datacenter", "fp4_tensorcore", True, True),
    ((10, 3), "blackwell_datacenter", "fp4_tensorcore", True, True),
    ((9, 0), "hopper", "fp8_speed", True, True),
    ((8, 9), "ada", "fp8_speed", True, True),
    ((8, 6), "ampere", "fidelity", False, True),
    ((8, 0), "ampere", "fidelity", False, True),
    ((7, 5), "older_cuda", "fidelity", False, False),
    ((6, 1), "older_cuda", "fidelity", False, False),
]


@pytest.mark.parametrize("cap,profile,nvfp4,fp8,tf32", EXPECTED)
def test_profile_choices_with_passing_selftests(cap, profile, nvfp4, fp8, tf32):
    arch = (f"sm_{cap[0]}{cap[1]}",)
    p = hw.decide(cuda(cap, arch=arch), selftests=passing())
    assert (p.profile, p.nvfp4_gemm, p.fp8_gemm, p.tf32) == (profile, nvfp4, fp8, tf32)
    assert p.copy_streams == 1 and p.cudnn_benchmark
    assert p.pinned_pool_bytes == 32 * GiB  # Linux, 64 GiB RAM: half
    assert p.arch_problem is None
    line = p.summary()
    for word in (f"profile={profile}", f"nvfp4_gemm={nvfp4}", "attention=", "pinned_pool=", "copy_streams=", "tf32="):
        assert word in line


def test_cpu_profile():
    info = device.DeviceInfo(type="cpu", host_memory=24 * GiB)
    p = hw.decide(info, selftests=failing(paths=NVFP4_PATHS))
    assert (p.profile, p.nvfp4_gemm, p.fp8_gemm, p.pinned_pool_bytes, p.copy_streams) == ("cpu", "reference", False, 0, 0)
    assert p.attention == "sdpa"


def test_non_nvidia_profiles():
    rocm = hw.decide(cuda((9, 4), name="MI300X", rocm=True, arch=("gfx942",)), selftests=passing())
    assert rocm.profile == "non_nvidia" and rocm.nvfp4_gemm == "fidelity" and not rocm.fp8_gemm
    mps = hw.decide(device.DeviceInfo(type="mps", host_memory=16 * GiB), selftests=passing())
    assert mps.profile == "non_nvidia" and mps.pinned_pool_bytes == 0


def test_unknown_future_capability_is_conservative():
    p = hw.decide(cuda((11, 0), arch=("sm_110",)), selftests=passing())
    assert p.profile == "unknown_cuda" and p.nvfp4_gemm == "fidelity"


def test_selftest_failure_falls_back_and_logs_reason(caplog):
    caplog.set_level(logging.WARNING)
    p = hw.decide(cuda((12, 0)), selftests=failing(paths=("fp4_tensorcore",), fp8=True))
    assert p.nvfp4_gemm == "fp8_speed"
    assert "fp4_tensorcore failed self-test (mismatch)" in p.reasons["nvfp4_gemm"]
    assert "fp4_tensorcore failed self-test" in caplog.text


def test_every_gpu_path_failing_ends_on_reference():
    p = hw.decide(cuda((12, 0)), selftests=failing(paths=("fp4_tensorcore", "fp8_speed", "fidelity")))
    assert p.nvfp4_gemm == "reference" and not p.fp8_gemm
    assert "fidelity failed self-test" in p.reasons["nvfp4_gemm"]
    assert "self-test failed (no kernel)" in p.reasons["fp8_gemm"]


def test_selftests_run_only_from_the_profile_start():
    calls = []
    hw.decide(cuda((9, 0)), selftests=passing(calls))
    assert calls == ["fp8_speed"]  # Hopper never tries FP4


def test_crashing_selftest_is_a_failed_selftest():
    @selftests.guard
    def boom(path, info):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED\nmore")
    ok, why = boom("fp4_tensorcore", None)
    assert not ok and why == "RuntimeError: CUBLAS_STATUS_NOT_SUPPORTED"


def test_real_selftests_on_cpu_report_not_available():
    info = device.DeviceInfo(type="cpu")
    ok, why = selftest.fp8_gemm_selftest("", info.torch_device)
    assert not ok and "not a CUDA device" in why


def test_overrides_from_arguments():
    p = hw.decide(cuda((12, 0)), overrides={"nvfp4_gemm": "fidelity", "fp8_gemm": False, "tf32": False,
                                             "pinned_pool_bytes": 3 * GiB, "copy_streams": 2},
                  selftests=passing())
    assert (p.nvfp4_gemm, p.fp8_gemm, p.tf32, p.pinned_pool_bytes, p.copy_streams) == ("fidelity", False, False,
                                                                                         3 * GiB, 2)
    assert "override" in p.reasons["nvfp4_gemm"] and p.reasons["fp8_gemm"] == "override"


def test_overridden_path_is_still_selftested():
    p = hw.decide(cuda((8, 6)), overrides={"nvfp4_gemm": "fp4_tensorcore"},
                  selftests=failing(paths=("fp4_tensorcore", "fp8_speed")))
    assert p.nvfp4_gemm == "fidelity"
    assert "fp4_tensorcore failed self-test" in p.reasons["nvfp4_gemm"]


@pytest.mark.parametrize("torch_version,cudnn,want,why", [
    ("2.9.1+cu128", 91002, True, "without cuDNN"),   # ComfyUI's late-2025 builds: torch skips cuDNN for NCDHW half
    ("2.10.0+cu130", 91300, True, "without cuDNN"),
    ("2.9.0+cu128", 91501, True, "without cuDNN"),   # 2.9.0 skips it for every cuDNN from 9.8
    ("2.9.1+cu130", 91501, True, "skip the layout transposes"),   # cuDNN runs NCDHW, NDHWC is faster there
    ("2.8.0+cu128", 91002, True, "skip the layout transposes"),
    ("2.11.0+cu130", 90700, True, "skip the layout transposes"),
    ("2.11.0+cu130", None, False, "no cuDNN"),
])
def test_vae_layout_follows_cudnn(torch_version, cudnn, want, why):
    info = device.DeviceInfo(type="cuda", index=0, name="GPU", capability=(8, 9), arch_list=("sm_89",),
                             torch_version=torch_version, cudnn_version=cudnn)
    p = hw.decide(info, selftests=passing())
    assert p.vae_channels_last is want
    assert ("vae_channels_last=on" if want else "vae_channels_last=off") in p.summary()
    assert why in p.reasons["vae_channels_last"]
    assert hw.decide(info, overrides={"vae_channels_last": not want}, selftests=passing()).vae_channels_last is not want
    assert hw.read_env_overrides({"SEEDVR2BW_VAE_CHANNELS_LAST": "on"}) == {"vae_channels_last": True}
    assert not hw.decide(device.DeviceInfo(type="cpu", torch_version=torch_version, cudnn_version=cudnn),
                         selftests=passing()).vae_channels_last


def test_profile_override():
    p = hw.decide(cuda((12, 0)), overrides={"profile": "ampere"}, selftests=passing())
    assert p.profile == "ampere" and p.nvfp4_gemm == "fidelity" and p.reasons["profile"] == "override"


def test_env_overrides_parse():
    env = {"SEEDVR2BW_NVFP4_GEMM": "Fidelity", "SEEDVR2BW_FP8_GEMM": "off", "SEEDVR2BW_PINNED_POOL_BYTES": "8G",
           "SEEDVR2BW_COPY_STREAMS": "2", "SEEDVR2BW_ATTENTION": "auto", "SEEDVR2BW_TF32": "1"}
    assert hw.read_env_overrides(env) == {"nvfp4_gemm": "fidelity", "fp8_gemm": False, "pinned_pool_bytes": 8 * GiB,
                                          "copy_streams": 2, "tf32": True}


@pytest.mark.parametrize("env,needle", [
    ({"SEEDVR2BW_FP8_GEMM": "maybe"}, "SEEDVR2BW_FP8_GEMM='maybe'"),
    ({"SEEDVR2BW_PINNED_POOL_BYTES": "lots"}, "SEEDVR2BW_PINNED_POOL_BYTES='lots'"),
])
def test_bad_env_values_name_the_variable(env, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        hw.read_env_overrides(env)


def test_bad_override_values_are_rejected():
    with pytest.raises(ValueError, match="nvfp4_gemm override 'fast'"):
        hw.decide(cuda((9, 0)), overrides={"nvfp4_gemm": "fast"}, selftests=passing())
    with pytest.raises(ValueError, match="unknown policy override 'speed'"):
        hw.decide(cuda((9, 0)), overrides={"speed": 1}, selftests=passing())


def test_get_policy_reads_env_and_caches(monkeypatch):
    hw.reset_policy_cache()
    monkeypatch.setenv("SEEDVR2BW_COPY_STREAMS", "3")
    p1 = hw.get_policy("cpu")
    assert p1.copy_streams == 3 and p1 is hw.get_policy("cpu")
    hw.reset_policy_cache()


@pytest.mark.parametrize("os_name,expected", [("linux", 32 * GiB), ("windows", int(64 * GiB * 0.4)), ("wsl", 1 * GiB)])
def test_pinned_pool_cap_per_platform(os_name, expected):
    p = hw.decide(cuda((12, 0), os_name=os_name), selftests=passing())
    assert p.pinned_pool_bytes == expected


def test_pinned_pool_cap_leaves_room_on_small_hosts():
    p = hw.decide(cuda((12, 0), ram=12 * GiB), selftests=passing())
    assert p.pinned_pool_bytes == 4 * GiB  # RAM - 8 GiB beats half of RAM


@pytest.mark.parametrize("cap,arch,ok", [
    ((12, 0), ("sm_80", "sm_86", "sm_90"), False),       # the classic RTX 50 failure (cu124 wheels)
    ((12, 0), ("sm_90", "sm_100", "sm_120"), True),
    ((12, 1), ("sm_120",), True),                          # same major, newer minor runs sm_120 cubins
    ((12, 0), ("sm_121",), False),
    ((12, 0), ("sm_90", "compute_90"), True),             # PTX JIT
    ((9, 0), ("sm_90a",), True),
    ((8, 9), ("sm_90a",), False),
])
def test_arch_support(cap, arch, ok):
    problem = device.arch_problem(cuda(cap, arch=arch))
    assert (problem is None) == ok
    if not ok:
        assert f"sm_{cap[0]}{cap[1]}" in problem and "pip install --upgrade torch" in problem
        assert ("cu128" in problem) == (cap[0] >= 10)


def test_arch_problem_disables_gpu_paths():
    p = hw.decide(cuda((12, 0), arch=("sm_80", "sm_86")), selftests=passing())
    assert p.nvfp4_gemm == "reference" and not p.fp8_gemm and p.copy_streams == 0
    assert "PROBLEM" in p.summary() and "no kernel image" in p.summary()
