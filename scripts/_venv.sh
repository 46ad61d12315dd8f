# Sourced by the scripts: pick a Python >= 3.11 and make sure .venv exists.
VENV="${VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    for candidate in "${PYTHON:-}" python3.13 python3.12 python3.11 python3; do
        [ -n "$candidate" ] || continue
        if command -v "$candidate" >/dev/null 2>&1 &&
            "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            PY="$candidate"
            break
        fi
    done
    if [ -z "${PY:-}" ]; then
        echo "error: pgleaderlock needs Python >= 3.11 (set PYTHON=/path/to/python)" >&2
        exit 2
    fi
    "$PY" -m venv "$VENV"
fi
