#!/usr/bin/env bash
# The docs check: builds the site with `mkdocs build --strict`, so that any warning (a
# cross-reference that resolves to nothing and would show as raw "[...][...]" text, a
# link to a missing page, a docstring mkdocstrings cannot parse) fails it. Run by
# scripts/test.sh, `make docs-check` and tests/docs (which proves it can fail).
#
# Never add --quiet (or -q): it drops the warnings before strict mode counts them, and
# the build then passes with them. The output is kept short here instead: the INFO lines
# are left out; every other line (WARNING, ERROR, "Aborted with N warnings in strict
# mode!", a traceback) is shown.
#
# scripts/docs_check.sh [CONFIG [SITE]]
#   CONFIG  the mkdocs.yml to build (default: the repository's); its docs_dir, hooks and
#           the source paths are relative to its directory
#   SITE    where to build the site, kept afterwards (default: a temp dir, removed)
# MKDOCS=...  the mkdocs to run (default: $VENV/bin/mkdocs, VENV defaulting to the
#             repository's .venv)
set -euo pipefail
export NO_MKDOCS_2_WARNING=1
root="$(cd "$(dirname "$0")/.." && pwd)"
config="${1:-$root/mkdocs.yml}"
mkdocs="${MKDOCS:-${VENV:-$root/.venv}/bin/mkdocs}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
site="${2:-$work/site}"

status=0
"$mkdocs" build --strict -f "$config" -d "$site" >"$work/log" 2>&1 || status=$?
# A log record's continuation lines (indented) go with their record: an INFO record is
# left out whole, any other is shown whole. Lines before the first record are shown.
awk '/^[A-Z]+ +- / { keep = ($1 != "INFO") } keep' keep=1 "$work/log"
if [ "$status" = 0 ]; then
    echo "   docs: built strictly, no warning"
else
    echo "   docs: the strict build FAILED (mkdocs exit $status)"
fi
exit "$status"
