"""Issue 7's agreement check: the diagnostic's GEMM figures against bench_nvfp4.py's on the same shape, same run.

    python scripts/device/diag_vs_bench.py DIAG.json BENCH.json
"""
import json
import sys

ROWS = (("bf16 GEMM", "bf16", "bf16 GEMM"), ("NVFP4 FP8 speed path (W8A8)", "fp8_speed", "NVFP4 FP8 speed path"),
        ("NVFP4 fidelity path (W4A16)", "fidelity", "NVFP4 fidelity path"))


def main(diag_path, bench_path):
    diag = {c["name"]: c.get("data") or {} for c in json.load(open(diag_path))["checks"]}
    bench = json.load(open(bench_path))
    worst = 0.0
    print("| figure | diagnostic ms | bench_nvfp4 ms | difference |")
    print("|---|---|---|---|")
    for name, path, label in ROWS:
        d = diag.get(name, {}).get("ms")
        mkn = diag.get(name, {}).get("shape_mkn")
        row = next((r for r in bench["results"] if mkn and [r["M"], r["K"], r["N"]] == list(mkn)), None)
        b = row.get(f"{path}_ms") if row else None
        if d is None or b is None:
            print(f"| {label} | {d} | {b} | n/a |")
            continue
        diff = d / b - 1
        worst = max(worst, abs(diff))
        print(f"| {label} {mkn[0]}x{mkn[1]}x{mkn[2]} | {d:.4f} | {b:.4f} | {diff * 100:+.1f} % |")
    print(f"largest difference: {worst * 100:.1f} % ({'within' if worst <= 0.10 else 'OUTSIDE'} 10 %)")
    return 0 if worst <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
