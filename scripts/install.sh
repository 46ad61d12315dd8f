#!/usr/bin/env bash
# Make the virtual environment (scripts/_venv.sh: .venv, with the newest supported
# Python unless PYTHON=... says otherwise) and install pgleaderlock into it, editable,
# with its test and docs extras. Every make target that runs a tool from .venv runs this
# first, so each works in a fresh clone; pip makes a second run quick.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
echo "== install into $VENV (python $(python_version "$VENV/bin/python"))"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e '.[test,docs]'
