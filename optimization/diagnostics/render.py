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
    try:
        verdict = _verdict(report)
    except Exception:  # noqa: BLE001 - the summary is a convenience; never break the report
        verdict = []
    if verdict:
        lines.append("")
        lines.append("== What this machine gets ==")
        lines.extend(f"  {v}" for v in verdict)
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


def _verdict(report) -> list:
    by = {r.name: r for r in report.results}
    out = []
    pol = by.get("hardware policy")
    if pol is not None and pol.data:
        d = pol.data
        line = f"profile {d.get('profile')}: NVFP4 weights run the {d.get('nvfp4_gemm')} path"
        for r in report.results:
            if r.data.get("path") == d.get("nvfp4_gemm") and r.data.get("speedup_vs_bf16"):
                line += f" ({r.data['speedup_vs_bf16']:.2f}x bf16 on the SeedVR2 shape)"
        line += f"; FP8 GEMM {'on' if d.get('fp8_gemm') else 'off'}; attention {d.get('attention')}"
        out.append(line)
        if d.get("kernel_table"):
            out.append("quantized linears, kernel by rows M (bf16 activations):")
            out.extend("  " + row.strip() for row in d["kernel_table"])
    h2d, ov = by.get("H2D pinned vs pageable"), by.get("copy/compute overlap")
    if h2d is not None and h2d.status != "SKIP" and h2d.data:
        text = f"host->GPU copies: {h2d.data['pinned_gbps']:.1f} GB/s pinned ({h2d.data['ratio']:.1f}x pageable)"
        if ov is not None and ov.data.get("hidden_fraction") is not None:
            text += f", {ov.data['hidden_fraction'] * 100:.0f}% hidden behind compute"
        out.append(text)
    for key in ("SeedVR2-3B swap vs compute", "SeedVR2-7B swap vs compute"):
        r = by.get(key)
        if r is not None and r.status != "SKIP" and r.data.get("blockswap_plan"):
            p = r.data["blockswap_plan"].get("bf16", {})
            out.append(f"{key.split()[0]}: bf16 {'fits, no BlockSwap' if not p.get('blocks_to_swap') else str(p['blocks_to_swap']) + ' blocks swapped'}"
                       f"; {r.status}")
    fails = [r.name for r in report.results if r.status == "FAIL"]
    if fails:
        out.append("FIX FIRST: " + ", ".join(fails))
    return out
