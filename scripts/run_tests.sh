#!/usr/bin/env bash
# scripts/run_tests.sh - the project's one test command.
#
#   bash scripts/run_tests.sh [extra pytest arguments, e.g. tests/comfyui -k interrupt]
#
# 1. picks the python: $PYTHON, else <repo>/.venv/bin/python if it exists, else python3;
# 2. installs the pack's and the tests' requirements into it when they changed (a stamp remembers);
# 3. sets up the real ComfyUI the tests run against (tests/rig/setup_comfyui.sh: $COMFYUI_DIR, else
#    <repo>/.comfyui; fast when already done), and ComfyUI 0.19.3 where ../shared has it
#    (tests/rig/setup_comfyui_next.sh);
# 4. runs `python -m pytest tests -q -rs` with per-test timeouts.
# With CI=true the real-ComfyUI tests fail instead of skipping when something they need is missing.
# pytest's exit status 5 (no test collected) is turned into a failure.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
say() { printf '[run_tests] %s\n' "$*"; }

if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
elif [ -x "$REPO/.venv/bin/python" ]; then
    PY=$REPO/.venv/bin/python
else
    PY=python3
fi
export PYTHON=$PY
say "python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"

# ------------------------------------------------------------------ requirements (pack + tests)
KEY=$("$PY" - <<'PYEOF'
import hashlib, pathlib, sys
h = hashlib.sha256((sys.executable + sys.prefix).encode())
for f in ("requirements.txt", "requirements-test.txt", "pyproject.toml"):
    p = pathlib.Path(f)
    if p.is_file():
        h.update(p.read_bytes())
print(h.hexdigest()[:16])
PYEOF
)
STAMP="$REPO/test-output/.deps-$KEY"
if [ ! -f "$STAMP" ]; then
    if ! "$PY" -c 'import torch' >/dev/null 2>&1; then
        say "installing torch==2.13.0 (nothing else may choose the torch build)"
        "$PY" -m pip install -q torch==2.13.0 || { say "ERROR: pip install torch failed"; exit 1; }
    fi
    # The pyproject's optional group "test" (the pack is not pip-installed: ComfyUI loads it as a folder).
    EXTRAS=$("$PY" - <<'PYEOF'
import pathlib, tomllib
p = pathlib.Path("pyproject.toml")
if p.is_file():
    data = tomllib.loads(p.read_text())
    print("\n".join(data.get("project", {}).get("optional-dependencies", {}).get("test", [])))
PYEOF
)
    REQ_ARGS=()
    [ -f requirements.txt ] && REQ_ARGS+=(-r requirements.txt)
    [ -f requirements-test.txt ] && REQ_ARGS+=(-r requirements-test.txt)
    mapfile -t EXTRA_REQS <<< "$EXTRAS"
    for r in "${EXTRA_REQS[@]}"; do [ -n "$r" ] && REQ_ARGS+=("$r"); done
    TORCH_PIN=$(mktemp)
    "$PY" -c 'import torch; print("torch==" + torch.__version__)' > "$TORCH_PIN"
    say "installing the pack's and the tests' requirements: ${REQ_ARGS[*]}"
    "$PY" -m pip install -q -c "$TORCH_PIN" "${REQ_ARGS[@]}" || { say "ERROR: pip install failed"; rm -f "$TORCH_PIN"; exit 1; }
    rm -f "$TORCH_PIN"
    mkdir -p "$REPO/test-output"
    rm -f "$REPO"/test-output/.deps-*
    date -u +%FT%TZ > "$STAMP"
else
    say "requirements up to date (stamp $(basename "$STAMP"))"
fi

# ------------------------------------------------------------------ the real ComfyUI
if ! bash "$REPO/tests/rig/setup_comfyui.sh"; then
    say "ERROR: setting up ComfyUI failed (see above)"
    exit 1
fi

# ------------------------------------------------------------------ the second rig: ComfyUI 0.19.3 from ../shared
if ! PYTHON=$PY bash "$REPO/tests/rig/setup_comfyui_next.sh"; then
    say "ERROR: setting up the ComfyUI 0.19.3 rig failed (see above)"
    exit 1
fi

# ------------------------------------------------------------------ tests
mkdir -p "$REPO/test-output"
say "running: $PY -m pytest tests -q -rs --timeout=900 $*"
"$PY" -m pytest tests -q -rs --timeout=900 -o junit_family=xunit2 --junitxml="$REPO/test-output/junit.xml" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    say "ERROR: pytest collected no test (exit status 5): that is a failure here"
    exit 1
fi
[ "$rc" -eq 0 ] && say "all tests passed" || say "pytest exited with $rc"
exit "$rc"
