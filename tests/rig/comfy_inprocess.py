"""A real ComfyUI inside the test process: its node registry, its prompt validation and its
``PromptExecutor`` (caches, model management, progress hook), without the HTTP server.

    comfy = ComfyInProcess(comfy_dir, custom_node_dirs=[folder_holding_the_pack], output_dir=tmp)
    res = comfy.run({"1": {"class_type": "EmptyImage", "inputs": {...}}, ...})
    assert res.success, res.error

ComfyUI keeps its registries in module globals, so there is one ``ComfyInProcess`` per process
(``ComfyInProcess.get``/the session fixture). Two import-order details matter and are handled here:
``comfy.cli_args.args`` must be adjusted (``cpu=True``) before ``comfy.model_management`` is imported,
and ``utils.extra_config`` must be imported before ``nodes`` (``nodes`` puts ``ComfyUI/comfy`` first on
``sys.path``, after which ``import utils`` would find ``comfy/utils.py``; ComfyUI's main.py does the same).
"""
from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import os
import sys
import threading
import time
import uuid

_INSTANCE: "ComfyInProcess | None" = None


def _stand_in_server(why: ImportError):
    """A PromptServer with what the executor and the nodes use (client id, last node, ``send_sync``,
    ``queue_updated``, ``instance``), for a ComfyUI whose HTTP requirements are not installed; installed as the
    ``server`` module so nodes that import it find the same object."""
    import types

    class _Routes:
        def __getattr__(self, name):
            return lambda *a, **k: (lambda f: f)     # route decorators: register nothing

    class PromptServer:
        instance = None

        def __init__(self, loop):
            PromptServer.instance = self
            self.loop, self.client_id, self.last_node_id, self.last_prompt_id = loop, None, None, None
            self.routes, self.supports, self.import_error = _Routes(), set(), str(why)

        def send_sync(self, event, data, sid=None):
            pass

        def queue_updated(self):
            pass

    mod = types.ModuleType("server")
    mod.PromptServer = PromptServer
    sys.modules["server"] = mod
    return PromptServer


@dataclasses.dataclass
class RunResult:
    prompt_id: str
    success: bool
    status: str                      # "success", "execution_error", "execution_interrupted", "invalid"
    error: dict | None
    node_errors: dict
    outputs: dict                    # the "ui" part per output node, as /history shows it
    events: list                     # [(event, data)] sent by the executor, progress included
    seconds: float

    def event_names(self) -> list[str]:
        return [e for e, _ in self.events]


class ComfyInProcess:
    @classmethod
    def get(cls, comfy_dir, **kwargs) -> "ComfyInProcess":
        """The process-wide instance (created on first use)."""
        global _INSTANCE
        if _INSTANCE is None:
            _INSTANCE = cls(comfy_dir, **kwargs)
        elif os.path.abspath(comfy_dir) != _INSTANCE.comfy_dir:
            raise RuntimeError("ComfyUI is already loaded in this process from " + _INSTANCE.comfy_dir)
        return _INSTANCE

    def __init__(self, comfy_dir, custom_node_dirs=(), *, output_dir=None, input_dir=None, temp_dir=None,
                 load_api_nodes: bool = False, cpu: bool = True):
        self.comfy_dir = os.path.abspath(comfy_dir)
        if self.comfy_dir not in sys.path:
            sys.path.insert(0, self.comfy_dir)
        t0 = time.time()

        from comfy.cli_args import args  # ComfyUI parses no argv unless main.py asks it to
        if cpu:
            args.cpu = True
        args.disable_api_nodes = not load_api_nodes
        import utils.extra_config  # noqa: F401  (import order, see the module docstring)
        import folder_paths

        # a ComfyUI source tree without its custom_nodes folder (the GPU carry) must still load the given ones
        nodes_paths = folder_paths.folder_names_and_paths["custom_nodes"][0]
        nodes_paths[:] = [p for p in nodes_paths if os.path.isdir(p)]
        for d in custom_node_dirs:
            folder_paths.add_model_folder_path("custom_nodes", os.path.abspath(d))
        if output_dir:
            folder_paths.set_output_directory(os.path.abspath(output_dir))
        if input_dir:
            folder_paths.set_input_directory(os.path.abspath(input_dir))
        if temp_dir:
            folder_paths.set_temp_directory(os.path.abspath(temp_dir))

        import comfy.model_management
        import comfy.utils
        import execution
        import nodes
        try:
            import server
            if importlib.util.find_spec("comfyui_frontend_package") is None:   # PromptServer exits without it
                raise ImportError("comfyui_frontend_package is not installed")
            server_class = server.PromptServer
        except ImportError as exc:   # the GPU image lacks ComfyUI's HTTP side: nothing here serves HTTP anyway
            server_class = _stand_in_server(exc)

        self.folder_paths = folder_paths
        self.execution = execution
        self.nodes = nodes
        self.model_management = comfy.model_management
        self.loop = asyncio.new_event_loop()
        self._lock = threading.Lock()
        self._events: list = []
        # A real PromptServer object, never started: nodes that use PromptServer.instance keep working.
        # Its send_sync is redirected into a list so that tests can read what a client would receive.
        self.server = server_class(self.loop)
        self.server.send_sync = self._record
        self.import_failures: list[str] = []
        self.loop.run_until_complete(
            nodes.init_extra_nodes(init_custom_nodes=True, init_api_nodes=load_api_nodes))
        self._install_progress_hook()
        self.executor = execution.PromptExecutor(
            self.server, cache_type=execution.CacheType.CLASSIC, cache_args={"lru": 0, "ram": 0})
        self.boot_seconds = time.time() - t0

    # ------------------------------------------------------------------ internals
    def _record(self, event, data, sid=None):
        with self._lock:
            self._events.append((event, data))

    def _install_progress_hook(self):
        """What main.py's hijack_progress does: progress events, and the interruption check that makes
        a node's ProgressBar.update() raise after an interrupt."""
        import comfy.utils
        from comfy_execution.utils import get_executing_context
        from comfy_execution.progress import get_progress_state

        mm = self.model_management
        srv = self.server

        def hook(value, total, preview_image, prompt_id=None, node_id=None):
            ctx = get_executing_context()
            if ctx is not None:
                prompt_id = prompt_id or ctx.prompt_id
                node_id = node_id or ctx.node_id
            mm.throw_exception_if_processing_interrupted()
            prompt_id = prompt_id or srv.last_prompt_id
            node_id = node_id or srv.last_node_id
            get_progress_state().update_progress(node_id, value, total, preview_image)
            srv.send_sync("progress", {"value": value, "max": total, "prompt_id": prompt_id, "node": node_id})

        comfy.utils.set_progress_bar_global_hook(hook)

    # ------------------------------------------------------------------ API
    @property
    def node_classes(self) -> dict:
        return self.nodes.NODE_CLASS_MAPPINGS

    @property
    def loaded_module_dirs(self) -> dict:
        """module name -> folder, for every custom node module that loaded."""
        return dict(self.nodes.LOADED_MODULE_DIRS)

    def validate(self, prompt: dict):
        """(ok, error, output_node_ids, node_errors), exactly as POST /prompt validates."""
        return asyncio.run(self.execution.validate_prompt(str(uuid.uuid4()), prompt, None))

    def run(self, prompt: dict, extra_data: dict | None = None) -> RunResult:
        """Validate, then execute with the real executor. Blocks until the prompt is done."""
        prompt_id = str(uuid.uuid4())
        t0 = time.time()
        ok, error, outputs, node_errors = self.validate(prompt)
        if not ok:
            return RunResult(prompt_id, False, "invalid", error, node_errors, {}, [], time.time() - t0)
        with self._lock:
            self._events = []
        self.server.last_prompt_id = prompt_id
        self.executor.execute(prompt, prompt_id, extra_data or {}, outputs)
        with self._lock:
            events = list(self._events)
        err = next((data for event, data in self.executor.status_messages
                    if event in ("execution_error", "execution_interrupted")), None)
        status = next((event for event, _ in self.executor.status_messages
                       if event in ("execution_error", "execution_interrupted")), "success")
        success = bool(self.executor.success) and err is None
        return RunResult(prompt_id, success, status if not success else "success", err, {},
                         self.executor.history_result.get("outputs", {}), events, time.time() - t0)

    def run_in_thread(self, prompt: dict, extra_data: dict | None = None):
        """Start run() on a thread; returns (thread, box) where box["result"] appears when done."""
        box: dict = {}

        def target():
            try:
                box["result"] = self.run(prompt, extra_data)
            except BaseException as exc:  # noqa: BLE001 - handed to the test
                box["exception"] = exc

        th = threading.Thread(target=target, name="comfy-inprocess-run", daemon=True)
        th.start()
        return th, box

    def events_so_far(self) -> list:
        with self._lock:
            return list(self._events)

    def interrupt(self) -> None:
        """The same as POST /interrupt: the running node's next interruption check raises."""
        self.nodes.interrupt_processing(True)

    def pack_node_ids(self, module_dir: str) -> list[str]:
        """Node ids registered by the custom node module loaded from ``module_dir``."""
        target = os.path.realpath(module_dir)
        names = [n for n, d in self.nodes.LOADED_MODULE_DIRS.items() if os.path.realpath(d) == target]
        ids = []
        for node_id, cls in self.nodes.NODE_CLASS_MAPPINGS.items():
            rel = getattr(cls, "RELATIVE_PYTHON_MODULE", "") or ""
            if any(rel.endswith("." + n) or rel == n for n in names):
                ids.append(node_id)
        return sorted(ids)
