#!/usr/bin/env bash
# Install everything into .venv and run the whole suite: lint, types, docs, tests.
# Works on a fresh machine with Python >= 3.11; the tests find or start PostgreSQL
# themselves (see docs/testing.md). Extra arguments go to pytest.
set -euo pipefail
export NO_MKDOCS_2_WARNING=1
cd "$(dirname "$0")/.."
source scripts/_venv.sh

echo "== install"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e '.[test,docs]'

echo "== ruff"
"$VENV/bin/ruff" check src tests benchmarks examples
"$VENV/bin/ruff" format --check src tests benchmarks examples
echo "== mypy --strict src"
"$VENV/bin/mypy" src
echo "== mkdocs build --strict"
"$VENV/bin/mkdocs" build --strict --quiet -d "$(mktemp -d)"

echo "== pytest"
# pytest exits 5 when no test ran: set -e makes that a failure, as it should be.
"$VENV/bin/python" -m pytest -W error::ResourceWarning "$@"
