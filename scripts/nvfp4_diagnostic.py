#!/usr/bin/env python3
"""Pre-flight diagnostic for the SeedVR2-Blackwell node pack: run it before ComfyUI to learn whether this machine
gets the fast paths (FP4/FP8 GEMMs, pinned copies that overlap compute, attention backends) and what BlockSwap
would cost. Every check is measured here, not assumed from the GPU's name.

    python scripts/nvfp4_diagnostic.py                 # human report
    python scripts/nvfp4_diagnostic.py --quick         # under 10 s
    python scripts/nvfp4_diagnostic.py --json          # JSON on stdout
    python scripts/nvfp4_diagnostic.py --json out.json # JSON to a file, human report on stdout

Exit code: 0 when nothing FAILed, 1 when a check FAILed, 2 for a usage error.
Works from the pack folder inside ComfyUI (ComfyUI/custom_nodes/<pack>/scripts/) and from a plain checkout.
"""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", nargs="?", const="-", metavar="PATH",
                    help="write the JSON report to PATH (or to stdout when PATH is omitted or '-')")
    ap.add_argument("--quick", action="store_true", help="smaller buffers and fewer repetitions (< 10 s on a GPU)")
    ap.add_argument("--device", default=None, help="torch device to check (default: cuda if available, else cpu)")
    ap.add_argument("--fault", action="append", default=[], metavar="NAME",
                    help="force a fault (testing): nvfp4_wrong, pin_fail; also SEEDVR2BW_DIAG_FAULT=a|b")
    ap.add_argument("--brief", action="store_true", help="details only for WARN and FAIL lines")
    args = ap.parse_args(argv)

    import _pack  # noqa: F401 - registers the pack as `seedvr2bw`
    from seedvr2bw.optimization.diagnostics import parse_faults, render_json, render_text, run_diagnostics

    try:
        faults = parse_faults(None, args.fault)
    except ValueError as exc:
        ap.error(str(exc))
    progress = None
    if sys.stderr.isatty() and args.json != "-":
        def progress(r):
            print(f"  {r.status:<4}  {r.name}", file=sys.stderr, flush=True)
    report = run_diagnostics(device=args.device, quick=args.quick, faults=faults, progress=progress)
    if args.json == "-":
        sys.stdout.write(render_json(report) + "\n")
    else:
        sys.stdout.write(render_text(report, verbose=not args.brief))
        if args.json:
            with open(args.json, "w", encoding="utf-8") as fh:
                fh.write(render_json(report) + "\n")
            print(f"JSON report written to {args.json}")
    sys.stdout.flush()
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
