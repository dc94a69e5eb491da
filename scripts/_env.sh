# Sourced by the scripts in this folder: find or create the Python environment the project runs in, and install
# the project into it (editable) with what the script runs on: its runtime dependencies, plus the extras the script
# names in JOB_EXTRAS before sourcing this file (./scripts/test: "test,bench"; ./scripts/demo and serve: none).
# The interpreter is BATCHMAKER_PYTHON, else the active virtualenv's python (VIRTUAL_ENV), else python3. torch:
#   - BATCHMAKER_TORCH, when set, is passed to pip as is and installed into .venv, e.g.
#     BATCHMAKER_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu124";
#   - else, when the interpreter already imports a torch in the range pyproject.toml declares, that torch is used
#     where it is: a virtualenv's python gets the project installed into that virtualenv, any other python a .venv
#     that sees its packages (--system-site-packages). A torch below the range is an error;
#   - else, with an NVIDIA driver (nvidia-smi on PATH), torch==2.13.0 from PyPI (the CUDA build), into .venv;
#   - otherwise the CPU build torch==2.13.0+cpu into .venv, from pip's configured indexes when they hold it,
#     else from PyTorch's CPU wheel index.
# An existing .venv is reused as it is: only deleting it makes the scripts look for an interpreter's torch again.
# BATCHMAKER_EXTRAS adds extras to the script's own (the container images set "oip").
# The project is built without build isolation, with the environment's setuptools (pyproject.toml's only build
# requirement; installed first when the environment lacks it), so that a machine without a package index that has
# the dependencies installs with no download. BATCHMAKER_WHEELS=DIR installs offline: every pip install reads DIR
# alone (--no-index --find-links DIR).
# The stamp file records the torch spec the scripts installed, or that they use the interpreter's, and the extras
# installed: a changed spec replaces a torch the scripts installed (a torch they did not install is never
# removed), and a script that needs an extra not installed yet installs it beside the others.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TORCH_VERSION="2.13.0"
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"
# The lowest torch the project supports: the bound of pyproject.toml's "torch>=X" dependency.
TORCH_MINIMUM="$(sed -n 's/^ *"torch>=\([0-9.]*\)".*/\1/p' "$ROOT/pyproject.toml")"
# What the project builds with (pyproject.toml's [build-system] requires): installed into the environment, as the
# build runs without isolation.
BUILD_REQUIRES="$(sed -n 's/^requires = \["\([^"]*\)"\]$/\1/p' "$ROOT/pyproject.toml")"
FOUND_TORCH="the interpreter's own torch"  # the stamp's entry when the scripts install no torch
PIP_INSTALL=(-m pip install --quiet --disable-pip-version-check)
if [ -n "${BATCHMAKER_WHEELS:-}" ]; then
    PIP_INSTALL+=(--no-index --find-links "$BATCHMAKER_WHEELS")
fi

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

# The comma-separated extras of $1 and $2 together, each once, in the order first named.
merge_extras() {
    local IFS=, extra merged=() both="$1,$2"
    for extra in $both; do  # not $1,$2: a comma splits a word only where an expansion yields it
        if [ -n "$extra" ] && [[ ",${merged[*]-}," != *",$extra,"* ]]; then
            merged+=("$extra")
        fi
    done
    echo "${merged[*]-}"
}

# Whether every extra of the comma-separated list $1 is in the list $2.
extras_within() {
    local IFS=, extra
    for extra in $1; do
        [[ ",$2," == *",$extra,"* ]] || return 1
    done
}

# The torch $1 imports, as "VERSION IN_RANGE VIRTUALENV" (IN_RANGE True or False; VIRTUALENV the virtualenv it is
# in, empty for any other python), or nothing when it has no torch. A torch that is there but fails to import fails.
interpreter_torch() {
    "$1" -c '
import re, sys
try:
    import torch
except ModuleNotFoundError as error:
    if error.name != "torch":
        raise
    sys.exit()
found = tuple(int(part) for part in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
minimum = tuple(int(part) for part in sys.argv[1].split(".")[:2])
print(torch.__version__, found >= minimum, sys.prefix if sys.prefix != sys.base_prefix else "")
' "$TORCH_MINIMUM"
}

# The torch spec to install when neither the user nor the interpreter provides one: the CUDA build where an
# NVIDIA driver is present, else the CPU build.
default_torch_spec() {
    if command -v nvidia-smi >/dev/null 2>&1; then
        echo "torch==$TORCH_VERSION"
    else
        echo "torch==$TORCH_VERSION+cpu"
    fi
}

# pip arguments that install `spec`: a +cpu build pip's own indexes lack comes from PyTorch's CPU wheel index
# (never offline, where DIR alone must hold it).
torch_pip_args() {
    local spec="$1"
    if [ "$spec" = "torch==$TORCH_VERSION+cpu" ] && [ -z "${BATCHMAKER_WHEELS:-}" ] \
        && ! "$PY" "${PIP_INSTALL[@]}" --dry-run --no-deps "$spec" >/dev/null 2>&1; then
        echo "$spec --index-url $TORCH_CPU_INDEX"
    else
        echo "$spec"
    fi
}

BASE_PY="${BATCHMAKER_PYTHON:-${VIRTUAL_ENV:+$VIRTUAL_ENV/bin/python}}"
BASE_PY="${BASE_PY:-python3}"
VENV="$ROOT/.venv"
if [ ! -x "$VENV/bin/python" ]; then
    require_python_311 "$BASE_PY"
fi
if [ -n "${BATCHMAKER_TORCH:-}" ]; then
    TORCH_SPEC="$BATCHMAKER_TORCH"
elif [ -x "$VENV/bin/python" ]; then
    # .venv keeps the torch it was made for: the interpreter's when it sees the interpreter's packages.
    if grep -qx 'include-system-site-packages = true' "$VENV/pyvenv.cfg" 2>/dev/null; then
        TORCH_SPEC="$FOUND_TORCH"
    else
        TORCH_SPEC="$(default_torch_spec)"
    fi
else
    PROBE="$(interpreter_torch "$BASE_PY")"
    if [ -z "$PROBE" ]; then
        TORCH_SPEC="$(default_torch_spec)"
    else
        read -r FOUND_VERSION IN_RANGE FOUND_VENV <<<"$PROBE"
        if [ "$IN_RANGE" != "True" ]; then
            echo "error: $BASE_PY imports torch $FOUND_VERSION; batchmaker needs torch >= $TORCH_MINIMUM." \
                "Upgrade that torch, or set BATCHMAKER_TORCH to a torch for the scripts to install into $VENV," \
                "e.g. BATCHMAKER_TORCH=\"torch==$TORCH_VERSION --index-url https://download.pytorch.org/whl/cu126\"" >&2
            return 1
        fi
        echo "using torch $FOUND_VERSION of $BASE_PY" >&2
        TORCH_SPEC="$FOUND_TORCH"
        VENV="${FOUND_VENV:-$VENV}"
    fi
fi
PY="$VENV/bin/python"
STAMP="$VENV/.batchmaker-installed"

if [ ! -x "$PY" ]; then
    echo "creating $VENV" >&2
    if [ "$TORCH_SPEC" = "$FOUND_TORCH" ]; then
        "$BASE_PY" -m venv --system-site-packages "$VENV"  # the interpreter's torch stays visible
    else
        "$BASE_PY" -m venv "$VENV"
    fi
fi
require_python_311 "$PY"
# The stamp: the torch spec on its first line, then "extras=" and the extras installed (an older stamp without
# that line counts as none, so the first script that needs extras installs them once more).
INSTALLED_SPEC="$(sed -n 1p "$STAMP" 2>/dev/null || true)"
INSTALLED_EXTRAS="$(sed -n 's/^extras=//p' "$STAMP" 2>/dev/null || true)"
EXTRAS="$(merge_extras "${JOB_EXTRAS-}" "${BATCHMAKER_EXTRAS-}")"  # what this script runs on
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ] || [ "$INSTALLED_SPEC" != "$TORCH_SPEC" ] \
    || ! extras_within "$EXTRAS" "$INSTALLED_EXTRAS"; then
    if [ -f "$STAMP" ] && [ "$INSTALLED_SPEC" != "$TORCH_SPEC" ] && [ "$INSTALLED_SPEC" != "$FOUND_TORCH" ]; then
        # The scripts installed that torch: remove it, as pip takes any 2.13.0 build (+cpu or not) as satisfying
        # torch==2.13.0, and an interpreter's torch must not stay hidden behind it.
        echo "torch spec changed from '$INSTALLED_SPEC' to '$TORCH_SPEC': removing the torch installed for it" >&2
        "$PY" -m pip uninstall --quiet --yes torch
    fi
    if [ "$TORCH_SPEC" != "$FOUND_TORCH" ]; then
        TORCH_ARGS="$(torch_pip_args "$TORCH_SPEC")"
        echo "installing $TORCH_ARGS into $VENV" >&2
        # shellcheck disable=SC2086
        "$PY" "${PIP_INSTALL[@]}" $TORCH_ARGS
    fi
    EXTRAS="$(merge_extras "$INSTALLED_EXTRAS" "$EXTRAS")"  # never fewer than before: another script uses them
    echo "installing batchmaker${EXTRAS:+ with its $EXTRAS extras} and its dependencies into $VENV" >&2
    # The build runs on the environment's setuptools, which this leaves as it is when it meets the requirement.
    "$PY" "${PIP_INSTALL[@]}" "$BUILD_REQUIRES"
    "$PY" "${PIP_INSTALL[@]}" --no-build-isolation -e "$ROOT${EXTRAS:+[$EXTRAS]}"
    printf '%s\nextras=%s\n' "$TORCH_SPEC" "$EXTRAS" >"$STAMP"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
