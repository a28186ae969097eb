#!/usr/bin/env bash
# Builds the git-ignored folders that GPU runs carry to the device machine (its image has torch, triton and
# safetensors, nothing else of ours):
#   .ck/          comfy-kitchen unpacked for CPython 3.12 (the baseline "what ComfyUI does today" in
#                 bench_nvfp4.py); its ROCm library is dropped so the folder fits the 64 MiB carry limit
#   .comfy_src/   ComfyUI's source tree (bench_flux_lora.py times ComfyUI's own TrainLoraNode)
# Run from the repository root. Each folder is at most ~41 MiB: carry one of them per device call.
# Both folders (and .whl/, the downloaded wheel) are listed in .gitignore, so git never picks them up and
# the device tool carries them only when asked. This script changes nothing under .git.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

if [ ! -d .ck/comfy_kitchen ]; then
    mkdir -p .whl
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 -d .whl "comfy-kitchen==0.2.40"
    rm -rf .ck && mkdir -p .ck
    python3 -m zipfile -e .whl/comfy_kitchen-0.2.40-*.whl .ck
    find .ck -iname "*hip*.so*" -delete
fi
echo ".ck: $(du -sh .ck | cut -f1)"

if [ ! -d .comfy_src/comfy ]; then
    src=${COMFYUI_DIR:-.comfyui}
    [ -d "$src/comfy" ] || bash tests/rig/setup_comfyui.sh
    mkdir -p .comfy_src
    (cd "$src" && tar cf - --exclude=./models --exclude=./output --exclude=./input --exclude=./temp \
        --exclude=./user --exclude=./custom_nodes --exclude='*.pyc' --exclude=__pycache__ .) | (cd .comfy_src && tar xf -)
fi
echo ".comfy_src: $(du -sh .comfy_src | cut -f1)"
