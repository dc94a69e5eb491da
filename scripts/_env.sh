# Sourced by the scripts in this folder: create or reuse the project virtualenv (.venv)
# and install the project into it. torch comes first, in the build that fits the machine:
#   - BATCHMAKER_TORCH, when set, is passed to pip as is, e.g.
#     BATCHMAKER_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu124";
#   - with an NVIDIA driver (nvidia-smi on PATH), torch==2.13.0 from PyPI (the CUDA build);
#   - otherwise the CPU build torch==2.13.0+cpu, from pip's configured indexes when they hold it,
#     else from PyTorch's CPU wheel index.
# The chosen torch spec is recorded in the stamp file: changing it reinstalls torch.
# BATCHMAKER_PYTHON picks the interpreter that creates the virtualenv (python3 by default).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
STAMP="$VENV/.batchmaker-installed"
TORCH_VERSION="2.13.0"
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"

require_python_311() {
    if ! command -v "$1" >/dev/null 2>&1; then
        echo "error: $1 not found; batchmaker needs Python >= 3.11 (set BATCHMAKER_PYTHON to one)" >&2
        return 1
    fi
    if ! "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
        echo "error: $1 is Python $("$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])');" \
            "batchmaker needs Python >= 3.11 (set BATCHMAKER_PYTHON to one, and remove $VENV if it was made by it)" >&2
        return 1
    fi
}

# The torch spec to install: the user's, else the CUDA build where an NVIDIA driver is present, else the CPU build.
torch_spec() {
    if [ -n "${BATCHMAKER_TORCH:-}" ]; then
        echo "$BATCHMAKER_TORCH"
    elif command -v nvidia-smi >/dev/null 2>&1; then
        echo "torch==$TORCH_VERSION"
    else
        echo "torch==$TORCH_VERSION+cpu"
    fi
}

# pip arguments that install `spec`: a +cpu build pip's own indexes lack comes from PyTorch's CPU wheel index.
torch_pip_args() {
    local spec="$1"
    if [ "$spec" = "torch==$TORCH_VERSION+cpu" ] \
        && ! "$PY" -m pip install --dry-run --no-deps --quiet --disable-pip-version-check "$spec" >/dev/null 2>&1; then
        echo "$spec --index-url $TORCH_CPU_INDEX"
    else
        echo "$spec"
    fi
}

if [ ! -x "$PY" ]; then
    require_python_311 "${BATCHMAKER_PYTHON:-python3}"
    echo "creating $VENV" >&2
    "${BATCHMAKER_PYTHON:-python3}" -m venv "$VENV"
fi
require_python_311 "$PY"
TORCH_SPEC="$(torch_spec)"
INSTALLED_SPEC="$(cat "$STAMP" 2>/dev/null || true)"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ] || [ "$INSTALLED_SPEC" != "$TORCH_SPEC" ]; then
    if [ -f "$STAMP" ] && [ "$INSTALLED_SPEC" != "$TORCH_SPEC" ]; then
        # pip takes any 2.13.0 build (+cpu or not) as satisfying torch==2.13.0: remove the old build first.
        echo "torch spec changed from '$INSTALLED_SPEC' to '$TORCH_SPEC': reinstalling torch" >&2
        "$PY" -m pip uninstall --quiet --yes torch
    fi
    TORCH_ARGS="$(torch_pip_args "$TORCH_SPEC")"
    echo "installing $TORCH_ARGS, then batchmaker and its dependencies, into $VENV" >&2
    # shellcheck disable=SC2086
    "$PY" -m pip install --quiet --disable-pip-version-check $TORCH_ARGS
    "$PY" -m pip install --quiet --disable-pip-version-check -e "$ROOT[test,bench]"
    echo "$TORCH_SPEC" >"$STAMP"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
