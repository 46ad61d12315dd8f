# Sourced by the scripts: where the supported Pythons are on this machine.

# The versions pgleaderlock supports and tests (pyproject.toml's classifiers name the same).
SUPPORTED_PYTHONS=(3.11 3.12 3.13 3.14)

# find_python X.Y: prints the path of a working Python X.Y, or fails. Looks on PATH
# (pythonX.Y), then in pyenv's versions (the newest patch release), then in the usual
# system places. Installs nothing.
find_python() {
    local want="$1" candidate root
    local -a candidates=("python$want")
    if command -v pyenv >/dev/null 2>&1 && root="$(pyenv root 2>/dev/null)"; then
        # Newest patch release first (3.12.10 before 3.12.9).
        while IFS= read -r candidate; do
            candidates+=("$candidate")
        done < <(ls -d "$root"/versions/"$want".*/bin/"python$want" 2>/dev/null | sort -rV)
    fi
    candidates+=("/usr/local/bin/python$want" "/usr/bin/python$want")
    for candidate in "${candidates[@]}"; do
        if "$candidate" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$want'.split('.'))))" \
            >/dev/null 2>&1; then
            command -v "$candidate"
            return 0
        fi
    done
    return 1
}

# python_version PYTHON: "3.12.1" for the interpreter PYTHON.
python_version() {
    "$1" -c 'import platform; print(platform.python_version())'
}
