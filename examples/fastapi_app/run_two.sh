#!/usr/bin/env bash
# Two replicas of app.py side by side (ports 8001 and 8002), both against $PG_DSN.
# Ctrl-C stops both; each releases the lock on its way out.
set -euo pipefail
: "${PG_DSN:?set PG_DSN to a PostgreSQL connection string}"
cd "$(dirname "$0")"
trap 'kill $(jobs -p) 2>/dev/null; wait' INT TERM EXIT
REPLICA=a python -m uvicorn app:app --port 8001 --log-level warning &
REPLICA=b python -m uvicorn app:app --port 8002 --log-level warning &
wait
