#!/usr/bin/env bash
# Two replicas of the worker side by side, both against $PG_DSN. Ctrl-C stops both;
# each releases the lock on its way out.
#   ./run_two.sh                      # worker.py: AsyncIOScheduler + bind_scheduler
#   ./run_two.sh threaded_worker.py   # BackgroundScheduler + ThreadedLeaderLock + leader_only
set -euo pipefail
: "${PG_DSN:?set PG_DSN to a PostgreSQL connection string}"
cd "$(dirname "$0")"
WORKER="${1:-worker.py}"
trap 'kill $(jobs -p) 2>/dev/null; wait' INT TERM EXIT
REPLICA=a python "$WORKER" &
REPLICA=b python "$WORKER" &
wait
