#!/usr/bin/env bash
# Install everything into virtual environments and run the whole suite: lint, types,
# docs, tests. Works on a fresh machine with Python >= 3.11; the tests find or start
# PostgreSQL themselves (see docs/testing.md). Extra arguments go to pytest (one run, on
# the main Python only).
#
# PYTHON=...                     the Python of the whole suite (default: the newest
#                                supported one found; see scripts/_python.sh)
# PGLEADERLOCK_TEST_PYTHONS=...  the other Pythons that run the fast tiers (default:
#                                every other supported version found), e.g. "3.12 3.13";
#                                "none" for none
# PGLEADERLOCK_TEST_FLOORS=0     skip the run on the lowest dependency versions
# PGLEADERLOCK_TEST_APT=0        install no Debian package (see scripts/_system.sh)
set -euo pipefail
export NO_MKDOCS_2_WARNING=1
cd "$(dirname "$0")/.."
source scripts/_venv.sh
source scripts/_system.sh

echo "== python $(python_version "$VENV/bin/python") ($PY): the whole suite"
scripts/install.sh

# The fast tiers on every other supported Python, and on the lowest dependency versions
# pyproject.toml allows (uv's --resolution lowest-direct, on the oldest Python).
FAST=(tests/unit tests/contract tests/server tests/test_typing.py tests/test_packaging.py)
# The floors run: the fast tiers and what each dependency's floor can break (the drivers
# in tests/contract, FastAPI and APScheduler in tests/frameworks, Django's settings,
# checks and commands, Celery's configuration, click and rich in the command line's
# parsing and its --watch screen; the Django singleton's process races run in the side
# lane).
FLOORS=("${FAST[@]}" tests/frameworks tests/djangoapp/test_django_conf.py
    tests/djangoapp/test_django_status.py tests/celerybeat/test_celery_beat_config.py
    tests/cli/test_cli_usage.py tests/cli/test_cli_status_watch.py)
# Runs in the main lane; here, beside four other lanes, its 5 ms kill timing is the
# machine's, not the floors' (it fails now and then under load on any versions).
FLOORS_DESELECT=(--deselect tests/frameworks/test_apscheduler_pg.py::test_a_kill_5_ms_before_a_tick_does_not_miss_it)
others=()
main_version="$(python_version "$VENV/bin/python")"
main_version="${main_version%.*}"
if [ "${PGLEADERLOCK_TEST_PYTHONS:-}" != none ]; then
    for version in ${PGLEADERLOCK_TEST_PYTHONS:-${SUPPORTED_PYTHONS[*]}}; do
        [ "$version" != "$main_version" ] || continue
        if path="$(find_python "$version")"; then
            others+=("$version:$path")
            echo "== python $(python_version "$path") ($path): the fast tiers"
        else
            echo "== python $version: not found on this machine, not tested (PATH, pyenv, /usr/bin)"
        fi
    done
fi
floors=""
if [ "${PGLEADERLOCK_TEST_FLOORS:-1}" != 0 ]; then
    for version in "${SUPPORTED_PYTHONS[@]}"; do
        if floors="$(find_python "$version")"; then
            echo "== python $(python_version "$floors") ($floors): the lowest dependency versions"
            break
        fi
        floors=""
    done
fi
# The floors run is on the oldest Python and holds the fast tiers: that Python needs no
# lane of its own (two cores do not run five lanes much faster than four).
if [ -n "$floors" ]; then
    floors_version="$(python_version "$floors")"
    floors_version="${floors_version%.*}"
    kept=()
    for spec in "${others[@]}"; do
        if [ "${spec%%:*}" = "$floors_version" ]; then
            echo "== python $floors_version: its fast tiers run in the floors run"
        else
            kept+=("$spec")
        fi
    done
    others=("${kept[@]}")
fi

# Debian packages the tests use, installed when missing. Never fatal: without one, its
# tests skip, with the reason printed here and passed on to pytest.
echo "== debian packages"
if why="$(system_packages "real PgBouncer for tests/deploy" pgbouncer:pgbouncer)"; then
    bouncer="$(command -v pgbouncer || echo /usr/sbin/pgbouncer)"
    echo "   $bouncer: $("$bouncer" --version 2>&1 | sed -n 1p || true)"
    # The fixture (tests/support/pgbouncer.py) runs its own instances: stop the package's
    # service if something started it anyway.
    if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
        systemctl stop pgbouncer.service >/dev/null 2>&1 || true
    elif [ -s /run/postgresql/pgbouncer.pid ] && [ -x /etc/init.d/pgbouncer ]; then
        /etc/init.d/pgbouncer stop >/dev/null 2>&1 || true
    fi
else
    echo "   SKIPPING the pooler tests (tests/deploy): $why"
    export PGLEADERLOCK_TEST_PGBOUNCER_MISSING="$why"
fi
# Debian's Patroni, etcd and HAProxy for tests/ha (a real Patroni cluster on PostgreSQL
# 15: switchovers and crashes of the primary under locks, groups and the Scheduler).
if why="$(system_packages "a real Patroni cluster for tests/ha" patroni:patroni \
    etcd-server:etcd haproxy:haproxy)"; then
    echo "   $(command -v patroni || echo /usr/bin/patroni): $(patroni --version 2>&1 | sed -n 1p || true)," \
        "etcd $(etcd --version 2>/dev/null | sed -n 's/^etcd Version: //p' || true)," \
        "$(haproxy -v 2>/dev/null | sed -n 1p | cut -d' ' -f1-3 || true)"
    # The fixture (tests/support/patroni.py) runs its own etcd, Patroni nodes and HAProxy
    # on free ports: stop the packages' services if something started them anyway.
    for service in patroni etcd haproxy; do
        if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
            systemctl stop "$service.service" >/dev/null 2>&1 || true
        elif [ -x "/etc/init.d/$service" ]; then
            "/etc/init.d/$service" stop >/dev/null 2>&1 || true
        fi
    done
else
    echo "   SKIPPING the HA tier (tests/ha): $why"
    export PGLEADERLOCK_TEST_PATRONI_MISSING="$why"
fi
# Debian's Chromium for tests/docs and tests/dashboard, driven by Playwright through its
# executable path (Playwright's own browser download is never used).
if why="$(system_packages "a headless browser for tests/docs and tests/dashboard" chromium:chromium)"; then
    echo "   $(command -v chromium): $(chromium --version 2>/dev/null | sed -n 1p || true)"
else
    echo "   SKIPPING the browser tests (tests/docs, tests/dashboard): $why"
    export PGLEADERLOCK_TEST_CHROMIUM_MISSING="$why"
fi

echo "== ruff"
"$VENV/bin/ruff" check src tests benchmarks examples
"$VENV/bin/ruff" format --check src tests benchmarks examples
echo "== mypy --strict src tests"
"$VENV/bin/mypy"
echo "== mkdocs build --strict (scripts/docs_check.sh)"
MKDOCS="$VENV/bin/mkdocs" scripts/docs_check.sh

PYTEST=(-m pytest -W error::ResourceWarning -p no:cacheprovider)
# pytest exits 5 when no test ran: that is a failure here, as it should be.
if [ "$#" -gt 0 ]; then
    echo "== pytest $* (python $main_version)"
    exec "$VENV/bin/python" "${PYTEST[@]}" "$@"
fi

# lane NAME LOG COMMAND...: runs COMMAND in the background, its output in LOG; prints a
# progress line every minute, and the exit status when it ends.
lanes=()
lane() {
    local name="$1" log="$2"
    shift 2
    (
        "$@" >"$log" 2>&1 &
        pid=$!
        trap 'kill "$pid" 2>/dev/null || true' EXIT
        while kill -0 "$pid" 2>/dev/null; do
            sleep 60
            progress="$(grep -aoE '\[ *[0-9]+%\]|^== .*' "$log" | tail -n 1 || true)"
            echo "   ... $name: ${progress:-starting}"
        done
        status=0
        wait "$pid" || status=$?
        trap - EXIT
        echo "   ... $name: done (exit $status)"
        exit "$status"
    ) &
    lanes+=("$name:$!:$log")
}

# fast_lane VERSION PATH: the fast tiers on another Python, in its own .venv-VERSION.
fast_lane() {
    local version="$1" path="$2" venv=".venv-$1"
    echo "== python $(python_version "$path") ($path): the fast tiers (${FAST[*]})"
    VENV="$venv" PYTHON="$path" bash -c 'source scripts/_venv.sh' &&
        "$venv/bin/python" -m pip install -q --disable-pip-version-check -e '.[test]' &&
        "$venv/bin/python" "${PYTEST[@]}" -q "${FAST[@]}"
}

# floors_lane: the lowest direct dependency versions pyproject.toml allows (uv's
# --resolution lowest-direct; uv is installed into the main venv), on the oldest Python.
floors_lane() {
    echo "== python $(python_version "$floors"), the lowest dependency versions pyproject.toml allows (${FLOORS[*]})"
    rm -rf .venv-floors && "$VENV/bin/uv" venv -q -p "$floors" .venv-floors &&
        VIRTUAL_ENV=.venv-floors "$VENV/bin/uv" pip install -q --resolution lowest-direct \
            -e '.[test]' &&
        echo "   installed: $(VIRTUAL_ENV=.venv-floors "$VENV/bin/uv" pip freeze 2>/dev/null |
            grep -iE '^(psycopg|pluggy|asyncpg|sqlalchemy|fastapi|apscheduler|click|loguru|prometheus-client|opentelemetry-api|rich|cronsim|celery|django)==' |
            tr '\n' ' ')" &&
        .venv-floors/bin/python "${PYTEST[@]}" -q "${FLOORS[@]}" "${FLOORS_DESELECT[@]}"
}

# Lanes side by side: the main suite (here), the side tier (tests/soak: minutes-long
# fault runs that mostly wait for clock ticks; tests/celerybeat: Celery beat and workers
# on Redis/RabbitMQ; tests/djangoapp: manage.py; tests/deploy: throwaway clusters,
# standbys, PgBouncers; tests/ha: a real Patroni cluster, about a minute; tests/docs,
# tests/dashboard (both in Chromium) and the process-tree tests, which keep the two
# lanes of about the same length;
# tests/extras: a fresh venv per extra, each running its guide's example), one lane per
# other Python and the floors. Their reports follow the main suite's.
SIDE=(tests/soak tests/celerybeat tests/djangoapp tests/deploy tests/ha tests/docs tests/dashboard
    tests/extras tests/cli/test_cli_exec_tree.py)
logs="$(mktemp -d)"
echo "== pytest, lanes: main (here), side (${SIDE[*]}), fast tiers on: ${others[*]:-none}, floors: ${floors:-no}"
lane side "$logs/side.log" "$VENV/bin/python" "${PYTEST[@]}" --durations=15 "${SIDE[@]}"
for spec in "${others[@]}"; do
    lane "python${spec%%:*}" "$logs/python${spec%%:*}.log" fast_lane "${spec%%:*}" "${spec#*:}"
done
if [ -n "$floors" ]; then
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check uv
    lane floors "$logs/floors.log" floors_lane
fi
trap 'for l in "${lanes[@]}"; do kill "$(echo "$l" | cut -d: -f2)" 2>/dev/null || true; done' EXIT
ignored=()
for dir in "${SIDE[@]}"; do ignored+=("--ignore=$dir"); done
status=0
"$VENV/bin/python" "${PYTEST[@]}" --durations=25 "${ignored[@]}" || status=$?
failed=()
[ "$status" = 0 ] || failed+=("main (exit $status)")
for l in "${lanes[@]}"; do
    name="${l%%:*}" rest="${l#*:}"
    pid="${rest%%:*}" log="${rest#*:}"
    lane_status=0
    wait "$pid" || lane_status=$?
    echo "== pytest lane $name (exit $lane_status)"
    cat "$log"
    [ "$lane_status" = 0 ] || failed+=("$name (exit $lane_status)")
done
trap - EXIT
rm -rf "$logs"
if [ "${#failed[@]}" -gt 0 ]; then
    echo "pytest failed: ${failed[*]}"
    exit 1
fi
echo "== all lanes passed: main and side on python $main_version, fast tiers on: ${others[*]:-none}, floors: ${floors:-skipped}"
