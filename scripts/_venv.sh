# Sourced by the scripts: pick the Python (PYTHON=..., else the newest supported one
# found) and make sure the virtual environment $VENV (default .venv) is made with it.
source "$(dirname "${BASH_SOURCE[0]}")/_python.sh"
VENV="${VENV:-.venv}"
if [ -n "${PYTHON:-}" ]; then
    if ! PY="$(command -v "$PYTHON")" || ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        echo "error: PYTHON=$PYTHON is not a Python >= 3.11" >&2
        exit 2
    fi
else
    PY=""
    for version in $(printf '%s\n' "${SUPPORTED_PYTHONS[@]}" | sort -rV); do
        if PY="$(find_python "$version")"; then
            break
        fi
    done
    if [ -z "$PY" ]; then
        echo "error: pgleaderlock needs Python >= 3.11 (set PYTHON=/path/to/python)" >&2
        exit 2
    fi
fi
want="$(python_version "$PY")"
if [ -x "$VENV/bin/python" ] && [ "$(python_version "$VENV/bin/python")" != "$want" ]; then
    echo "$VENV was made with Python $(python_version "$VENV/bin/python"), not $want ($PY): making it again"
    rm -rf "$VENV"
fi
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
