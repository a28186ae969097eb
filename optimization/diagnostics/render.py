"""The human report (plain text, one line per check plus its detail) and the JSON report."""
from __future__ import annotations

import json
import textwrap

from .result import FAIL, SKIP, WARN

WIDTH = 110


def _fmt_value(r) -> str:
    if r.value is None:
        return "-"
    if isinstance(r.value, float):
        a = abs(r.value)
        v = f"{r.value:.2e}" if 0 < a < 0.01 else (f"{r.value:.3g}" if a < 100 else f"{r.value:.0f}")
    else:
        v = str(r.value)
    return f"{v} {r.unit}".strip() if r.unit else v


def render_text(report, verbose: bool = True) -> str:
    lines = [f"SeedVR2-Blackwell pre-flight diagnostic ({'quick' if report.quick else 'full'} run on {report.device}, "
             f"{report.elapsed_s:.1f} s, {report.created_utc})"]
    if report.faults:
        lines.append(f"FORCED FAULTS: {', '.join(report.faults)} (SEEDVR2BW_DIAG_FAULT)")
    if not report.device.startswith("cuda"):
        lines.append("No CUDA device: the GPU checks are SKIPped.")
    section = None
    for r in report.results:
        if r.section != section:
            section = r.section
            lines.append("")
            lines.append(f"== {section} ==")
        lines.append(f"  {r.status:<4}  {r.name:<38} {_fmt_value(r)}")
        if r.detail and (verbose or r.status in (WARN, FAIL)):
            if r.status == SKIP and not verbose:
                continue
            for para in r.detail.splitlines():
                for i, piece in enumerate(textwrap.wrap(para, WIDTH - 10)):
                    lines.append(("        " if i == 0 else "          ") + piece)
    c = report.counts()
    lines.append("")
    lines.append(f"Summary: {c['PASS']} PASS, {c['WARN']} WARN, {c['FAIL']} FAIL, {c['SKIP']} SKIP"
                 f" -> exit code {report.exit_code}")
    fails = [r for r in report.results if r.status == FAIL]
    if fails:
        lines.append("FAILED: " + "; ".join(r.name for r in fails))
    return "\n".join(lines) + "\n"


def render_json(report, indent: int = 1) -> str:
    return json.dumps(report.to_dict(), indent=indent, allow_nan=False)
