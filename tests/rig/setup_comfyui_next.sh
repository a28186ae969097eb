#!/usr/bin/env bash
# tests/rig/setup_comfyui_next.sh - the second test rig: ComfyUI 0.19.3 (2026: comfy-kitchen NVFP4 loading,
# Dynamic VRAM) from ../shared/comfyui_0.19.3/, where that folder exists (a user's fresh clone has none: then
# this says so and exits 0, and the tests that need it skip with that reason).
#
#   bash tests/rig/setup_comfyui_next.sh
#
# The tree goes to <repo>/.comfyui-0.19.3 (gitignored), unpacked as it is. Its requirements go into a venv of
# their own, <repo>/.venv-comfyui-0.19.3, which sees the main test venv's packages (torch and the rest) through a
# .pth file: pip installs there only what 0.19.3 needs on top (frontend 1.42, comfy-aimdo, ...), and the main
# venv keeps ComfyUI 0.3.75's versions. Idempotent: a stamp of the requirements makes a second run ~1 s.
#
# Environment: PYTHON (the main venv's python; default <repo>/.venv/bin/python, else python3),
#              COMFYUI_NEXT_TARBALL (default ../shared/comfyui_0.19.3/comfyui-0.19.3-seedvr2.tar.gz).
set -euo pipefail

say() { printf '[rig-next] %s\n' "$*"; }
die() { printf '[rig-next] ERROR: %s\n' "$*" >&2; exit 1; }

RIG_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$RIG_DIR/../.." && pwd)
TARBALL=${COMFYUI_NEXT_TARBALL:-$REPO/../shared/comfyui_0.19.3/comfyui-0.19.3-seedvr2.tar.gz}
TREE=$REPO/.comfyui-0.19.3
VENV=$REPO/.venv-comfyui-0.19.3

if [ ! -f "$TARBALL" ]; then
    say "no $TARBALL: the ComfyUI 0.19.3 rig is not set up (its tests skip)"
    exit 0
fi
if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
elif [ -x "$REPO/.venv/bin/python" ]; then
    PY=$REPO/.venv/bin/python
else
    PY=python3
fi

# ------------------------------------------------------------------ the tree
if [ ! -f "$TREE/ComfyUI/comfyui_version.py" ]; then
    say "unpacking $(basename "$TARBALL") into $TREE"
    rm -rf "$TREE.tmp"
    mkdir -p "$TREE.tmp"
    tar -xzf "$TARBALL" -C "$TREE.tmp"
    [ -f "$TREE.tmp/ComfyUI/comfyui_version.py" ] || die "$TARBALL holds no ComfyUI/comfyui_version.py"
    rm -rf "$TREE"
    mv "$TREE.tmp" "$TREE"
fi
say "ComfyUI $(sed -n 's/^__version__ = "\(.*\)"/\1/p' "$TREE/ComfyUI/comfyui_version.py") in $TREE/ComfyUI"

# ------------------------------------------------------------------ the venv on top of the main one
MAIN_SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
BASE=$("$PY" -c 'import sys; print(sys.base_prefix)')
if [ ! -x "$VENV/bin/python" ]; then
    say "venv $VENV (from $BASE)"
    "$BASE/bin/python3" -m venv "$VENV"
fi
VSITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$MAIN_SITE" > "$VSITE/seedvr2bw_main_venv.pth"
"$VENV/bin/python" -c 'import torch' || die "torch is not importable through $MAIN_SITE"

REQ=$(mktemp)
# torch, torchvision, torchaudio come from the main venv (the same build the pack's tests use)
grep -v -E '^\s*(#|$|torch|torchvision|torchaudio)' "$TREE/ComfyUI/requirements.txt" > "$REQ"
STAMP="$VENV/.rig-deps-$(cat "$REQ" "$VSITE/seedvr2bw_main_venv.pth" | sha256sum | cut -c1-16)"
if [ ! -f "$STAMP" ]; then
    say "installing ComfyUI 0.19.3's requirements into $VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$REQ" || die "pip install failed"
    rm -f "$VENV"/.rig-deps-*
    touch "$STAMP"
else
    say "requirements up to date ($(basename "$STAMP"))"
fi
rm -f "$REQ"
"$VENV/bin/python" -c 'import comfyui_frontend_package, comfy_kitchen, comfy_aimdo' || die "0.19.3's packages missing"
say "done: $VENV/bin/python"
