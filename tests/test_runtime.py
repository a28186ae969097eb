"""The runtime layer: the knob table (one parser, once per process, README in sync, the only reader of os.environ),
the self-test memo, and the policy's TF32 / cuDNN settings scoped to the pack's own model calls."""
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from seedvr2bw.optimization.runtime import device, knobs, policy, selftests

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "data" / "golden"


def test_every_knob_is_parsed_one_way():
    env = {"SEEDVR2BW_FUSED": "off", "SEEDVR2BW_FP8_GEMM": "Yes", "SEEDVR2BW_PINNED_POOL_BYTES": "1.5G",
           "SEEDVR2BW_COPY_STREAMS": "2", "SEEDVR2BW_NVFP4_GEMM": "Fidelity", "SEEDVR2BW_TRAIN_SELECTIVE_CKPT": "0",
           "SEEDVR2BW_TF32": "auto", "SEEDVR2BW_QKV_KERNEL": "v2"}
    v = knobs.parse(env)
    assert (v["FUSED"], v["FP8_GEMM"], v["PINNED_POOL_BYTES"], v["COPY_STREAMS"], v["NVFP4_GEMM"]) == \
        (False, True, int(1.5 * 2 ** 30), 2, "fidelity")
    assert (v["TRAIN_SELECTIVE_CKPT"], v["TF32"], v["QKV_KERNEL"], v["SDPA"], v["WGMMA"]) == \
        ("off", None, "v2", "auto", True)
    assert set(v) == set(knobs.KNOB) and len(knobs.KNOBS) == len(knobs.KNOB)
    for var, raw, needle in [("SEEDVR2BW_FUSED", "maybe", "on/off"), ("SEEDVR2BW_COPY_STREAMS", "two", "whole"),
                             ("SEEDVR2BW_SDPA", "fastest", "auto, cudnn, flash, default")]:
        with pytest.raises(ValueError, match=f"{var}='{raw}'.*{needle}"):
            knobs.parse({var: raw})


def test_knobs_are_read_once_until_reset(monkeypatch):
    monkeypatch.setenv("SEEDVR2BW_FUSED", "off")
    assert knobs.get("FUSED") is False
    import os
    os.environ["SEEDVR2BW_FUSED"] = "on"          # behind the cache's back: still the first value
    try:
        assert knobs.get("FUSED") is False
        knobs.reset()
        assert knobs.get("FUSED") is True
        with knobs.override(FUSED=False):
            assert knobs.get("FUSED") is False
        assert knobs.get("FUSED") is True
    finally:
        del os.environ["SEEDVR2BW_FUSED"]
        knobs.reset()
    with pytest.raises(KeyError):
        knobs.external("HOME")


def test_readme_settings_table_is_generated_from_the_knobs():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_settings_table.py"), "--check"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for k in knobs.KNOBS:
        assert f"`{k.var}`" in readme


def test_only_the_knob_table_reads_the_environment():
    hits = []
    for folder in ("optimization", "models", "nodes", "training"):
        for path in (ROOT / folder).rglob("*.py"):
            if re.search(r"os\.environ|os\.getenv|getenv\(", path.read_text(encoding="utf-8")):
                hits.append(str(path.relative_to(ROOT)))
    if "os.environ" in (ROOT / "__init__.py").read_text(encoding="utf-8"):
        hits.append("__init__.py")
    assert hits == [str(Path("optimization/runtime/knobs.py"))]


def test_selftest_memo_runs_once_per_device_and_resets():
    calls = []

    def check(variant, dev):
        calls.append((variant, str(dev)))
        if variant == "boom":
            raise RuntimeError("kernel failed\nmore")
        return True, "ok"
    try:
        assert selftests.run("test_feature", "cpu", "a", check) == (True, "ok")
        assert selftests.run("test_feature", "cpu", "a", check) == (True, "ok")
        assert selftests.run("test_feature", "cpu", "boom", check) == (False, "RuntimeError: kernel failed")
        assert calls == [("a", "cpu"), ("boom", "cpu")]
        assert selftests.status("test_feature", "cpu", "a") == (True, "ok")
        selftests.reset("test_feature")
        assert selftests.status("test_feature", "cpu", "a") is None
        assert selftests.run("unregistered_feature", "cpu")[0] is False
    finally:
        selftests.reset("test_feature")


def _cuda_policy(tf32=True, bench=True):
    info = device.DeviceInfo(type="cuda", index=0, name="GPU", capability=(9, 0), arch_list=("sm_90",))
    p = policy.decide(info, selftests={"nvfp4": lambda p, i: (True, "ok"), "fp8": lambda f, i: (True, "ok")})
    return policy.with_overrides(p, tf32=tf32, cudnn_benchmark=bench)


def _flags():
    return (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)


def test_torch_settings_are_scoped_and_restored():
    before = _flags()
    want = not before[2]
    with policy.torch_settings(_cuda_policy(tf32=not before[0], bench=want)):
        assert _flags() == (not before[0], not before[0], want)
    assert _flags() == before
    with pytest.raises(ZeroDivisionError):
        with policy.torch_settings(_cuda_policy(tf32=not before[0], bench=want)):
            1 / 0
    assert _flags() == before
    with policy.torch_settings(policy.get_policy("cpu")):      # CPU: nothing to set
        assert _flags() == before


def test_loading_and_running_the_tiny_models_leaves_torch_settings_alone(monkeypatch):
    """Loading the tiny DiT / VAE and upscaling through the pipeline changes no process-wide torch flag; inside the
    model calls the policy's settings hold (a CUDA policy given to the CPU runner shows it)."""
    from seedvr2bw.models.seedvr2 import pipeline as P
    from seedvr2bw.models.seedvr2.dit.loader import load_dit
    from seedvr2bw.models.seedvr2.vae import load_vae
    before = _flags()
    dit = load_dit(str(GOLDEN / "dit_3b_tiny_weights.safetensors"))
    vae = load_vae(str(GOLDEN / "vae_tiny_weights.safetensors"), norm_num_groups=2)
    policy.get_policy("cpu")
    assert _flags() == before
    frames = torch.rand(1, 16, 16, 3, generator=torch.Generator().manual_seed(5))
    out = P.upscale(frames, dit, vae, torch.randn(3, 24), P.UpscaleSettings(resolution=16, seed=1))
    assert torch.isfinite(out).all() and _flags() == before
    seen = []
    dit.register_forward_pre_hook(lambda m, a: seen.append(_flags()))
    cuda_like = _cuda_policy(tf32=not before[0], bench=not before[2])
    monkeypatch.setattr(P, "get_policy", lambda dev: cuda_like)
    P.upscale(frames, dit, vae, torch.randn(3, 24), P.UpscaleSettings(resolution=16, seed=1))
    assert seen and all(f == (not before[0], not before[0], not before[2]) for f in seen)
    assert _flags() == before


def test_map_pages_writes_zeros_on_a_thread_before_the_first_write():
    from seedvr2bw.optimization.runtime.host_copy import map_pages
    t = torch.full((3, 1000), 5.0)
    mapped = map_pages(t)
    mapped.join()
    assert not mapped.is_alive() and torch.count_nonzero(t) == 0


def test_free_device_bytes_counts_the_allocators_unused_blocks(monkeypatch):
    # a second run of the same work must see the memory the first one left cached as free (else its VAE tiles, and
    # so cuDNN's shapes, change between runs)
    from seedvr2bw.models.seedvr2.staging import device_budget
    GiB = 1024 ** 3
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (10 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 30 * GiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 18 * GiB)
    assert device.free_device_bytes("cuda:0") == 22 * GiB
    assert device_budget("cuda:0") == 22 * GiB
    assert device_budget("cpu") is None
