#!/usr/bin/env bash
# Build kfeed on a fresh machine with a copy of this repo and run
# bench/gpu_check.py (host-to-device bandwidth and data stall; no broker).
#
#   bash bench/gpu_check.sh [gpu_check.py arguments...]
#
# Two ways to get a Python with kfeed built, chosen automatically:
# - system: $PYTHON (default python3) already imports torch, numpy, Cython>=3
#   and setuptools (a GPU image; such a machine may have no network at all).
#   kfeed's Cython extensions are built out of tree into .kfeed/gpu-build/lib
#   beside a copy of src/kfeed (much as `make fuzz-debug` does) and used
#   through PYTHONPATH; nothing is downloaded or installed.
# - venv: otherwise, `$PYTHON -m venv .kfeed/venv-gpu` and `pip install -e .`
#   into it. That downloads torch from PyPI with its CUDA libraries, several
#   GB: expect minutes.
# KFEED_GPU_MODE=system|venv forces one. The venv lives under .kfeed/ (ignored
# by git) so it never shows up as an untracked file.
#
# If $OUT is set, the results go to $OUT/gpu_check.json and the log to
# $OUT/gpu_check.log. The check itself is stopped after
# KFEED_GPU_CHECK_TIMEOUT seconds (default 300). Every step prints its time;
# the first failing step ends the script with its exit status.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
case "$PYTHON" in  # absolute, since the build runs in another directory
    */*) PYTHON="$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")" ;;
    *) PYTHON=$(command -v "$PYTHON") || { echo "no $PYTHON on PATH" >&2; exit 2; } ;;
esac
MODE=${KFEED_GPU_MODE:-auto}
VENV=${KFEED_GPU_VENV:-.kfeed/venv-gpu}
BUILD=.kfeed/gpu-build
CHECK_TIMEOUT=${KFEED_GPU_CHECK_TIMEOUT:-300}
export PYTHONUNBUFFERED=1

T_ALL=$(date +%s.%N)
since() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

# step NAME COMMAND...: run it, print how long it took, stop the script if it fails.
step() {
    local name=$1 t rc=0
    shift
    echo "== $name"
    t=$(date +%s.%N)
    "$@" || rc=$?
    if [ "$rc" -ne 0 ]; then
        echo "== FAILED: $name (exit $rc) after $(since "$t") s; total $(since "$T_ALL") s" >&2
        exit "$rc"
    fi
    echo "== $name: $(since "$t") s"
}

has_build_deps() {
    "$1" - <<'EOF' 2>/dev/null
import sys
import Cython, numpy, setuptools, torch  # noqa: F401
sys.exit(0 if int(Cython.__version__.split(".")[0]) >= 3 else 1)
EOF
}

describe() {
    "$PYTHON" --version
    command -v nvidia-smi >/dev/null && nvidia-smi -L || echo "(no nvidia-smi)"
}

# A copy of src/kfeed with the extensions built beside it, from a copy of
# setup.py and ext/: no pyproject.toml in sight, so any setuptools will do, and
# nothing is written into the checkout.
build_system() {
    rm -rf "$BUILD"
    mkdir -p "$BUILD/src" "$BUILD/lib"
    cp setup.py "$BUILD/src/"
    cp -r ext "$BUILD/src/"
    rm -f "$BUILD"/src/ext/*.c "$BUILD"/src/ext/*.cpp
    cp -r src/kfeed "$BUILD/lib/"
    find "$BUILD/lib" -name __pycache__ -prune -exec rm -rf {} +
    rm -f "$BUILD"/lib/kfeed/*.so
    (cd "$BUILD/src" && "$PYTHON" setup.py -q build_ext -j "$(nproc)" --build-lib ../lib \
        --build-temp ../tmp)
}

make_venv() {
    test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
}

pip_install() {
    "$VENV/bin/python" -m pip install --disable-pip-version-check -q -e .
}

check_import() {
    "$RUN_PY" -c 'import kfeed, kfeed._codec, torch; print("kfeed from", kfeed.__file__, "| torch", torch.__version__, "| CUDA available:", torch.cuda.is_available())'
}

step "python and GPU" describe
if [ "$MODE" = auto ]; then
    if has_build_deps "$PYTHON"; then MODE=system; else MODE=venv; fi
fi
echo "== mode: $MODE"
case "$MODE" in
    system)
        step "build kfeed's extensions into $BUILD (no install, no download)" build_system
        export PYTHONPATH="$PWD/$BUILD/lib${PYTHONPATH:+:$PYTHONPATH}"
        RUN_PY=$PYTHON
        ;;
    venv)
        step "create venv $VENV" make_venv
        step "pip install -e . (torch from PyPI may take minutes)" pip_install
        RUN_PY=$VENV/bin/python
        ;;
    *)
        echo "KFEED_GPU_MODE must be system or venv, got '$MODE'" >&2
        exit 2
        ;;
esac
step "import kfeed" check_import

ARGS=("$@")
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    ARGS+=(--json "$OUT/gpu_check.json")
    step "gpu_check.py (limit ${CHECK_TIMEOUT} s)" \
        bash -o pipefail -c 'timeout "$0" "$1" bench/gpu_check.py "${@:3}" 2>&1 | tee "$2"' \
        "$CHECK_TIMEOUT" "$RUN_PY" "$OUT/gpu_check.log" "${ARGS[@]}"
else
    step "gpu_check.py (limit ${CHECK_TIMEOUT} s)" \
        timeout "$CHECK_TIMEOUT" "$RUN_PY" bench/gpu_check.py "${ARGS[@]}"
fi
echo "== total: $(since "$T_ALL") s"
