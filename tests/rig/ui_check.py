"""Headless Chromium against a running ComfyUI: the real frontend loads the pack's node definitions,
each workflow json loads without missing or broken nodes, and a screenshot of each is saved.

Chromium is Debian's ``chromium`` (/usr/bin/chromium), driven directly over the DevTools protocol with
``websocket-client``: no browser download, no driver whose version must match the browser.

    python tests/rig/ui_check.py --url http://127.0.0.1:8188 --out test-output/ui \
        --expect-node SeedVR2BW_HardwareInfo workflows/*.json

Exit status 0 when every expected node type is registered and every workflow loaded cleanly.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--no-first-run", "--disable-quic", "--no-default-browser-check", "--mute-audio",
                  "--hide-scrollbars")


def find_chromium() -> str | None:
    for cand in (os.environ.get("CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                 shutil.which("chromium-browser"), shutil.which("google-chrome")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


class BrowserError(RuntimeError):
    pass


class Browser:
    """One headless Chromium with a fresh profile, one page, a tiny synchronous CDP client."""

    def __init__(self, chromium: str | None = None, width: int = 1600, height: int = 1000):
        self.chromium = chromium or find_chromium()
        if not self.chromium:
            raise BrowserError("no Chromium found: apt-get install -y chromium (or set CHROMIUM)")
        self.width, self.height = width, height
        self.profile = tempfile.mkdtemp(prefix="seedvr2bw-ui-profile-")
        self.proc = None
        self.ws = None
        self._id = 0
        self.events: list[dict] = []

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    def start(self, timeout: float = 60.0) -> "Browser":
        import websocket  # websocket-client
        self.proc = subprocess.Popen(
            [self.chromium, *CHROMIUM_FLAGS, f"--user-data-dir={self.profile}",
             "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
             f"--window-size={self.width},{self.height}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = Path(self.profile) / "DevToolsActivePort"  # written by Chromium for port 0
        t0 = time.time()
        page_ws = None
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise BrowserError(f"Chromium exited with {self.proc.returncode}")
            if port_file.is_file():
                lines = port_file.read_text().split()
                if lines:
                    try:
                        with urllib.request.urlopen(f"http://127.0.0.1:{lines[0]}/json", timeout=2) as r:
                            tabs = json.loads(r.read())
                        page_ws = next((t["webSocketDebuggerUrl"] for t in tabs if t.get("type") == "page"), None)
                    except OSError:
                        pass
            if page_ws:
                break
            time.sleep(0.2)
        if not page_ws:
            self.close()
            raise BrowserError("Chromium's DevTools endpoint did not come up")
        self.ws = websocket.create_connection(page_ws, timeout=60, suppress_origin=True)
        self.call("Runtime.enable")
        self.call("Page.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=self.width, height=self.height,
                  deviceScaleFactor=1, mobile=False)
        return self

    def close(self):
        if self.ws is not None:
            try:
                self.ws.close()
            except Exception:  # noqa: BLE001
                pass
            self.ws = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        shutil.rmtree(self.profile, ignore_errors=True)

    # ------------------------------------------------------------------ CDP
    def call(self, method: str, **params):
        self._id += 1
        my_id = self._id
        self.ws.send(json.dumps({"id": my_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == my_id:
                if "error" in msg:
                    raise BrowserError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            if "method" in msg:
                self.events.append(msg)

    def js(self, expression: str, timeout: float = 60.0):
        r = self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True,
                      timeout=int(timeout * 1000))
        if "exceptionDetails" in r:
            d = r["exceptionDetails"]
            text = (d.get("exception") or {}).get("description") or d.get("text")
            raise BrowserError(f"page script failed: {text}"[:2000])
        return r.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout: float = 60.0, every: float = 0.25):
        t0 = time.time()
        while time.time() - t0 < timeout:
            value = self.js(expression)
            if value:
                return value
            time.sleep(every)
        raise BrowserError(f"timed out after {timeout:.0f} s waiting for: {expression}")

    def screenshot(self, path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def console_errors(self) -> list[str]:
        return console_errors(self.events)


def console_errors(events) -> list[str]:
    """Uncaught exceptions and console.error() lines among CDP events."""
    out = []
    for ev in events:
        if ev["method"] == "Runtime.exceptionThrown":
            d = ev["params"]["exceptionDetails"]
            out.append((d.get("exception") or {}).get("description") or d.get("text", "exception"))
        elif ev["method"] == "Runtime.consoleAPICalled" and ev["params"].get("type") == "error":
            out.append(" ".join(str(a.get("value", a.get("description", ""))) for a in ev["params"]["args"]))
    return out


# ---------------------------------------------------------------------- ComfyUI frontend
READY_JS = ("!!(window.app && window.app.graph && window.app.canvas && window.LiteGraph && "
            "Object.keys(LiteGraph.registered_node_types).length > 100)")

DIALOGS_JS = """(() => [...document.querySelectorAll('.p-dialog, [role=dialog]')]
  .filter(d => d.offsetParent !== null || d.getClientRects().length)
  .map(d => (d.innerText || '').trim().slice(0, 400)))()"""

CLOSE_DIALOGS_JS = """(() => { let n = 0;
  document.querySelectorAll('.p-dialog-close-button, .p-dialog-header-close, [role=dialog] [aria-label=Close]')
    .forEach(b => { b.click(); n++; });
  return n; })()"""

TOASTS_JS = """(() => [...document.querySelectorAll('.p-toast-message')].map(t => ({
  severity: (t.className.match(/p-toast-message-(success|info|warn|error|secondary|contrast)/) || [, 'info'])[1],
  text: (t.innerText || '').trim().slice(0, 600)})))()"""

CLEAR_TOASTS_JS = """(() => { const b = [...document.querySelectorAll('.p-toast-close-button')];
  b.forEach(x => x.click()); return b.length; })()"""

# Settings for a clean, repeatable page: no first-run template browser, no minimap in the screenshots, no
# missing-models dialog (model files are never there in CI; loaders are checked by their own tests).
# The missing-nodes warning stays on (its default): the checks look for it.
FRONTEND_SETTINGS = {"Comfy.TutorialCompleted": True, "Comfy.Minimap.Visible": False,
                     "Comfy.Workflow.ShowMissingModelsWarning": False}

# Widget values that cannot be right: the sign of a workflow whose widgets_values are shifted against the
# node's inputs (a missing "control_after_generate" entry after a seed, say). Combo membership is only
# checked for control_after_generate: a model-file combo legitimately names a file this machine lacks.
GRAPH_REPORT_JS = """(() => {
  const reg = LiteGraph.registered_node_types;
  const all = [];
  const badWidgets = (n) => {
    const bad = [];
    for (const w of (n.widgets || [])) {
      const v = w.value, o = w.options || {}, t = typeof v, where = `${w.name}=${JSON.stringify(v)}`;
      if (w.type === 'number') {
        if (t !== 'number' || !isFinite(v)) bad.push(`${where} (number widget)`);
        else if ((o.min != null && v < o.min) || (o.max != null && v > o.max)) bad.push(`${where} (outside ${o.min}..${o.max})`);
      } else if (w.type === 'toggle') {
        if (t !== 'boolean') bad.push(`${where} (boolean widget)`);
      } else if (w.type === 'text' || w.type === 'customtext') {
        if (t !== 'string') bad.push(`${where} (text widget)`);
      } else if (w.type === 'combo') {
        const vals = Array.isArray(o.values) ? o.values : [];
        if (w.name === 'control_after_generate' && !vals.includes(v)) bad.push(`${where} (not one of ${vals})`);
        else if (vals.length && vals.every(x => typeof x === 'string') && t !== 'string') bad.push(`${where} (combo of strings)`);
      }
    }
    return bad;
  };
  const visit = (graph) => {
    for (const n of (graph.nodes || graph._nodes || [])) {
      all.push({id: n.id, type: n.type, title: n.title, registered: n.type in reg,
                has_errors: !!n.has_errors, widgets: (n.widgets || []).length, bad_widgets: badWidgets(n),
                inputs: (n.inputs || []).length, outputs: (n.outputs || []).length,
                pos: Array.from(n.pos || [0, 0]), size: Array.from(n.size || [0, 0])});
      if (n.subgraph) visit(n.subgraph);
    }
  };
  visit(app.graph);
  return all;
})()"""

# Fit every node into the part of the canvas that the side bar, the tab bar and the bottom tool bar leave free.
FIT_JS = """(() => {
  const nodes = app.graph.nodes || app.graph._nodes || [];
  if (!nodes.length) return false;
  let x0 = Infinity, y0 = Infinity, x1 = -Infinity, y1 = -Infinity;
  for (const n of nodes) {
    x0 = Math.min(x0, n.pos[0]); y0 = Math.min(y0, n.pos[1] - 40);
    x1 = Math.max(x1, n.pos[0] + n.size[0]); y1 = Math.max(y1, n.pos[1] + n.size[1]);
  }
  const el = app.canvas.canvas, w = el.clientWidth || el.width, h = el.clientHeight || el.height;
  const L = 90, T = 150, R = 30, B = 80, aw = w - L - R, ah = h - T - B;
  const scale = Math.max(0.15, Math.min(1.3, Math.min(aw / (x1 - x0), ah / (y1 - y0))));
  const sx = L + (aw - (x1 - x0) * scale) / 2, sy = T + (ah - (y1 - y0) * scale) / 2;
  app.canvas.ds.scale = scale;
  app.canvas.ds.offset = [sx / scale - x0, sy / scale - y0];
  app.canvas.setDirty(true, true);
  return true;
})()"""


def is_api_format(workflow: dict) -> bool:
    return "nodes" not in workflow and all(isinstance(v, dict) and "class_type" in v for v in workflow.values())


class ComfyFrontend:
    def __init__(self, browser: Browser, url: str):
        self.b = browser
        self.url = url.rstrip("/")

    def post_settings(self, settings: dict) -> None:
        req = urllib.request.Request(self.url + "/settings", data=json.dumps(settings).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()

    def open(self, timeout: float = 120.0) -> float:
        t0 = time.time()
        self.post_settings(FRONTEND_SETTINGS)
        self.b.call("Page.navigate", url=self.url + "/")
        self.b.wait_for(READY_JS, timeout=timeout)
        time.sleep(1.0)  # let the first-run template dialog appear, then close it
        self.close_dialogs()
        return time.time() - t0

    def close_dialogs(self):
        for _ in range(3):
            if not self.b.js(CLOSE_DIALOGS_JS):
                break
            time.sleep(0.3)

    def registered(self, node_types) -> dict[str, bool]:
        return self.b.js(f"(() => {{ const r = {{}}; for (const t of {json.dumps(list(node_types))}) "
                         f"r[t] = t in LiteGraph.registered_node_types; return r; }})()")

    def toasts(self) -> list[dict]:
        return self.b.js(TOASTS_JS) or []

    def load_workflow(self, workflow: dict, name: str = "workflow.json"):
        self.close_dialogs()
        self.b.js(CLEAR_TOASTS_JS)
        time.sleep(0.3)
        self.b.js("app.graph.clear(); true")
        if is_api_format(workflow):
            self.b.js(f"Promise.resolve(app.loadApiJson({json.dumps(workflow)}, {json.dumps(name)})).then(() => true)")
        else:
            self.b.js(f"Promise.resolve(app.loadGraphData({json.dumps(workflow)}, true, true, "
                      f"{json.dumps(name)})).then(() => true)")
        time.sleep(1.0)

    def queue_current(self, timeout: float = 120.0) -> dict:
        """Queue the loaded graph the way the Run button does; returns the /history entry."""
        before = set(self._get("/history"))
        self.b.js("app.queuePrompt(0, 1).then(() => true)")
        return self._wait_new_entry(before, timeout, "the queued workflow did not finish in time")

    def _wait_new_entry(self, before: set, timeout: float, why: str) -> dict:
        """The first /history entry not in ``before`` once it has finished (success or error)."""
        t0 = time.time()
        while time.time() - t0 < timeout:
            new = [k for k in self._get("/history") if k not in before]
            if new:
                entry = self._get(f"/history/{new[0]}")[new[0]]
                if entry.get("status", {}).get("status_str") in ("success", "error"):
                    return entry
            time.sleep(0.3)
        raise BrowserError(why)

    def click_run(self, timeout: float = 120.0) -> dict:
        """Press the toolbar's Run button (the element a user clicks); returns the /history entry."""
        before = set(self._get("/history"))
        clicked = self.b.js("""(() => {
            const bs = Array.from(document.querySelectorAll('button, [role=button]'));
            const b = bs.find(e => e.getAttribute('data-testid') === 'queue-button')
                   || bs.find(e => (e.innerText || '').trim() === 'Run' && e.offsetParent !== null);
            if (!b) return null;
            b.click(); return b.outerHTML.slice(0, 200); })()""")
        if not clicked:
            raise BrowserError("no Run button found in the page")
        return self._wait_new_entry(before, timeout, "the workflow started with the Run button did not finish in time")

    def _get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.loads(r.read())

    def check_workflow(self, workflow: dict, name: str, screenshot_path, expected_types=()) -> dict:
        """Load one workflow; report nodes, missing/broken ones, dialogs shown, and save a screenshot."""
        n_console = len(self.b.events)
        self.load_workflow(workflow, name)
        nodes = self.b.js(GRAPH_REPORT_JS)
        dialogs = self.b.js(DIALOGS_JS) or []
        toasts = self.toasts()
        try:
            self.b.js("app.graphToPrompt().then(p => Object.keys(p.output).length)")
            converts = True
        except BrowserError as exc:
            converts = str(exc)
        self.b.js(FIT_JS)
        time.sleep(0.7)
        self.b.js(CLEAR_TOASTS_JS)  # the toasts are in the report; keep them off the screenshot
        time.sleep(0.3)
        shot = self.b.screenshot(screenshot_path)
        self.close_dialogs()
        errors = console_errors(self.b.events[n_console:])
        return {
            "name": name,
            "nodes": nodes,
            "missing": sorted({n["type"] for n in nodes if not n["registered"]}),
            "with_errors": [f'{n["id"]}:{n["type"]}' for n in nodes if n["has_errors"]],
            "bad_widgets": {f'{n["id"]}:{n["type"]}': n["bad_widgets"] for n in nodes if n.get("bad_widgets")},
            "expected_missing": sorted(set(expected_types) - {n["type"] for n in nodes}),
            "dialogs": [d for d in dialogs if d],
            "missing_dialog": any("missing" in d.lower() or "unsupported nodes" in d.lower() for d in dialogs),
            "toasts": toasts,
            "problem_toasts": [t for t in toasts if t["severity"] in ("warn", "error")],
            "converts": converts,
            "console_errors": errors,
            "screenshot": str(shot),
        }


def workflow_node_types(workflow: dict) -> set[str]:
    if is_api_format(workflow):
        return {v["class_type"] for v in workflow.values()}
    types = {n.get("type") for n in workflow.get("nodes", [])}
    for sg in (workflow.get("definitions") or {}).get("subgraphs", []):
        types |= {n.get("type") for n in sg.get("nodes", [])}
    return {t for t in types if t}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8188")
    p.add_argument("--out", default="test-output/ui")
    p.add_argument("--expect-node", action="append", default=[])
    p.add_argument("workflows", nargs="*")
    a = p.parse_args(argv)
    ok = True
    with Browser() as b:
        fe = ComfyFrontend(b, a.url)
        print(f"frontend ready in {fe.open():.1f} s")
        for t, present in fe.registered(a.expect_node).items():
            print(f"{t}: {'registered' if present else 'MISSING'}")
            ok &= present
        for wf in a.workflows:
            data = json.loads(Path(wf).read_text())
            rep = fe.check_workflow(data, Path(wf).name, Path(a.out) / (Path(wf).stem + ".png"))
            good = not (rep["missing"] or rep["with_errors"] or rep["missing_dialog"] or rep["problem_toasts"]
                        or rep["bad_widgets"])
            ok &= good
            print(json.dumps({k: v for k, v in rep.items() if k != "nodes"}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
