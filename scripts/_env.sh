# Sourced by the scripts in this folder: create or reuse the project virtualenv (.venv)
# and install the project into it. Set BATCHMAKER_TORCH to choose the torch build,
# e.g. BATCHMAKER_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu124".
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
    echo "creating $VENV" >&2
    python3 -m venv "$VENV"
fi
STAMP="$VENV/.batchmaker-installed"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
    echo "installing batchmaker and its dependencies into $VENV" >&2
    # shellcheck disable=SC2086
    "$PY" -m pip install --quiet --disable-pip-version-check ${BATCHMAKER_TORCH:-torch==2.13.0}
    "$PY" -m pip install --quiet --disable-pip-version-check -e "$ROOT[test,bench]"
    touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
