"""The pre-flight diagnostic (scripts/nvfp4_diagnostic.py, optimization/diagnostics): runs on CPU in CI, its JSON
has the documented schema, GPU checks SKIP without a GPU, and forced faults turn the matching check into FAIL."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from seedvr2bw.optimization import diagnostics as diag
from seedvr2bw.optimization.diagnostics import checks_io, checks_system, checks_transfer, runner
from seedvr2bw.optimization.diagnostics.result import CheckResult, DiagContext

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "nvfp4_diagnostic.py"
DATA = Path(__file__).resolve().parent / "data"

CHECK_KEYS = {"name", "status", "value", "unit", "detail", "section", "data", "elapsed_s"}
TOP_KEYS = {"schema", "created_utc", "device", "quick", "faults", "elapsed_s", "counts", "exit_code", "meta", "checks"}
GPU_CHECKS = ("GPU", "H2D pinned vs pageable", "D2H pinned vs pageable", "copy/compute overlap", "bf16 GEMM",
              "FP8 GEMM (torch._scaled_mm)", "SeedVR2-3B swap vs compute", "SeedVR2-7B swap vs compute")
NVFP4_FAULT_CHECKS = ("NVFP4 quantize/dequantize", "NVFP4 reference (dequantize + matmul)")


def _run(args, env_extra=None, timeout=120):
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""          # a CPU run even on a GPU machine
    env.pop(diag.FAULT_ENV, None)
    env.update(env_extra or {})
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=str(REPO))
    return proc, time.perf_counter() - t0


def _by_name(report: dict) -> dict:
    return {c["name"]: c for c in report["checks"]}


def _check_schema(report: dict):
    assert TOP_KEYS <= set(report), set(report) ^ TOP_KEYS
    assert report["schema"] == runner.SCHEMA
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", report["created_utc"])
    counts = defaultdict(int)
    names = set()
    for c in report["checks"]:
        assert set(c) == CHECK_KEYS, c
        assert c["status"] in diag.STATUSES
        assert isinstance(c["name"], str) and c["name"] and c["name"] not in names
        names.add(c["name"])
        assert isinstance(c["detail"], str) and c["detail"], c   # every line says what it means
        assert isinstance(c["unit"], str) and isinstance(c["section"], str) and c["section"]
        assert c["value"] is None or isinstance(c["value"], (int, float, str))
        assert isinstance(c["data"], dict)
        counts[c["status"]] += 1
    assert report["counts"] == {s: counts.get(s, 0) for s in diag.STATUSES}
    assert report["exit_code"] == (1 if counts.get("FAIL") else 0)


@pytest.fixture(scope="module")
def cpu_run():
    proc, dt = _run(["--json"])
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return json.loads(proc.stdout), proc, dt


def test_cpu_run_schema_time_and_exit_code(cpu_run):
    report, proc, dt = cpu_run
    _check_schema(report)
    assert dt < 30, f"the CPU run took {dt:.1f} s (limit 30 s)"
    assert report["device"] == "cpu" and report["quick"] is False and report["faults"] == []
    assert proc.returncode == report["exit_code"]
    assert "skipped" in report["meta"]["gpu_checks"]


def test_cpu_run_statuses(cpu_run):
    report, _, _ = cpu_run
    checks = _by_name(report)
    for name in GPU_CHECKS:
        assert checks[name]["status"] == "SKIP", checks[name]
    assert "no CUDA device" in checks["GPU"]["detail"]
    assert checks["Python"]["status"] == "PASS"
    assert checks["hardware policy"]["status"] == "PASS" and checks["hardware policy"]["value"] == "cpu"
    # checks that do run on CPU: NVFP4 format against the independent reference, the reference GEMM path, attention
    assert checks["NVFP4 quantize/dequantize"]["status"] == "PASS", checks["NVFP4 quantize/dequantize"]
    assert checks["NVFP4 quantize/dequantize"]["value"] == 0
    assert checks["NVFP4 reference (dequantize + matmul)"]["status"] == "PASS"
    assert checks["attention sdpa"]["status"] == "PASS"
    assert checks["package safetensors"]["status"] == "PASS"
    # on this CPU machine nothing may FAIL
    assert [c["name"] for c in report["checks"] if c["status"] == "FAIL"] == []
    assert report["exit_code"] == 0


def test_forced_nvfp4_fault_fails_and_json_path(tmp_path):
    out = tmp_path / "diag.json"
    proc, dt = _run(["--quick", "--json", str(out)], env_extra={diag.FAULT_ENV: "nvfp4_wrong"})
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    _check_schema(report)
    assert report["faults"] == ["nvfp4_wrong"]
    checks = _by_name(report)
    for name in NVFP4_FAULT_CHECKS:
        assert checks[name]["status"] == "FAIL", checks[name]
    assert checks["NVFP4 quantize/dequantize"]["data"]["mismatch_fraction"] > 0.5
    # the human report went to stdout
    assert "FORCED FAULTS: nvfp4_wrong" in proc.stdout
    assert re.search(r"FAIL\s+NVFP4 quantize/dequantize", proc.stdout)
    assert "exit code 1" in proc.stdout
    assert dt < 30


def test_pin_check_skips_on_cpu_and_forced_pin_failure_fails(monkeypatch):
    ctx = DiagContext(device=torch.device("cpu"))
    assert checks_transfer.check_h2d(ctx).status == "SKIP"
    # pretend a CUDA device is there: the check pins first, so a failing pin is reported before any CUDA call
    monkeypatch.setattr(checks_transfer, "cuda_ready", lambda ctx: True)
    ctx = DiagContext(device=torch.device("cpu"), faults=frozenset({"pin_fail"}))
    for fn in (checks_transfer.check_h2d, checks_transfer.check_d2h, checks_transfer.check_overlap):
        r = fn(ctx)
        assert r.status == "FAIL", r
        assert "pinning host memory failed" in r.detail and "pin_fail" in r.detail
    # the same through a monkeypatched pin function (how a real cudaHostAlloc failure arrives)
    def no_pin(nbytes, ctx=None):
        raise RuntimeError("CUDA error: invalid argument")
    monkeypatch.setattr(checks_transfer, "pin_host_buffer", no_pin)
    r = checks_transfer.check_h2d(DiagContext(device=torch.device("cpu")))
    assert r.status == "FAIL" and "invalid argument" in r.detail


def test_pin_fault_through_runner(monkeypatch):
    monkeypatch.setattr(checks_transfer, "cuda_ready", lambda ctx: True)
    report = runner.run_diagnostics(device="cpu", quick=True, faults=["pin_fail"], sections=["Transfers"])
    assert [r.status for r in report.results] == ["FAIL", "FAIL", "FAIL"]
    assert report.exit_code == 1
    d = report.to_dict()
    _check_schema(d)
    assert d["faults"] == ["pin_fail"]


def test_fault_names_are_validated(monkeypatch):
    with pytest.raises(ValueError, match="unknown diagnostic fault"):
        diag.parse_faults("nvfp4_wrong|bogus")
    assert diag.parse_faults("nvfp4_wrong|pin_fail") == {"nvfp4_wrong", "pin_fail"}
    monkeypatch.setenv(diag.FAULT_ENV, "pin_fail")
    assert diag.parse_faults() == {"pin_fail"}


def test_crashing_check_becomes_fail():
    def check_boom(ctx):
        raise ZeroDivisionError("boom")
    (r,) = runner.run_check(check_boom, DiagContext(device=torch.device("cpu")), "Test")
    assert r.status == "FAIL" and "ZeroDivisionError: boom" in r.detail and r.section == "Test"
    with pytest.raises(ValueError):
        CheckResult("x", "OK")


def test_text_renderer():
    results = [CheckResult("a", "PASS", 55.123, "GB/s", "fine", section="S"),
               CheckResult("b", "FAIL", None, "", "broken: do this", section="S")]
    rep = runner.Report(results, "cpu", True, [], 1.0, "2026-01-01T00:00:00Z")
    text = diag.render_text(rep)
    assert "PASS  a" in text and "55.1 GB/s" in text and "broken: do this" in text
    assert "exit code 1" in text and "FAILED: b" in text
    assert json.loads(diag.render_json(rep))["counts"]["FAIL"] == 1


def test_block_constants_match_the_state_dicts():
    for key, fname in (("3B", "keys_dit_3b.json"), ("7B", "keys_dit_7b.json")):
        shape = checks_io.SEEDVR2_DITS[key]
        per_block = defaultdict(lambda: [0, 0])
        non_block = 0
        for e in json.loads((DATA / fname).read_text()):
            n = 1
            for s in e["shape"]:
                n *= s
            m = re.match(r"blocks\.(\d+)\.(.*)", e["name"])
            if not m:
                non_block += n
                continue
            is_linear = len(e["shape"]) == 2 and m.group(2).endswith(".weight")
            per_block[int(m.group(1))][0 if is_linear else 1] += n
        got = sorted(tuple(v) for v in per_block.values())
        want = sorted((g.linear_weights, g.other) for g in shape.groups for _ in range(g.count))
        assert got == want, key
        assert shape.num_blocks == len(per_block)
        assert shape.non_block == non_block
        for g in shape.groups:
            assert g.video_linear + g.text_linear == g.linear_weights
    # 7B block: 226.57 M params -> 453 MB bf16 (docs/SPEC.md §4.3)
    g7 = checks_io.SEEDVR2_DITS["7B"].groups[0]
    assert abs(checks_io.block_bytes(g7, "bf16") / 1e6 - 453.1) < 0.5
    # ~232-237 MFLOP per video token for 7B (docs/SPEC.md §4.3)
    per_token = checks_io.block_flops(g7, 3072, 3600, 1) / 3600
    assert 225e6 < per_token < 245e6


def test_comfyui_version_found_from_a_comfyui_tree(tmp_path, monkeypatch):
    comfy = tmp_path / "ComfyUI"
    pack = comfy / "custom_nodes" / "seedvr2-blackwell"
    (pack / "scripts").mkdir(parents=True)
    (comfy / "comfyui_version.py").write_text('__version__ = "0.3.75"\n')
    version, where = checks_system.find_comfyui_version(pack)
    assert version == "0.3.75" and Path(where) == comfy
    # a symlinked pack, found through the script's path as the user typed it
    link = comfy / "custom_nodes" / "linked"
    link.symlink_to(REPO, target_is_directory=True)
    monkeypatch.setattr(sys, "argv", [str(link / "scripts" / "nvfp4_diagnostic.py")])
    version, where = checks_system.find_comfyui_version(REPO)
    assert version == "0.3.75"
    ctx = DiagContext(device=torch.device("cpu"), pack_root=pack)
    r = checks_system.check_comfyui(ctx)
    assert r.status == "PASS" and r.value == "0.3.75"
    (comfy / "comfyui_version.py").write_text('__version__ = "0.3.60"\n')
    assert checks_system.check_comfyui(ctx).status == "WARN"


def test_node_schema_and_execute(monkeypatch):
    from comfy_env import import_node_module
    mod = import_node_module("diagnostic")
    assert mod.NODES == [mod.Diagnostic]
    schema = mod.Diagnostic.define_schema()
    assert schema.node_id == "SeedVR2BW_Diagnostic" and schema.is_output_node
    # run it with comfy.model_management unavailable (outside a ComfyUI server): default device, no progress bar
    monkeypatch.setitem(sys.modules, "comfy.model_management", None)
    called = {}

    def fake_run(device=None, quick=False, progress=None, **kw):
        called["quick"] = quick
        return runner.Report([CheckResult("x", "PASS", 1.0, "u", "d", section="S")], "cpu", quick, [], 0.1,
                             "2026-01-01T00:00:00Z")
    monkeypatch.setattr(mod, "run_diagnostics", fake_run)
    out = mod.Diagnostic.execute(quick=True, details=True)
    text = out.args[0] if hasattr(out, "args") else out.result[0]
    assert "PASS  x" in text and called["quick"] is True
    assert json.loads(out.args[1] if hasattr(out, "args") else out.result[1])["checks"][0]["name"] == "x"


def test_io_vs_compute_model(monkeypatch):
    """The IO-vs-compute verdict from given measurements: a 16 GiB card at PCIe 4.0 speed, 150 TFLOP/s."""
    monkeypatch.setattr(checks_io, "cuda_ready", lambda ctx: True)
    monkeypatch.setattr(checks_io, "vram_info", lambda ctx: (15 * 2**30, 16 * 2**30))
    ctx = DiagContext(device=torch.device("cpu"))
    assert all(r.status == "SKIP" for r in checks_io.check_io_vs_compute(ctx))  # no measurements yet
    ctx.measured.update(h2d_pinned_gbps=25.0, bf16_tflops=150.0)
    r3, r7 = checks_io.check_io_vs_compute(ctx)
    d7 = r7.data
    assert abs(d7["copy_ms_per_block"]["bf16"] - 453.1e6 / 25e9 * 1e3) < 0.1      # 18.1 ms per 7B bf16 block
    assert abs(d7["copy_ms_per_block"]["nvfp4"] - d7["copy_ms_per_block"]["bf16"] * 0.5625 / 2) < 0.1
    c720 = d7["cases"][0]
    assert c720["case"] == "720p x 1 frame" and not c720["hidden"]["bf16"]        # 5.7 ms compute < 18 ms copy
    c1080_21 = d7["cases"][3]
    assert all(c1080_21["hidden"].values()) and c1080_21["free_swap_blocks"]["bf16"] == 36
    # 16.5 GB of 7B bf16 weights do not fit in 15 GiB free: the plan swaps blocks
    plan = d7["blockswap_plan"]["bf16"]
    assert plan["blocks_to_swap"] > 0 and r7.value == plan["blocks_to_swap"]
    assert r7.status in ("PASS", "WARN") and "BlockSwap" in r7.detail
    assert d7["blockswap_plan"]["nvfp4"]["blocks_to_swap"] == 0                   # 4.7 GB of NVFP4 fits
    assert r3.data["blocks"] == 32


def test_script_inside_a_comfyui_tree(tmp_path):
    """`python scripts/nvfp4_diagnostic.py` from ComfyUI/custom_nodes/<pack>/ (a symlinked pack, the harder case:
    os.getcwd() resolves the link) finds ComfyUI's version through ../../comfyui_version.py."""
    comfy = tmp_path / "ComfyUI"
    (comfy / "custom_nodes").mkdir(parents=True)
    (comfy / "comfyui_version.py").write_text('__version__ = "0.3.75"\n')
    link = comfy / "custom_nodes" / "ComfyUI-SeedVR2-BW"
    link.symlink_to(REPO, target_is_directory=True)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PWD=str(link))
    env.pop(diag.FAULT_ENV, None)
    proc = subprocess.run([sys.executable, "scripts/nvfp4_diagnostic.py", "--quick", "--json"], cwd=str(link),
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    check = _by_name(json.loads(proc.stdout))["ComfyUI"]
    assert check["status"] == "PASS" and check["value"] == "0.3.75", check


def test_attention_windows_follow_the_spec():
    from seedvr2bw.optimization.diagnostics.checks_compute import axis_windows, seedvr2_window_lengths
    # docs/SPEC.md §3 examples: a 23x41 frame (adaptive 720p windows 15x27) and 5 latent frames
    assert [axis_windows(23, 15, False), axis_windows(41, 27, False)] == [[15, 8], [27, 14]]
    assert [axis_windows(23, 15, True), axis_windows(41, 27, True)] == [[7, 15, 1], [13, 27, 1]]
    assert axis_windows(5, 2, False) == [2, 2, 1] and axis_windows(5, 2, True) == [1, 2, 2]
    # 720p x 21 frames: 3x3x3 windows unshifted, 4x4x4 shifted, every video token exactly once
    u, s = seedvr2_window_lengths(6, 45, 80, False), seedvr2_window_lengths(6, 45, 80, True)
    assert (len(u), len(s)) == (27, 64)
    assert sum(u) - 58 * len(u) == sum(s) - 58 * len(s) == 6 * 45 * 80
    assert len(seedvr2_window_lengths(1, 23, 41, False)) == 4


def test_io_vs_compute_uses_measured_block_times(monkeypatch):
    monkeypatch.setattr(checks_io, "cuda_ready", lambda ctx: True)
    monkeypatch.setattr(checks_io, "vram_info", lambda ctx: (15 * 2**30, 16 * 2**30))
    fake = {"720p x 1 frame": 2.4, "1080p x 1 frame": 5.0, "720p x 21 frames": 12.5,
            "1080p x 21 frames": "out of memory: test"}
    monkeypatch.setattr(checks_io, "measure_blocks", lambda ctx, key: dict(fake))
    ctx = DiagContext(device=torch.device("cpu"))
    ctx.measured.update(h2d_pinned_gbps=25.0, bf16_tflops=150.0)
    _, r7 = checks_io.check_io_vs_compute(ctx)
    cases = {c["case"]: c for c in r7.data["cases"]}
    assert cases["720p x 1 frame"]["compute_ms_per_block"] == 2.4
    assert cases["720p x 1 frame"]["compute_ms_bound"] < 2.4 * 3
    assert cases["1080p x 21 frames"]["compute_ms_measured"] is None
    assert cases["1080p x 21 frames"]["measure_error"] == "out of memory: test"
    assert "measured time of one block" in r7.detail and "not measured: out of memory" in r7.detail
    # the real measurement is never attempted on CPU (it would run full-size blocks)
    assert checks_io.measure_blocks.__name__ == "<lambda>"


def test_block_timing_runs_the_pack_dit_on_cpu():
    from seedvr2bw.models.seedvr2.dit import DiTConfig
    from seedvr2bw.optimization.diagnostics.block_timing import latent_grid, measure_block_ms
    assert latent_grid(720, 1280, 1) == (1, 90, 160) and latent_grid(1080, 1920, 21) == (6, 136, 240)
    cfg = DiTConfig(variant="7b", dim=256, heads=2, head_dim=128, num_layers=36)
    got = measure_block_ms(cfg, [("tiny", 64, 96, 1)], "cpu", reps=1, dtype=torch.float32)
    assert isinstance(got["tiny"], float) and got["tiny"] > 0


def test_torch_without_kernels_for_the_gpu_skips_the_gpu_sections(monkeypatch):
    def arch_fail(ctx):
        ctx.measured["arch_problem"] = "no kernels"
        return CheckResult("torch kernels for this GPU", "FAIL", "missing", "", "no kernels: install cu128")
    monkeypatch.setattr(runner, "SECTIONS", (("System", (arch_fail,)), ("Transfers", checks_transfer.CHECKS)))
    report = runner.run_diagnostics(device="cpu", quick=True)
    assert [r.status for r in report.results] == ["FAIL", "SKIP", "SKIP", "SKIP"]
    assert "no kernels for this GPU" in report.results[1].detail


def test_overlap_trials_median_of_interleaved_trials():
    seq = iter([5.0, 5.0, 5.1,   5.0, 5.0, 9.0,   4.0, 6.0, 6.2])   # (copy, gemm, both) per trial
    t_copy, t_gemm, t_both, hidden = checks_transfer.overlap_trials(lambda: next(seq), lambda: next(seq),
                                                                    lambda: next(seq), trials=3)
    assert (t_copy, t_gemm, t_both) == (5.0, 5.0, 6.2)
    assert abs(hidden - 0.95) < 1e-9      # per-trial fractions 0.98, 0.2, 0.95 -> median 0.95
