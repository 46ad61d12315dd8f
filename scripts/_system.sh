# Sourced by scripts/test.sh: the Debian packages some test tiers run (real PgBouncer,
# Chromium, Patroni...), installed only when missing and only when allowed.
#
# PGLEADERLOCK_TEST_APT decides:
#   unset or "missing"  install what is missing (as root, with apt-get), after saying what
#                       and why: --no-install-recommends, never upgrading an installed
#                       package (if apt would have to, nothing is installed);
#   "0" / "no"          install nothing: the tiers that need a missing package skip, loudly.
# Not root, or no apt-get: nothing is installed and those tiers skip with the reason.

# system_packages WHY PACKAGE:COMMAND...: makes sure each COMMAND exists, installing its
# PACKAGE when missing and allowed. Prints one line of what it did; on failure prints why
# (for the skip reason) and returns 1.
system_packages() {
    local why="$1" spec package command
    shift
    local -a missing=()
    for spec in "$@"; do
        package="${spec%%:*}" command="${spec#*:}"
        if ! command -v "$command" >/dev/null 2>&1 && [ ! -x "/usr/sbin/$command" ] &&
            [ ! -x "/usr/bin/$command" ]; then
            missing+=("$package")
        fi
    done
    if [ "${#missing[@]}" = 0 ]; then
        return 0
    fi
    case "${PGLEADERLOCK_TEST_APT:-missing}" in
        0 | no | false | off)
            echo "${missing[*]} missing, and PGLEADERLOCK_TEST_APT=${PGLEADERLOCK_TEST_APT} forbids installing"
            return 1
            ;;
    esac
    if [ "$(id -u)" != 0 ]; then
        echo "${missing[*]} missing, and not root, so apt-get cannot install them"
        return 1
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "${missing[*]} missing, and apt-get is not available (not a Debian-like system)"
        return 1
    fi
    echo "   installing Debian packages ${missing[*]} ($why) with apt-get install --no-install-recommends; set PGLEADERLOCK_TEST_APT=0 to skip those tests instead" >&2
    # Another apt or dpkg (a second test run, unattended upgrades) may hold the lock: wait
    # for it up to 5 minutes instead of failing at once.
    local -a wait_lock=(-o DPkg::Lock::Timeout=300)
    if ! apt-get "${wait_lock[@]}" update -qq >/dev/null 2>&1; then
        echo "apt-get update failed; ${missing[*]} not installed"
        return 1
    fi
    local plan
    plan="$(apt-get "${wait_lock[@]}" -s install --no-install-recommends "${missing[@]}" 2>&1)" || {
        echo "apt-get cannot install ${missing[*]}: $(printf '%s\n' "$plan" | tail -n 1)"
        return 1
    }
    local upgrades
    upgrades="$(printf '%s\n' "$plan" | awk '/^Inst / && $3 ~ /^\[/ {print $2}' | tr '\n' ' ')"
    if [ -n "$upgrades" ]; then
        echo "installing ${missing[*]} would upgrade installed packages (${upgrades% }); not installed"
        return 1
    fi
    local new
    new="$(printf '%s\n' "$plan" | awk '/^Inst / {print $2}' | tr '\n' ' ')"
    echo "   apt-get installs: ${new% }" >&2
    # "exit 101" in policy-rc.d: maintainer scripts may not start services (the fixtures
    # run their own instances).
    local policy=/usr/sbin/policy-rc.d ours="" status=0
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && ours=1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get "${wait_lock[@]}" install -y -qq --no-install-recommends --no-upgrade \
        "${missing[@]}" >/dev/null 2>&1 || status=$?
    [ -z "$ours" ] || rm -f "$policy"
    if [ "$status" != 0 ]; then
        echo "apt-get install ${missing[*]} failed (exit $status)"
        return 1
    fi
}
