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

# Debian packages the tests use, installed when missing. Never fatal: without one, its
# tests skip, with the reason printed here and passed on to pytest.
# apt_install PACKAGE: prints why not and fails when it cannot install.
apt_install() {
    if [ "$(id -u)" != 0 ]; then
        echo "not root, so apt-get cannot install it"
        return 1
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "apt-get is not available (not a Debian-like system)"
        return 1
    fi
    local policy=/usr/sbin/policy-rc.d ours="" status=0
    if [ ! -e "$policy" ]; then  # "exit 101": maintainer scripts may not start services
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && ours=1
    fi
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$1") \
        >&2 || status=$?
    [ -z "$ours" ] || rm -f "$policy"
    if [ "$status" != 0 ]; then
        echo "apt-get install $1 failed (exit $status)"
        return 1
    fi
}

# PgBouncer for tests/deploy: the fixture (tests/support/pgbouncer.py) runs its own
# instances, so the Debian package's own service must not start.
install_pgbouncer() {
    if command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ]; then
        return 0
    fi
    local status=0
    apt_install pgbouncer || status=$?
    # Belt and braces: stop the package's service if something started it anyway.
    if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
        systemctl stop pgbouncer.service >/dev/null 2>&1 || true
    elif [ -s /run/postgresql/pgbouncer.pid ] && [ -x /etc/init.d/pgbouncer ]; then
        /etc/init.d/pgbouncer stop >/dev/null 2>&1 || true
    fi
    return "$status"
}
echo "== pgbouncer"
if why="$(install_pgbouncer)"; then
    bouncer="$(command -v pgbouncer || echo /usr/sbin/pgbouncer)"
    echo "$bouncer: $("$bouncer" --version 2>&1 | sed -n 1p || true)"
else
    echo "PgBouncer unavailable, the pooler tests (tests/deploy) will skip: $why"
    export PGLEADERLOCK_TEST_PGBOUNCER_MISSING="$why"
fi

# Chromium for tests/docs: the docs site is opened in Debian's Chromium, driven by
# Playwright through its executable path (Playwright's own browser download is not used).
echo "== chromium"
if command -v chromium >/dev/null 2>&1 || why="$(apt_install chromium)"; then
    echo "$(command -v chromium): $(chromium --version 2>/dev/null | sed -n 1p || true)"
else
    echo "Chromium unavailable, the browser tests (tests/docs) will skip: $why"
    export PGLEADERLOCK_TEST_CHROMIUM_MISSING="$why"
fi

echo "== ruff"
"$VENV/bin/ruff" check src tests benchmarks examples
"$VENV/bin/ruff" format --check src tests benchmarks examples
echo "== mypy --strict src tests"
"$VENV/bin/mypy"
echo "== mkdocs build --strict"
"$VENV/bin/mkdocs" build --strict --quiet -d "$(mktemp -d)"

# pytest exits 5 when no test ran: that is a failure here, as it should be.
if [ "$#" -gt 0 ]; then
    echo "== pytest $*"
    exec "$VENV/bin/python" -m pytest -W error::ResourceWarning "$@"
fi
# Two pytest processes side by side: the soak tier (tests/soak: minutes-long fault runs
# that mostly wait for clock ticks) with the suites of other services' processes
# (tests/celerybeat: Celery beat and workers on Redis/RabbitMQ; tests/djangoapp:
# manage.py) and of their own servers (tests/deploy: throwaway clusters, standbys,
# PgBouncers), and the rest here. The side tier's report follows the rest's.
SIDE=(tests/soak tests/celerybeat tests/djangoapp tests/deploy)
echo "== pytest (${SIDE[*]} run beside it; their report follows)"
soak_log="$(mktemp)"
"$VENV/bin/python" -m pytest -W error::ResourceWarning -p no:cacheprovider --durations=15 \
    "${SIDE[@]}" >"$soak_log" 2>&1 &
soak_pid=$!
trap 'kill "$soak_pid" 2>/dev/null || true' EXIT
status=0
ignored=()
for dir in "${SIDE[@]}"; do ignored+=("--ignore=$dir"); done
"$VENV/bin/python" -m pytest -W error::ResourceWarning --durations=25 "${ignored[@]}" || status=$?
soak_status=0
wait "$soak_pid" || soak_status=$?
trap - EXIT
echo "== pytest ${SIDE[*]} (exit $soak_status)"
cat "$soak_log"
rm -f "$soak_log"
if [ "$status" != 0 ] || [ "$soak_status" != 0 ]; then
    echo "pytest failed: the suite exited $status, ${SIDE[*]} exited $soak_status"
    exit 1
fi
