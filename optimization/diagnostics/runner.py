"""Runs the checks in order, each guarded (a crashing check becomes a FAIL with its exception), and collects the
report. GPU checks SKIP themselves on a machine without CUDA."""
from __future__ import annotations

import datetime as _dt
import platform
import time
from dataclasses import dataclass, field

import torch

from . import checks_compute, checks_io, checks_nvfp4, checks_system, checks_transfer
from .result import FAIL, PASS, SKIP, STATUSES, WARN, CheckResult, DiagContext, parse_faults

SCHEMA = "seedvr2bw.diagnostic/1"

# (section, check functions); the order matters: later checks reuse earlier measurements (ctx.measured)
SECTIONS = (
    (checks_system.SECTION, checks_system.CHECKS),
    (checks_transfer.SECTION, checks_transfer.CHECKS),
    (checks_compute.SECTION, checks_compute.CHECKS),
    (checks_nvfp4.SECTION, checks_nvfp4.CHECKS),
    (checks_io.SECTION, checks_io.CHECKS),
    ("Packages", checks_system.PACKAGE_CHECKS),
)


GPU_SECTIONS = (checks_transfer.SECTION, checks_compute.SECTION, checks_nvfp4.SECTION, checks_io.SECTION)


@dataclass
class Report:
    results: list
    device: str
    quick: bool
    faults: list
    elapsed_s: float
    created_utc: str
    meta: dict = field(default_factory=dict)

    def counts(self) -> dict:
        c = {s: 0 for s in STATUSES}
        for r in self.results:
            c[r.status] += 1
        return c

    @property
    def exit_code(self) -> int:
        return 1 if any(r.status == FAIL for r in self.results) else 0

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "created_utc": self.created_utc, "device": self.device, "quick": self.quick,
                "faults": list(self.faults), "elapsed_s": round(self.elapsed_s, 3), "counts": self.counts(),
                "exit_code": self.exit_code, "meta": self.meta, "checks": [r.to_dict() for r in self.results]}


def _pack_version() -> str:
    try:
        from ... import __version__
        return __version__
    except Exception:  # noqa: BLE001
        return "unknown"


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def run_check(fn, ctx, section: str) -> list:
    t0 = time.perf_counter()
    try:
        res = fn(ctx)
    except Exception as exc:  # noqa: BLE001 - a crash is reported, the other checks still run
        msg = str(exc).splitlines()[0] if str(exc) else ""
        res = CheckResult(fn.__name__.removeprefix("check_").replace("_", " "), FAIL, None, "",
                          f"the check crashed: {type(exc).__name__}: {msg}")
    results = res if isinstance(res, list) else [res]
    dt = time.perf_counter() - t0
    for r in results:
        r.section = r.section or section
        r.elapsed_s = round(dt / len(results), 4)
    return results


def run_diagnostics(device=None, quick: bool = False, faults=None, sections=None, progress=None) -> Report:
    """Run every check. ``faults``: names from ``result.KNOWN_FAULTS`` (default: ``SEEDVR2BW_DIAG_FAULT``).
    ``sections``: restrict to these section names. ``progress(result)`` is called after each result."""
    t0 = time.perf_counter()
    dev = torch.device(device) if device is not None else default_device()
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    faults = parse_faults(None, ()) if faults is None else parse_faults("", faults)
    ctx = DiagContext(device=dev, quick=quick, faults=faults)
    results = []
    for section, checks in SECTIONS:
        if sections and section not in sections:
            continue
        for fn in checks:
            if ctx.measured.get("arch_problem") and section in GPU_SECTIONS:
                # every kernel launch would fail with "no kernel image is available": say so once per check
                results.append(CheckResult(fn.__name__.removeprefix("check_").replace("_", " "), SKIP, None, "",
                                           "skipped: this torch build has no kernels for this GPU (see 'torch "
                                           "kernels for this GPU' above for the fix)", section=section))
                if progress:
                    progress(results[-1])
                continue
            for r in run_check(fn, ctx, section):
                results.append(r)
                if progress:
                    progress(r)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    for key in [k for k in ctx.measured if isinstance(k, tuple)]:
        ctx.measured.pop(key)  # free the benchmark buffers
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        host_empty = getattr(torch._C, "_host_emptyCache", None)  # hand the pinned test buffers back to the OS
        if host_empty is not None:
            try:
                host_empty()
            except Exception:  # noqa: BLE001
                pass
    meta = {"pack_version": _pack_version(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "gpu_checks": "run" if dev.type == "cuda" else
            "skipped: no CUDA device"}
    return Report(results=results, device=str(dev), quick=quick, faults=sorted(faults),
                  elapsed_s=time.perf_counter() - t0,
                  created_utc=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), meta=meta)


__all__ = ["Report", "run_diagnostics", "run_check", "SCHEMA", "PASS", "WARN", "FAIL", "SKIP"]
