"""Start and stop a real ComfyUI server for tests, and talk to it over HTTP (and, optionally, its websocket).

The pack is not copied into ComfyUI: a temporary folder holds a symlink to the checkout under an unusual
folder name (``ComfyUI-SeedVR2 Blackwell test``: spaces, capitals, a dash), and an
``extra_model_paths`` yaml names that folder as a ``custom_nodes`` path, the way a user's second
custom-nodes folder works. That proves the pack loads whatever its folder is called.

    srv = ComfyServer(comfy_dir, custom_node_dirs=[make_pack_folder(repo, tmp)], workdir=tmp / "srv")
    srv.start()
    entry = srv.run_prompt({...})        # POST /prompt, then poll /history until done
    srv.stop()

Everything listens on 127.0.0.1 on a free port; output, input, temp and user folders live in ``workdir``;
the database is in memory; API nodes are off. Only the process started here is ever stopped.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

PACK_FOLDER_NAME = "ComfyUI-SeedVR2 Blackwell test"
MODEL_KINDS = ("diffusion_models", "text_encoders", "vae", "loras", "SEEDVR2")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_pack_folder(pack_root, parent, name: str = PACK_FOLDER_NAME) -> Path:
    """Create ``parent/<name>`` as a symlink to ``pack_root``; returns ``parent`` (a custom_nodes folder)."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    link = parent / name
    if not link.exists():
        link.symlink_to(Path(pack_root).resolve(), target_is_directory=True)
    return parent


class ServerError(RuntimeError):
    pass


class ComfyServer:
    def __init__(self, comfy_dir, custom_node_dirs=(), workdir=None, *, python: str | None = None,
                 port: int | None = None, extra_args=(), env: dict | None = None):
        self.comfy_dir = Path(comfy_dir).resolve()
        self.custom_node_dirs = [Path(d) for d in custom_node_dirs]
        self.workdir = Path(workdir) if workdir else Path(os.environ.get("TMPDIR", "/tmp")) / f"comfy-{uuid.uuid4().hex[:8]}"
        self.python = python or sys.executable
        self.port = port or free_port()
        self.extra_args = list(extra_args)
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.client_id = uuid.uuid4().hex
        self.log_path = self.workdir / "comfyui.log"
        self.output_dir = self.workdir / "output"
        self.input_dir = self.workdir / "input"
        self.models_dir = self.workdir / "models"
        self.start_seconds: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ------------------------------------------------------------------ lifecycle
    def command(self) -> list[str]:
        return [self.python, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(self.port),
                "--disable-auto-launch", "--disable-api-nodes", "--database-url", "sqlite:///:memory:",
                "--extra-model-paths-config", str(self.workdir / "extra_model_paths.yaml"),
                "--output-directory", str(self.output_dir), "--input-directory", str(self.input_dir),
                "--temp-directory", str(self.workdir / "temp"), "--user-directory", str(self.workdir / "user"),
                *self.extra_args]

    def start(self, timeout: float = 180.0) -> "ComfyServer":
        for d in (self.workdir, self.output_dir, self.input_dir, self.workdir / "temp", self.workdir / "user"):
            d.mkdir(parents=True, exist_ok=True)
        # A literal block: one folder a line, spaces in paths need no quoting.
        lines = ["seedvr2bw_tests:", "    custom_nodes: |"]
        lines += [f"        {d.resolve()}" for d in self.custom_node_dirs] or ["        " + str(self.workdir / "none")]
        # Model folders of this server's own, searched first and written into first (a trained LoRA lands in
        # models_dir/loras, never in the ComfyUI tree that other runs share).
        lines += ["seedvr2bw_test_models:", "    is_default: true"]
        for kind in MODEL_KINDS:
            (self.models_dir / kind).mkdir(parents=True, exist_ok=True)
            lines += [f"    {kind}: |", f"        {(self.models_dir / kind).resolve()}"]
        (self.workdir / "extra_model_paths.yaml").write_text("\n".join(lines) + "\n")
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.pop("CUDA_VISIBLE_DEVICES", None)
        t0 = time.time()
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(), cwd=self.comfy_dir, env=env, stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT)
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise ServerError(f"ComfyUI exited with {self.proc.returncode} while starting:\n{self.log_tail()}")
            try:
                self.get_json("/system_stats", timeout=2)
                self.start_seconds = time.time() - t0
                return self
            except (OSError, ServerError):
                time.sleep(0.25)
        self.stop()
        raise ServerError(f"ComfyUI did not answer within {timeout:.0f} s:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # ComfyUI's own Ctrl-C path
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()
        return self.proc.returncode

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, chars: int = 6000) -> str:
        return self.log_text()[-chars:]

    # ------------------------------------------------------------------ HTTP
    def request(self, method: str, path: str, body=None, timeout: float = 30.0):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
                return r.status, (json.loads(raw) if raw and r.headers.get_content_type() == "application/json" else raw)
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                payload = json.loads(raw)
            except ValueError:
                payload = raw
            return e.code, payload

    def get_json(self, path: str, timeout: float = 30.0):
        status, payload = self.request("GET", path, timeout=timeout)
        if status != 200:
            raise ServerError(f"GET {path} -> {status}: {str(payload)[:500]}")
        return payload

    def object_info(self, node_id: str | None = None) -> dict:
        info = self.get_json("/object_info" + (f"/{urllib.parse.quote(node_id)}" if node_id else ""))
        return info

    def queue_prompt(self, prompt: dict, extra_data: dict | None = None) -> str:
        body = {"prompt": prompt, "client_id": self.client_id}
        if extra_data:
            body["extra_data"] = extra_data
        status, payload = self.request("POST", "/prompt", body)
        if status != 200:
            raise ServerError(f"POST /prompt -> {status}: {json.dumps(payload)[:2000]}")
        return payload["prompt_id"]

    def history(self, prompt_id: str) -> dict | None:
        return self.get_json(f"/history/{prompt_id}").get(prompt_id)

    def wait(self, prompt_id: str, timeout: float = 120.0) -> dict:
        t0 = time.time()
        while time.time() - t0 < timeout:
            entry = self.history(prompt_id)
            if entry and entry.get("status", {}).get("completed") is not None and \
                    entry["status"].get("status_str") in ("success", "error"):
                return entry
            if not self.alive():
                raise ServerError(f"ComfyUI died while running {prompt_id}:\n{self.log_tail()}")
            time.sleep(0.2)
        raise ServerError(f"prompt {prompt_id} not done after {timeout:.0f} s:\n{self.log_tail()}")

    def run_prompt(self, prompt: dict, timeout: float = 120.0) -> dict:
        return self.wait(self.queue_prompt(prompt), timeout)

    def interrupt(self, prompt_id: str | None = None):
        return self.request("POST", "/interrupt", {"prompt_id": prompt_id} if prompt_id else {})

    def queue(self) -> dict:
        return self.get_json("/queue")

    def running_prompt_ids(self) -> list[str]:
        return [item[1] for item in self.queue().get("queue_running", [])]

    def wait_running(self, prompt_id: str, timeout: float = 30.0) -> None:
        t0 = time.time()
        while time.time() - t0 < timeout:
            if prompt_id in self.running_prompt_ids():
                return
            time.sleep(0.05)
        raise ServerError(f"prompt {prompt_id} never started running")

    @staticmethod
    def status_messages(entry: dict) -> list[str]:
        return [m[0] for m in entry.get("status", {}).get("messages", [])]

    # ------------------------------------------------------------------ websocket (optional)
    def websocket(self, timeout: float = 10.0):
        """A websocket-client connection to /ws for this client id (progress, executing, executed, ...).
        Needs the ``websocket-client`` package (requirements-test.txt)."""
        import websocket  # websocket-client
        return websocket.create_connection(f"ws://127.0.0.1:{self.port}/ws?clientId={self.client_id}",
                                           timeout=timeout)
