#!/usr/bin/env bash
# One device call per part, each under the 10-minute limit; results land in $OUT (the device tool brings
# them back). Run from the repository root on the GPU machine:
#
#   bash scripts/device/gpu_suite.sh tests      # every GPU test (tests/gpu), no extra carry
#   bash scripts/device/gpu_suite.sh dit        # DiT step time / MFU, fused on vs off, bf16 parity
#   bash scripts/device/gpu_suite.sh blockswap  # BlockSwap acceptance figures
#   bash scripts/device/gpu_suite.sh nvfp4      # NVFP4 paths vs bf16 and comfy-kitchen   (carry .ck)
#   bash scripts/device/gpu_suite.sh rs         # the RS W4A16 kernel: its GPU tests, then fidelity x bf16 at M >= 1024
#   bash scripts/device/gpu_suite.sh flux       # FLUX LoRA s/step vs TrainLoraNode        (carry .comfy_src)
#   bash scripts/device/gpu_suite.sh flux_budgets  # FLUX LoRA, automatic plan at 24-8 GiB vs resident fp8 (.comfy_src)
#   bash scripts/device/gpu_suite.sh diag       # the diagnostic, --quick cold then warm, then the full run
#   bash scripts/device/gpu_suite.sh ab BASE dit|nvfp4|blockswap|vae  # this tree against an older one, same run
#   bash scripts/device/gpu_suite.sh upscale 7b bf16,nvfp4   # the whole upscale at 6-32 GiB budgets vs resident (RUNS=3)
#   bash scripts/device/gpu_suite.sh formats    # 7B DiT step per file format vs bf16 and vs dequantize + bf16
#   bash scripts/device/gpu_suite.sh video      # streaming long video at a 12 GiB budget vs in-memory chunks
#   bash scripts/device/gpu_suite.sh video_gpus # chunk-parallel long video on every GPU of the machine vs one
#   bash scripts/device/gpu_suite.sh sequence   # one 7B 1080p x 21 upscale sequence parallel on 1, 2, (4) GPUs
#   bash scripts/device/gpu_suite.sh vae        # VAE encode/decode, one pass, with the official conv bands and without: time, peak, conv TFLOP/s vs the matmul peak
#   bash scripts/device/gpu_suite.sh vae_budgets  # VAE one pass vs the tiles and bands the memory plan picks at 8 and 12 GiB (#26's tiled line)
#
# scripts/device/prepare_carry.sh builds .ck and .comfy_src here first. The device copy has no .git, so the
# commit is passed in GIT_COMMIT (the device tool sends the working tree of this commit). The figures these
# targets make, and the exact commands behind each table: docs/PERFORMANCE.md.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-./out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 GIT_COMMIT=${GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
[ -d .ck ] && export PYTHONPATH=$PWD/.ck${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/gpu.txt"

case "${1:-}" in
ab)
    # BASE: the older tree (e.g. `git archive <commit> __init__.py pack_import.py optimization models nodes training
    # scripts | tar -x -C .baseline`, carried as .baseline); rounds alternate the two trees, JSON per run in $OUT
    BASE=${2:?usage: gpu_suite.sh ab BASE_DIR dit|nvfp4|blockswap|vae}
    for round in 1 2; do
        for tree in . "$BASE"; do
            tag=$([ "$tree" = . ] && echo new || echo base)
            case "${3:-dit}" in
            dit) (cd "$tree" && python3 scripts/bench_seedvr2.py --models 7b --cases 720p:21,1080p:1 --no-vae \
                    --linears bf16,nvfp4 --warmup 2 --iters 7 --json "$OUT/dit_${tag}_${round}.json") 2>&1 | tail -12 ;;
            nvfp4) (cd "$tree" && python3 scripts/bench_nvfp4.py --m 16,256,1024,4096 --paths bf16,fidelity,fp8_speed \
                    --inner 8 --rounds 3 --rep-ms 50 --json "$OUT/nvfp4_${tag}_${round}.json") 2>&1 | tail -30 ;;
            # one pass as the pipeline runs it on NDHWC (no conv bands), then the tiles the plan picks at 8 GiB
            vae) (cd "$tree" && python3 scripts/bench_vae.py --resolutions 1280x720,1920x1080 --frames 21 --tiled no \
                    --conv-limits none --budgets 8 --repeats 3 --json "$OUT/vae_${tag}_${round}.json") 2>&1 \
                    | grep -E "^ *(8 GiB: )?(encode|decode) " ;;
            blockswap) (cd "$tree" && python3 scripts/bench_blockswap.py --cases 720p21,1080p1 --swaps 18 --repeats 5 \
                    --sync-cases "" --rss-runs 2 --dtype-cases 720p1 --dtypes nvfp4 \
                    --json "$OUT/blockswap_${tag}_${round}.json") 2>&1 | tail -20 ;;
            esac
        done
    done ;;
upscale)
    # one model and its formats per call (each call stays under 10 min); JSON per call in $OUT
    python3 scripts/bench_upscale.py --commit "$GIT_COMMIT" --models "${2:-7b}" --linears "${3:-bf16,nvfp4}" \
        --cases "${4:-720p:21,1080p:1,1080p:21}" --budgets "${5:-32,16,12,8,6}" --runs "${RUNS:-3}" \
        --json "$OUT/upscale_${2:-7b}.json" 2>&1 | tee "$OUT/upscale_${2:-7b}.log" | grep -v "phases\|retries\|peak GiB" ;;
video)
    python3 scripts/bench_video.py --model 7b --linears bf16 --frames 1440 --budget 12 --inmem-chunks 24 --json "$OUT/video_bf16.json" 2>&1 \
        | tail -25
    python3 scripts/bench_video.py --model 7b --linears nvfp4 --frames 1440 --budget 12 --inmem-chunks 24 --json "$OUT/video_nvfp4.json" 2>&1 \
        | tail -25 ;;
video_gpus)
    n=$(nvidia-smi -L | wc -l)
    # 756 frames: 44 chunks, whole rounds on 1, 2 and 4 GPUs; per-rank parts under each row (FRAMES: a shorter clip)
    python3 scripts/bench_video.py --model 7b --frames "${FRAMES:-756}" --gpus "$(seq -s, 1 "$n" | sed 's/,3,/,/')" \
        --json "$OUT/video_gpus.json" 2>&1 | tee "$OUT/video_gpus.log" | grep -E "^clip|GPU\(s\)|rank [0-9]:" ;;
formats)
    python3 scripts/bench_formats.py --model 7b --case "${2:-720p:21}" --commit "$GIT_COMMIT" --json "$OUT/formats.json" \
        2>&1 | tee "$OUT/formats.log" | tail -14 ;;
sequence)
    n=$(nvidia-smi -L | wc -l)
    python3 scripts/bench_sequence_parallel.py --model 7b --case "${2:-1080p:21}" --gpus "$( [ "$n" -ge 4 ] && echo 1,2,4 || echo 1,2)" \
        --commit "$GIT_COMMIT" --json "$OUT/sequence.json" 2>&1 | tee "$OUT/sequence.log" | tail -8 ;;
vae)
    # the default layout (NDHWC on cuDNN) with the official conv bands and without: time and peak of each
    python3 scripts/bench_vae.py --resolutions 1280x720,1920x1080 --frames 1,21 --tiled no --repeats 3 \
        --conv-limits official,none --json "$OUT/vae.json" 2>&1 | tee "$OUT/vae.log" | grep -v "^device" ;;
vae_budgets)
    python3 scripts/bench_vae.py --resolutions 1280x720,1920x1080 --frames 21 --tiled no --repeats 3 \
        --conv-limits none --budgets "${2:-8,12}" --json "$OUT/vae_budgets.json" 2>&1 | tee "$OUT/vae_budgets.log" | grep -v "^device" ;;
tests)
    python3 -m pytest tests/gpu -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 ;;
dit)
    python3 -m pytest tests/gpu/test_dit_bf16.py tests/gpu/test_fused_gpu.py -q 2>&1 | tail -5
    python3 scripts/bench_seedvr2.py --commit "$GIT_COMMIT" --models 7b,3b --cases 720p:21,1080p:1,720p:1,1080p:21 \
        --fused both --fused-ops --warmup 2 --iters 5 --vae-res 720p --vae-iters 2 --json "$OUT/dit.json" 2>&1 | tee "$OUT/dit.log" ;;
blockswap)
    python3 scripts/bench_blockswap.py --commit "$GIT_COMMIT" --repeats 9 --json "$OUT/blockswap.json" 2>&1 | tee "$OUT/blockswap.log" | tail -40 ;;
nvfp4)
    python3 scripts/bench_nvfp4.py --inner 8 --components --json "$OUT/nvfp4.json" 2>&1 | tee "$OUT/nvfp4.log" | tail -60 ;;
rs)
    # the large-M fidelity kernel (Hopper RS W4A16): its GPU tests, then the fidelity path (RS where the layer picks
    # it) against bf16 and against dequantize + cuBLAS forced, in the same run
    python3 -m pytest tests/gpu/test_nvfp4_rs_gpu.py -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/rs_tests.log" | tail -5
    python3 scripts/bench_nvfp4.py --m 1024,2048,4096,16384 --paths bf16,fidelity,fid_dequant --inner 8 --rounds 5 \
        --rep-ms 50 --json "$OUT/rs.json" 2>&1 | tee "$OUT/rs.log" | tail -40 ;;
flux)
    python3 scripts/bench_flux_lora.py --comfy .comfy_src --res 512,1024 --modes bf16,fp8,nvfp4,trainloranode \
        --json "$OUT/flux.json" 2>&1 | tee "$OUT/flux.log" | tail -30 ;;
flux_budgets)
    python3 scripts/bench_flux_lora.py --comfy .comfy_src --res 1024 --modes fp8 --budgets 24,16,12,8 --warmup 2 \
        --steps 5 --json "$OUT/flux_budgets.json" 2>&1 | tee "$OUT/flux_budgets.log" | grep -v "^\[bench\] {" | tail -20 ;;
diag)
    # "cold" = the first run after installing: Python bytecode cached (pip writes .pyc at install; this image sets
    # PYTHONDONTWRITEBYTECODE and its torch ships without .pyc, so an import-only run writes them under a prefix
    # first), Triton's kernel cache empty, no earlier CUDA work in any process. "warm" = the run after it.
    # Files kept to 6: the device tool returns at most 8.
    unset PYTHONDONTWRITEBYTECODE
    export PYTHONPYCACHEPREFIX=/tmp/pyc TRITON_CACHE_DIR=/tmp/triton_cold_$$
    python3 -c 'import torch, triton, safetensors, numpy, torch.nn.attention.varlen' >/dev/null 2>&1 || true
    # right after `pip install` the CUDA libraries just written are in the page cache; on a freshly booted machine
    # they are not (measured separately: the first device call of a session)
    if [ "${DIAG_PAGE_CACHE:-warm}" = warm ]; then
        sp=$(python3 -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))')
        find "$sp/torch/lib" "$sp/nvidia" "$sp/triton" -name '*.so*' -type f -exec cat {} + > /dev/null 2>&1 || true
    fi
    python3 -m compileall -q -x '/(tests|[.]ck|[.]comfy_src|[.]comfyui)/' . >/dev/null 2>&1 || true
    rm -rf "$TRITON_CACHE_DIR"
    for run in cold warm; do
        /usr/bin/time -f "%e" -o /tmp/wall_$run python3 scripts/nvfp4_diagnostic.py --quick --brief \
            --json "$OUT/diag_quick_$run.json" > /tmp/diag_quick_$run.txt 2>&1
    done
    # SM clock and power while each of the two runs (a GEMM's time follows the clock the GPU holds under load)
    clocks() { nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits -lms 100 > "/tmp/clk_$1.csv" 2>/dev/null & echo $!; }
    pid=$(clocks diag)
    python3 scripts/nvfp4_diagnostic.py --json "$OUT/diagnostic_h100.json" > "$OUT/diagnostic_h100.txt" 2>&1
    kill "$pid" 2>/dev/null
    # the same GEMMs through the benchmark, right after: the diagnostic's figures must agree within 10 %
    pid=$(clocks bench)
    python3 scripts/bench_nvfp4.py --m 4096 --shapes 3072x12288 --paths bf16,fidelity,fp8_speed --inner 4 \
        --json /tmp/bench_diag_shape.json > /dev/null 2>&1
    kill "$pid" 2>/dev/null
    for ph in diag bench; do
        python3 - "$ph" "/tmp/clk_$ph.csv" <<'PY' 2>&1 | tee -a "$OUT/diag_vs_bench.txt" || true
import statistics, sys
rows = [[float(v) for v in l.split(",")] for l in open(sys.argv[2]) if l.strip() and "N/A" not in l]
busy = [r for r in rows if r[1] > 200]   # samples under load
print(f"clocks during {sys.argv[1]}: {len(rows)} samples, {len(busy)} above 200 W; under load median SM "
      f"{statistics.median(r[0] for r in busy) if busy else float('nan'):.0f} MHz, min "
      f"{min((r[0] for r in busy), default=float('nan')):.0f} MHz, median "
      f"{statistics.median(r[1] for r in busy) if busy else float('nan'):.0f} W")
PY
    done
    # the agreement check: the diagnostic's GEMM figures against bench_nvfp4.py's on the same shape (within 10 %)
    python3 - "$OUT/diagnostic_h100.json" /tmp/bench_diag_shape.json <<'PY' 2>&1 | tee -a "$OUT/diag_vs_bench.txt" || true
import json, sys
diag = {c["name"]: c.get("data") or {} for c in json.load(open(sys.argv[1]))["checks"]}
bench = json.load(open(sys.argv[2]))["results"]
worst = 0.0
print("| figure | diagnostic ms | bench_nvfp4 ms | difference |\n|---|---|---|---|")
for check, path in (("bf16 GEMM", "bf16"), ("NVFP4 FP8 speed path (W8A8)", "fp8_speed"),
                    ("NVFP4 fidelity path (W4A16)", "fidelity")):
    d, mkn = diag.get(check, {}).get("ms"), diag.get(check, {}).get("shape_mkn")
    row = next((r for r in bench if mkn and [r["M"], r["K"], r["N"]] == list(mkn)), None)
    b = row.get(f"{path}_ms") if row else None
    if d is None or b is None:
        print(f"| {path} | {d} | {b} | n/a |")
        continue
    worst = max(worst, abs(d / b - 1))
    print(f"| {path} {mkn[0]}x{mkn[1]}x{mkn[2]} | {d:.4f} | {b:.4f} | {(d / b - 1) * 100:+.1f} % |")
print(f"largest difference: {worst * 100:.1f} % ({'within' if worst <= 0.10 else 'OUTSIDE'} 10 %)")
PY
    tail -12 "$OUT/diagnostic_h100.txt"
    grep -E "^  (PASS|WARN|FAIL)" /tmp/diag_quick_cold.txt | head -30
    python3 - "$OUT/diag_quick_cold.json" <<'PY' 2>&1 | tee -a "$OUT/diag_vs_bench.txt" || true
import json, sys
checks = sorted(json.load(open(sys.argv[1]))["checks"], key=lambda c: -c.get("elapsed_s", 0))[:6]
print("quick cold, slowest checks:", ", ".join(f"{c['name']} {c.get('elapsed_s', 0):.2f} s" for c in checks))
PY
    for run in cold warm; do
        echo "quick $run: wall $(cat /tmp/wall_$run) s, internal $(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['elapsed_s'])" "$OUT/diag_quick_$run.json") s"
    done ;;
*)
    echo "usage: $0 tests|dit|blockswap|nvfp4|rs|flux|diag" >&2; exit 2 ;;
esac
