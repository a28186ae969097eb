"""The pack in a real ComfyUI 0.3.75 server: /object_info, /prompt -> /history, /interrupt, websocket
progress, and a start-up with a broken copy of the pack."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from rig.server import PACK_FOLDER_NAME, ComfyServer

from .conftest import REPO
from .prompts import LONG_NODE_ID, PACK_PROMPTS, REQUIRED_NODE_IDS, benchmark_prompt, core_only_prompt, \
    image_roundtrip_prompt


def test_server_started_with_the_pack(comfy_server):
    stats = comfy_server.get_json("/system_stats")
    assert stats["system"]["comfyui_version"] == "0.3.75", stats["system"]
    assert stats["devices"][0]["type"] == "cpu"
    log = comfy_server.log_text()
    assert PACK_FOLDER_NAME in log, "ComfyUI's import-times list should name the pack's folder"
    assert "IMPORT FAILED" not in "\n".join(l for l in log.splitlines() if PACK_FOLDER_NAME in l), log[-4000:]
    # Neither the pack's entry point nor nodes/__init__.py reported a part that did not load.
    problems = [l for l in log.splitlines() if "[SeedVR2-BW]" in l and ("failed to load" in l or "not loaded" in l)]
    assert not problems, "\n".join(problems)


def test_object_info_lists_every_pack_node(comfy_server, pack_node_ids):
    info = comfy_server.object_info()
    assert REQUIRED_NODE_IDS <= set(pack_node_ids)
    missing = set(pack_node_ids) - set(info)
    assert not missing, f"/object_info lacks {sorted(missing)}"
    for node_id in pack_node_ids:
        entry = info[node_id]
        assert entry["python_module"].startswith("custom_nodes."), entry["python_module"]
        assert PACK_FOLDER_NAME in entry["python_module"], entry["python_module"]
        assert entry["display_name"] and entry["category"], entry
    # The single-node endpoint serves the same schema.
    one = comfy_server.object_info("SeedVR2BW_HardwareInfo")
    assert one["SeedVR2BW_HardwareInfo"]["input"] == info["SeedVR2BW_HardwareInfo"]["input"]


@pytest.mark.parametrize("case", PACK_PROMPTS, ids=lambda c: c.name)
def test_pack_prompt_runs_over_http(comfy_server, case):
    info = comfy_server.object_info()
    missing = case.node_ids - set(info)
    if missing:
        if case.optional:
            pytest.skip(f"optional nodes not registered: {sorted(missing)}")
        pytest.fail(f"nodes not in /object_info: {sorted(missing)}")
    entry = comfy_server.run_prompt(case.build(), timeout=case.timeout)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[:3000]
    case.check(entry["outputs"])


def test_invalid_prompt_gets_node_errors(comfy_server):
    status, payload = comfy_server.request("POST", "/prompt", {"prompt": {
        "1": {"class_type": "SeedVR2BW_HardwareInfo", "inputs": {"nvfp4_gemm": "auto"}}}})  # "attention" left out
    assert status == 400, payload
    assert "1" in payload["node_errors"], payload


def test_core_image_roundtrip_saves_into_the_temp_output(comfy_server):
    entry = comfy_server.run_prompt(image_roundtrip_prompt(prefix="srv_roundtrip"))
    assert entry["status"]["status_str"] == "success", entry["status"]
    img = entry["outputs"]["9"]["images"][0]
    assert (comfy_server.output_dir / img["subfolder"] / img["filename"]).is_file()


def _ws_events_until(ws, predicate, timeout):
    """Read websocket JSON events until predicate(event) is true; returns all read."""
    import websocket
    seen = []
    t0 = time.time()
    while time.time() - t0 < timeout:
        ws.settimeout(max(0.1, timeout - (time.time() - t0)))
        try:
            raw = ws.recv()
        except websocket.WebSocketTimeoutException:
            break
        if isinstance(raw, bytes):  # binary previews
            continue
        ev = json.loads(raw)
        seen.append(ev)
        if predicate(ev):
            break
    return seen


def test_interrupt_stops_the_long_node_and_the_server_stays_healthy(comfy_server):
    ws = comfy_server.websocket()
    try:
        pid = comfy_server.queue_prompt(benchmark_prompt(seconds=120, size=64))
        seen = _ws_events_until(ws, lambda e: e["type"] == "progress" and e["data"].get("prompt_id") == pid, 60)
        assert any(e["type"] == "progress" for e in seen), [e["type"] for e in seen]
        assert pid in comfy_server.running_prompt_ids()
        t_int = time.time()
        status, _ = comfy_server.interrupt(pid)
        assert status == 200
        seen += _ws_events_until(ws, lambda e: e["type"] == "execution_interrupted", 30)
        assert any(e["type"] == "execution_interrupted" and e["data"]["prompt_id"] == pid for e in seen), \
            [e["type"] for e in seen]
        entry = comfy_server.wait(pid, timeout=30)
        assert time.time() - t_int < 15, "the interrupt took too long to land"
    finally:
        ws.close()
    assert entry["status"]["status_str"] == "error"
    assert "execution_interrupted" in ComfyServer.status_messages(entry), entry["status"]
    interrupted = dict(entry["status"]["messages"])["execution_interrupted"]
    assert interrupted["node_type"] == LONG_NODE_ID
    # Healthy afterwards: stats answer, queue empty, and the next prompts succeed.
    assert comfy_server.alive()
    comfy_server.get_json("/system_stats")
    assert comfy_server.running_prompt_ids() == []
    after = comfy_server.run_prompt(core_only_prompt("after interrupt"))
    assert after["status"]["status_str"] == "success", after["status"]
    assert after["outputs"]["2"]["text"][0] == "after interrupt!"
    quick = comfy_server.run_prompt(benchmark_prompt(seconds=0.2, size=64))
    assert quick["status"]["status_str"] == "success", quick["status"]


# ---------------------------------------------------------------------- a broken pack
_COPY_IGNORE = shutil.ignore_patterns(".git", ".comfyui", ".venv", ".comfy-venv", "test-output", "tests",
                                      "__pycache__", "*.pyc", ".pytest_cache", "*.safetensors", "*.ckpt", "*.pt")


def _broken_copy(dest: Path, break_what: str) -> Path:
    shutil.copytree(REPO, dest, ignore=_COPY_IGNORE, symlinks=True)
    if break_what == "nodes":
        (dest / "nodes" / "__init__.py").write_text(
            'raise ImportError("simulated failure: nodes/__init__.py is broken (seedvr2bw test)")\n')
    elif break_what == "package":
        (dest / "__init__.py").write_text(
            'raise RuntimeError("simulated failure: the pack package itself is broken (seedvr2bw test)")\n')
    return dest


def test_broken_pack_logs_the_reason_and_comfyui_still_starts(comfy_dir, tmp_path):
    parent = tmp_path / "custom_nodes"
    parent.mkdir()
    _broken_copy(parent / "SeedVR2 broken nodes", "nodes")
    _broken_copy(parent / "SeedVR2 broken package", "package")
    srv = ComfyServer(comfy_dir, custom_node_dirs=[parent], workdir=tmp_path / "srv")
    srv.start()
    try:
        log = srv.log_text()
        # nodes/ fails to import: the pack's entry point logs why and how to fix it, registers nothing.
        assert "[SeedVR2-BW] the node pack failed to load" in log, log[-6000:]
        assert "simulated failure: nodes/__init__.py is broken" in log, log[-6000:]
        assert "pip install -r requirements.txt" in log
        # The package itself fails: ComfyUI logs it as an import failure of that folder and goes on.
        assert "simulated failure: the pack package itself is broken" in log, log[-6000:]
        assert any("IMPORT FAILED" in l and "SeedVR2 broken package" in l for l in log.splitlines()), log[-6000:]
        info = srv.object_info()
        assert not [k for k in info if k.startswith("SeedVR2BW_")], "a broken pack registered nodes"
        entry = srv.run_prompt(core_only_prompt())
        assert entry["status"]["status_str"] == "success", entry["status"]
    finally:
        srv.stop()
