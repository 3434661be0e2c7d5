#!/usr/bin/env bash
# edgellm GPU check, for a fresh machine with one CUDA GPU and no network.
#
#   scripts/gpu_check.sh [--only kernels|models|bench] [--all-types]
#       runs scripts/checks/gpu_check.py (every CUDA kernel vs NumPy, whole-model GPU vs CPU logits, bench);
#       prints PASS/FAIL per check; exit status 0 only when every check passed.
#   scripts/gpu_check.sh --prepare
#       run where there IS network: downloads into .whl/ the wheels the GPU machine may lack (gguf,
#       and regex + PyYAML for several Python versions). .whl/ is git-ignored: send it along.
#
# The GPU machine is expected to have python3 with numpy, numba, cupy, psutil, jinja2. The package is
# not installed there: a folder of symlinks maps edgellm.kernels/models/tui onto this checkout, as
# pyproject.toml's package-dir does.
set -u
cd "$(dirname "$0")/.." || exit 1
REPO=$PWD
PY=${PYTHON:-python3}

if [ "${1:-}" = "--prepare" ]; then
    rm -rf .whl && mkdir -p .whl || exit 1
    GGUF_VERSION=$($PY -c "import importlib.metadata as m; print(m.version('gguf'))" 2>/dev/null || echo 0.19.0)
    $PY -m pip download --quiet --no-deps --only-binary=:all: -d .whl "gguf==$GGUF_VERSION" || exit 1
    for v in 3.10 3.11 3.12 3.13; do
        $PY -m pip download --quiet --no-deps --only-binary=:all: --python-version "$v" \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl regex pyyaml || exit 1
    done
    ls .whl && du -sh .whl
    exit 0
fi

echo "=== edgellm gpu check: $(date -u +%FT%TZ), repo $REPO"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY --version

SITE=/tmp/edgellm-gpu-check-site
SHIM=/tmp/edgellm-gpu-check-shim
rm -rf "$SITE" "$SHIM" && mkdir -p "$SITE" "$SHIM/edgellm" || exit 1

# Pure-Python (and a few binary) dependencies that are not preinstalled: from .whl/, no network.
missing=""
$PY -c "import gguf" 2>/dev/null || missing="$missing gguf"
$PY -c "import regex" 2>/dev/null || missing="$missing regex"
$PY -c "import yaml" 2>/dev/null || missing="$missing pyyaml"
if [ -d .whl ]; then
    # gguf always from .whl/ when it is there: the version the project was tested with
    $PY -m pip install --quiet --no-index --no-deps --target "$SITE" --find-links .whl gguf $missing \
        || { echo "FAIL  pip install from .whl/ ($missing gguf)"; echo "GPU CHECK FAILED"; exit 1; }
elif [ -n "$missing" ]; then
    echo "FAIL  missing Python modules:$missing, and no .whl/ folder (make one: scripts/gpu_check.sh --prepare)"
    echo "GPU CHECK FAILED"
    exit 1
fi

# edgellm from this checkout: edgellm/* plus the folders pyproject.toml maps into the package.
for f in "$REPO"/edgellm/*; do ln -s "$f" "$SHIM/edgellm/"; done
ln -s "$REPO/kernels" "$SHIM/edgellm/kernels"
ln -s "$REPO/models" "$SHIM/edgellm/models"
ln -s "$REPO/tui" "$SHIM/edgellm/tui"
export PYTHONPATH="$SHIM:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export NUMBA_CACHE_DIR=/tmp/edgellm-gpu-check-numba

timeout 295 $PY "$REPO/scripts/checks/gpu_check.py" "$@"
rc=$?
if [ $rc -eq 124 ]; then
    echo "FAIL  gpu_check.py ran past 295 s and was stopped"
    echo "GPU CHECK FAILED"
fi
exit $rc
