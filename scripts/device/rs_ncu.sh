#!/usr/bin/env bash
# Nsight Compute on one RS W4A16 launch (the last of rs_ncu.py's calls): summary sections and, per SASS
# instruction, the warp-state samples. Writes $OUT/<tag>.ncu-rep, <tag>_details.txt, <tag>_source.csv and prints
# the summary plus the 40 most-sampled instructions.
#   bash scripts/device/rs_ncu.sh TAG [rs_ncu.py args...]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-./out}; mkdir -p "$OUT"
tag=$1; shift
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
"$NCU" --clock-control none -k regex:w4a16_rs --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SourceCounters \
    --section InstructionStats --section MemoryWorkloadAnalysis \
    -f -o "$OUT/$tag" python3 scripts/device/rs_ncu.py "$@" > "$OUT/${tag}_run.txt" 2>&1 || { tail -20 "$OUT/${tag}_run.txt"; exit 1; }
"$NCU" --import "$OUT/$tag.ncu-rep" --page details > "$OUT/${tag}_details.txt" 2>&1
"$NCU" --import "$OUT/$tag.ncu-rep" --page source --csv --print-source sass > "$OUT/${tag}_source.csv" 2>&1
grep -E "Duration|Throughput|Pipe|Issue|Warp Cycles|Stall|Eligible|Active Warps|Executed Ipc|No Eligible|L1/TEX Hit|L2 Hit|Registers" "$OUT/${tag}_details.txt" | head -60
python3 - "$OUT/${tag}_source.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
hdr_i = next(i for i, r in enumerate(rows) if any("Source" == c for c in r))
hdr, body = rows[hdr_i], rows[hdr_i + 1:]
samp = [i for i, c in enumerate(hdr) if "Sampling" in c and "All" in c]
if not samp:
    print("columns:", hdr); sys.exit()
si = samp[0]
src = hdr.index("Source")
stall_cols = [i for i, c in enumerate(hdr) if c.startswith("stall_") or "Stall" in c]
def val(r, i):
    try: return float(r[i].replace(",", ""))
    except Exception: return 0.0
tot = sum(val(r, si) for r in body)
print(f"total samples {tot:.0f}; columns with stalls: {[hdr[i] for i in stall_cols][:30]}")
for r in sorted(body, key=lambda r: -val(r, si))[:40]:
    reasons = sorted(((val(r, i), hdr[i]) for i in stall_cols), reverse=True)[:3]
    print(f"{val(r, si) / tot * 100:5.1f}% {r[src][:70]:70s} " + " ".join(f"{n}={v:.0f}" for v, n in reasons if v))
PY
