"""Which kernel a quantized linear runs: the one decision (``dispatch.decide``) walked over every format and request,
representative M and the hardware profiles, with its reasons; the layer's own use of it and its log line; the
fused W4A16 kernel's config table."""
import logging

import pytest
import torch

from seedvr2bw.optimization.nvfp4 import dispatch
from seedvr2bw.optimization.nvfp4 import format as fmt
from seedvr2bw.optimization.nvfp4 import kernels as K
from seedvr2bw.optimization.nvfp4.emulation import expected_output
from seedvr2bw.optimization.nvfp4.linear import NVFP4Linear
from seedvr2bw.optimization.runtime import device, policy

MS = (1, 64, 65, 256, 257, 1023, 1024, 4095, 4096, 16384)
PROFILES = {"blackwell_consumer": (12, 0), "hopper": (9, 0), "ada": (8, 9), "ampere": (8, 6), "cpu": None}


def site_for(profile: str, **changes) -> dispatch.Site:
    """The facts a bf16 layer gets on a GPU of ``profile`` whose kernels all passed their self-tests."""
    cap = PROFILES[profile]
    if cap is None:
        info = device.DeviceInfo(type="cpu", host_memory=16 << 30)
    else:
        info = device.DeviceInfo(type="cuda", index=0, name="GPU", capability=cap, arch_list=(f"sm_{cap[0]}{cap[1]}",),
                                 host_memory=64 << 30)
    pol = policy.decide(info, selftests={"nvfp4": lambda p, i: (True, "ok"), "fp8": lambda f, i: (True, "ok")})
    facts = dict(cuda=cap is not None, triton=cap is not None, policy_path=lambda: pol.nvfp4_gemm,
                 fp4_gemm=lambda: (cap is not None and cap[0] in (10, 12), "no FP4 tensor cores"),
                 wgmma=lambda: cap == (9, 0), rs=lambda: cap == (9, 0))
    facts.update(changes)
    return dispatch.Site(**facts)


def fidelity_table(profile):
    """Expected (kernel, reason) of the fidelity path by M on ``profile``."""
    if profile == "hopper":
        return {1: ("w4a16_triton", "M < 65"), 64: ("w4a16_triton", "M < 65"),
                65: ("w4a16_wgmma", "M >= 65, sm_90"), 256: ("w4a16_wgmma", "M <= 256"),
                257: ("dequant_cublas", "M > 256"), 1023: ("dequant_cublas", "M > 256"),
                1024: ("rs_or_dequant", "1024 <= M < 4096"), 4095: ("rs_or_dequant", "1024 <= M < 4096"),
                4096: ("rs_w4a16", "M >= 4096"), 16384: ("rs_w4a16", "M >= 4096")}
    return {m: (("w4a16_triton", "M <= 256") if m <= 256 else ("dequant_cublas", "M > 256")) for m in MS}


def expected(profile, fmt_name, request, m):
    """(path, kernel, reason fragment) the dispatch must give."""
    if fmt_name == "fp8":
        if request == "scaled_mm" and profile != "cpu":
            return "scaled_mm", "fp8_scaled_mm", "scaled_mm mode on CUDA"
        return request, "fp8_cast", "cast mode" if request == "cast" else "not CUDA"
    if profile == "cpu":
        return "reference", "reference", "not a CUDA device"
    path = request
    if request == "auto":
        path = {"blackwell_consumer": "fp4_tensorcore", "hopper": "fp8_speed", "ada": "fp8_speed",
                "ampere": "fidelity"}[profile]
    why = "hardware policy" if request == "auto" else "layer setting"
    if path == "fp4_tensorcore" and profile != "blackwell_consumer":
        path, why = "fp8_speed", "no FP4 GEMM here"
    kernel = {"fp4_tensorcore": "fp4_gemm", "fp8_speed": "fp8_rowwise", "reference": "reference"}.get(path)
    if kernel is None:
        kernel, kwhy = fidelity_table(profile)[m]
        return path, kernel, kwhy
    return path, kernel, why


REQUESTS = [("nvfp4", r) for r in ("auto",) + dispatch.NVFP4_PATHS] + [("fp8", r) for r in dispatch.FP8_MODES]


@pytest.mark.parametrize("profile", list(PROFILES))
@pytest.mark.parametrize("fmt_name,request_", REQUESTS)
def test_kernel_table(profile, fmt_name, request_):
    site = site_for(profile)
    for m in MS:
        d = dispatch.decide(fmt_name, request_, m, site)
        path, kernel, why = expected(profile, fmt_name, request_, m)
        assert (d.path, d.kernel) == (path, kernel), (profile, fmt_name, request_, m, d)
        assert why in d.reason, (profile, fmt_name, request_, m, d.reason)
        assert d.line("NVFP4", m) == f"[SeedVR2-BW] NVFP4 {d.path} M={m}: {d.kernel} ({d.reason})"
        assert kernel in dispatch.KERNEL_DOC


def test_table_rows_name_every_range():
    lines = dispatch.kernel_table(site_for("hopper"))
    fidelity = next(line for line in lines if line.strip().startswith("nvfp4 fidelity"))
    for part in ("M 1-64: w4a16_triton", "M 65-256: w4a16_wgmma", "M 257-1023: dequant_cublas",
                 "M 1024-4095: rs_or_dequant", "M >= 4096: rs_w4a16"):
        assert part in fidelity
    assert any(line.strip().startswith("nvfp4 auto -> fp8_speed (hardware policy): all M: fp8_rowwise")
               for line in lines)
    info = device.DeviceInfo(type="cuda", index=0, name="H100", capability=(9, 0), arch_list=("sm_90a",))
    summary = policy.decide(info, selftests={"nvfp4": lambda p, i: (True, "ok"),
                                             "fp8": lambda f, i: (True, "ok")}).summary()
    assert "profile=hopper" in summary and fidelity.strip() in summary     # the policy prints the whole table


def test_facts_that_demote_a_kernel():
    hopper = site_for("hopper")
    fp16 = site_for("hopper", wgmma=lambda: False)                       # the wgmma kernel takes bf16 only
    assert dispatch.decide("nvfp4", "fidelity", 128, fp16).kernel == "w4a16_triton"
    broken = site_for("hopper", w4a16_broken="CompilationError: x")
    assert dispatch.decide("nvfp4", "fidelity", 16, broken).kernel == "dequant_cublas"
    grad = site_for("hopper", rs=lambda: False)                          # autograd keeps the weight: no RS
    assert dispatch.decide("nvfp4", "fidelity", 8192, grad).kernel == "dequant_cublas"
    odd = site_for("hopper", dims16=False)
    assert dispatch.decide("nvfp4", "fp8_speed", 8, odd).path == "fidelity"
    assert dispatch.decide("fp8", "scaled_mm", 8, odd).kernel == "fp8_cast"
    forced = {f: dispatch.decide("nvfp4", "fidelity", 2048, hopper, f).kernel for f in dispatch.FIDELITY_KERNELS}
    assert forced == {"auto": "rs_or_dequant", "fused": "w4a16_wgmma", "rs": "rs_w4a16", "dequant": "dequant_cublas"}
    assert dispatch.decide("nvfp4", "fidelity", 512, hopper, "rs").kernel == "dequant_cublas"    # RS needs M >= 1024
    with pytest.raises(ValueError, match="fidelity_kernel"):
        dispatch.decide("nvfp4", "fidelity", 8, hopper, "pipelined")


def test_sm90_kernels_are_asked_only_when_m_reaches_them():
    asked = []
    site = site_for("hopper", wgmma=lambda: asked.append("wgmma") or True, rs=lambda: asked.append("rs") or True)
    dispatch.decide("nvfp4", "fidelity", 64, site)
    dispatch.decide("nvfp4", "fidelity", 512, site)
    assert asked == []
    dispatch.decide("nvfp4", "fidelity", 65, site)
    dispatch.decide("nvfp4", "fidelity", 1024, site)
    assert asked == ["wgmma", "rs"]


def _layer(n, k, bias=True, seed=0, path="fidelity"):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g) if bias else None
    return NVFP4Linear.from_nvfp4(fmt.quantize_nvfp4(w, return_tensor=True), bias=b, path=path)


def test_layer_decision_and_its_log_line(caplog):
    layer = _layer(512, 64)
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    with caplog.at_level(logging.INFO):
        d = layer.decision(x)                                     # CPU: the reference path, whatever was asked
        assert layer.decision(x) is d
    assert (d.path, d.kernel) == ("reference", "reference")
    assert [r.getMessage() for r in caplog.records].count(d.line("NVFP4", 4)) <= 1
    layer.fidelity_kernel = "fused"
    assert not layer.decisions                                    # a setting change drops the decisions
    assert layer.decision(x).kernel == "reference"
    assert layer.fidelity_kernel in dispatch.FIDELITY_KERNELS


def test_path_follows_the_device_the_layer_runs_on(monkeypatch):
    """A layer loaded with the defaults on the CPU keeps "auto": moved to a GPU it asks that GPU's policy."""
    layer = _layer(64, 64, path="auto")
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    assert layer.decision(x).path == "reference"
    from seedvr2bw.optimization.nvfp4 import launch
    monkeypatch.setattr(launch, "device_is_cuda", lambda d: True)
    monkeypatch.setattr(policy, "get_policy", lambda dev=None, overrides=None: type("P", (), {"nvfp4_gemm": "fidelity"}))
    layer.to(torch.device("cpu"))                                 # a move drops the decisions
    assert layer.decision(x).path == "fidelity"


def test_forward_fidelity_cpu_matches_expected():
    layer = _layer(300, 96)
    x = torch.randn(2, 5, 96).to(torch.bfloat16)
    want = expected_output(layer, x, "fidelity")
    got = layer(x)
    assert got.shape == (2, 5, 300)
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.parametrize("m,n,k", [(1, 3072, 3072), (64, 12288, 3072), (256, 2560, 6912), (200, 80, 96),
                                   (1024, 3072, 12288), (16, 6912, 2560)])
def test_w4a16_config_splits_k_evenly(m, n, k):
    bn, bm, bk, sk, w, st = K.w4a16_config(m, n, k, torch.device("cpu"))
    k_tiles = -(-k // bk)
    assert k_tiles % sk == 0 and (sk == 1 or k_tiles // sk >= 4)
    assert bm >= 16 and bn >= 16 and bk % 16 == 0
