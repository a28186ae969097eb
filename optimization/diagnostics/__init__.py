"""Pre-flight diagnostic: measures (rather than assumes) whether this machine gets the pack's fast paths.

Each check is a small function ``check_x(ctx) -> CheckResult | list[CheckResult]`` (PASS / WARN / FAIL / SKIP with
the number behind it); ``run_diagnostics`` runs them, ``render_text`` / ``render_json`` print the report. Used by
``scripts/nvfp4_diagnostic.py`` and by the ComfyUI node in ``nodes/diagnostic.py``.

Fault injection (tests): ``SEEDVR2BW_DIAG_FAULT=nvfp4_wrong|pin_fail`` or ``run_diagnostics(faults=[...])``.

JSON report (``--json``), schema ``seedvr2bw.diagnostic/1``::

    {"schema", "created_utc", "device", "quick", "faults": [...], "elapsed_s", "exit_code",
     "counts": {"PASS": n, "WARN": n, "FAIL": n, "SKIP": n}, "meta": {...},
     "checks": [{"section", "name", "status", "value", "unit", "detail", "data": {...}, "elapsed_s"}, ...]}

``value`` is the headline number (or a short string, or null), ``data`` the other numbers behind it. Check names
are stable; ``exit_code`` is 1 when any check FAILed.
"""
from .render import render_json, render_text
from .result import FAIL, FAULT_ENV, KNOWN_FAULTS, PASS, SKIP, STATUSES, WARN, CheckResult, DiagContext, parse_faults
from .runner import SCHEMA, Report, run_diagnostics

__all__ = ["CheckResult", "DiagContext", "Report", "run_diagnostics", "render_text", "render_json", "parse_faults",
           "PASS", "WARN", "FAIL", "SKIP", "STATUSES", "SCHEMA", "FAULT_ENV", "KNOWN_FAULTS"]
