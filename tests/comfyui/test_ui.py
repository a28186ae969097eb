"""The real ComfyUI frontend (comfyui-frontend-package 1.32.9) in headless Chromium: the pack's nodes are
registered, every workflow in workflows/ loads with no missing or broken node, and a screenshot of each
goes to test-output/ui/."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from rig.ui_check import Browser, ComfyFrontend, find_chromium, workflow_node_types

from .conftest import REPO, need

# The pack's shipped workflows, plus the rig's own (so the check always runs on at least one).
WORKFLOWS = sorted((REPO / "workflows").glob("*.json")) + sorted((Path(__file__).parent / "workflows").glob("*.json"))


@pytest.fixture(scope="module")
def frontend(comfy_server):
    chromium = find_chromium()
    need(chromium is not None, "no Chromium: apt-get install -y chromium (the frontend tests need it)")
    try:
        import websocket  # noqa: F401
    except ImportError:
        need(False, "websocket-client missing: pip install -r requirements-test.txt")
    with Browser(chromium) as browser:
        fe = ComfyFrontend(browser, comfy_server.url)
        fe.load_seconds = fe.open()
        yield fe


def test_frontend_registers_every_pack_node(frontend, pack_node_ids, ui_out_dir):
    present = frontend.registered(pack_node_ids)
    missing = [t for t, ok in present.items() if not ok]
    assert not missing, f"not registered in LiteGraph: {missing}"
    # Every pack node can be created on the canvas and renders with its widgets / outputs.
    made = frontend.b.js(f"""(() => {{
        app.graph.clear();
        const out = {{}}; let x = 40, y = 80;
        for (const t of {json.dumps(pack_node_ids)}) {{
            const n = LiteGraph.createNode(t);
            if (!n) {{ out[t] = null; continue; }}
            n.pos = [x, y]; app.graph.add(n);
            out[t] = {{size: Array.from(n.size), widgets: (n.widgets || []).map(w => w.name),
                       outputs: (n.outputs || []).map(o => o.type), has_errors: !!n.has_errors}};
            x += n.size[0] + 40; if (x > 1200) {{ x = 40; y += 260; }}
        }}
        app.canvas.setDirty(true, true);
        return out; }})()""")
    assert all(made[t] is not None for t in pack_node_ids), made
    for t, node in made.items():
        assert node["size"][0] > 0 and node["size"][1] > 0 and not node["has_errors"], (t, node)
    hw = made["SeedVR2BW_HardwareInfo"]
    assert {"nvfp4_gemm", "attention"} <= set(hw["widgets"]) and hw["outputs"] == ["STRING"], hw
    time.sleep(0.5)
    frontend.b.screenshot(ui_out_dir / "all_pack_nodes.png")
    errors = [e for e in frontend.b.console_errors() if "SeedVR2" in e or "seedvr2" in e.lower()]
    assert not errors, errors


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=[f"{p.parent.name}/{p.name}" for p in WORKFLOWS])
def test_workflow_loads_without_missing_nodes(frontend, workflow, pack_node_ids, ui_out_dir):
    data = json.loads(Path(workflow).read_text())
    used = workflow_node_types(data)
    pack_used = sorted(t for t in used if t in set(pack_node_ids) or t.startswith("SeedVR2BW_"))
    unknown_pack = [t for t in pack_used if t not in pack_node_ids]
    assert not unknown_pack, f"{workflow.name} uses pack node ids the pack does not define: {unknown_pack}"
    report = frontend.check_workflow(data, workflow.name, ui_out_dir / f"{workflow.stem}.png")
    assert report["nodes"], f"{workflow.name}: nothing was loaded"
    assert not report["missing"], f"{workflow.name}: node types missing in the frontend: {report['missing']}"
    assert not report["missing_dialog"], f"{workflow.name}: missing-nodes dialog: {report['dialogs']}"
    assert not report["with_errors"], f"{workflow.name}: nodes with errors: {report['with_errors']}"
    assert not report["problem_toasts"], f"{workflow.name}: warnings on load: {report['problem_toasts']}"
    assert not report["bad_widgets"], (
        f"{workflow.name}: widget values that do not fit their widgets (widgets_values shifted against the "
        f"node's inputs?): {json.dumps(report['bad_widgets'], indent=1)}")
    loaded_types = {n["type"] for n in report["nodes"]}
    assert set(pack_used) <= loaded_types, (pack_used, sorted(loaded_types))
    for n in report["nodes"]:
        assert n["size"][0] > 0 and n["size"][1] > 0, n
    assert report["converts"] is True, f"{workflow.name}: graphToPrompt failed: {report['converts']}"
    assert Path(report["screenshot"]).stat().st_size > 10_000


RIG_WORKFLOW = Path(__file__).parent / "workflows" / "hardware_report_ui.json"


def test_rig_workflow_runs_from_the_ui(frontend, ui_out_dir):
    """The UI -> API conversion real users go through, then a real run (the Run button's path)."""
    frontend.load_workflow(json.loads(RIG_WORKFLOW.read_text()), RIG_WORKFLOW.name)
    entry = frontend.queue_current()
    assert entry["status"]["status_str"] == "success", entry["status"]
    texts = [o["text"][0] for o in entry["outputs"].values() if o.get("text")]
    assert any(t.startswith("report: ") for t in texts), entry["outputs"]
    time.sleep(0.5)
    frontend.b.screenshot(ui_out_dir / "hardware_report_ui.after_run.png")


def test_checker_catches_a_missing_node(frontend, tmp_path):
    """The checker itself: a workflow with an unknown node type must be reported as broken."""
    data = json.loads(RIG_WORKFLOW.read_text())
    data["nodes"][0]["type"] = "SeedVR2BW_NoSuchNode"
    report = frontend.check_workflow(data, "broken.json", tmp_path / "broken.png")
    assert report["missing"] == ["SeedVR2BW_NoSuchNode"], report
    assert not report["bad_widgets"], report["bad_widgets"]
    assert report["missing_dialog"] or report["with_errors"], report
    frontend.close_dialogs()


def test_checker_catches_shifted_widget_values(frontend, tmp_path):
    """The checker itself: widgets_values shifted by one (a value left out) must be reported."""
    data = json.loads(RIG_WORKFLOW.read_text())
    node = next(n for n in data["nodes"] if n["type"] == "SeedVR2BW_HardwareInfo")
    node["widgets_values"] = [250, "auto"]  # a number where the nvfp4_gemm combo's string belongs
    report = frontend.check_workflow(data, "shifted.json", tmp_path / "shifted.png")
    assert any("SeedVR2BW_HardwareInfo" in k for k in report["bad_widgets"]), report["bad_widgets"]
    frontend.close_dialogs()


def test_training_workflow_runs_from_the_run_button(frontend, comfy_server, comfy_inprocess, ui_out_dir):
    """workflows/flux_lora_train.json (pointed at the tiny FLUX files) loaded in the real frontend and started with
    its Run button: trains, saves the LoRA into models/loras, samples with it through LoraLoader."""
    from .test_flux_training import _server_models, tiny_ui_workflow
    loras = _server_models(comfy_server, comfy_inprocess)
    frontend.load_workflow(tiny_ui_workflow("ui/tiny_lora"), "flux_lora_train.json")
    time.sleep(0.5)
    frontend.b.screenshot(ui_out_dir / "flux_lora_train.before_run.png")
    entry = frontend.click_run(timeout=600)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[:3000]
    assert (loras / "ui" / "tiny_lora.safetensors").is_file()
    assert any(o.get("images") for o in entry["outputs"].values()), entry["outputs"]
    time.sleep(0.5)
    frontend.b.screenshot(ui_out_dir / "flux_lora_train.after_run.png")
