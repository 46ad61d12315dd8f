"""``pgleaderlock dashboard``: the read-only web page of who leads what
(`pgleaderlock.dashboard`), served by uvicorn on 127.0.0.1 unless told otherwise.

The command checks its options, binds the listening socket itself (so that a port in
use is a one-line error, exit 2, before anything runs) and hands it to uvicorn, whose
lifespan starts the dashboard's one refresher and stops it on SIGINT/SIGTERM (open
pages are closed after at most ``--grace`` seconds).
"""

from __future__ import annotations

import ipaddress
import socket

import click

from .._extras import missing_extra
from ..lowlevel import ConfigurationError
from .exits import EXIT_OK, CliError
from .options import (
    count_option,
    dsn_option,
    log_options,
    positive,
    resolve_dsn,
    schema_option,
    seconds_option,
    trusted_role_option,
)

__all__ = ["dashboard"]

_EPILOG = """\b
Examples:
  pgleaderlock dashboard --dsn postgresql://monitor@db/app     # http://127.0.0.1:8800/
  pgleaderlock dashboard --port 9000 --schema pgl --trusted-role owner
  ssh -L 8800:127.0.0.1:8800 db-admin-host                     # look from elsewhere

Read-only: one read-only session and one LISTEN session, whatever the number of open
pages; the DSN is never shown. Needs the dashboard extra: pip install
'pgleaderlock[dashboard]'.
"""


@click.command("dashboard", epilog=_EPILOG)
@dsn_option("PostgreSQL connection string (URL or key=value); never shown on the page.")
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    metavar="ADDRESS",
    help="The address to listen on. Anything but loopback lets whoever reaches it read "
    "who leads what (and the sessions' application_name, roles and addresses).",
)
@click.option(
    "--allowed-host",
    "allowed_hosts",
    metavar="NAME",
    multiple=True,
    help="A host name the page may be reached by (repeatable; e.g. behind a proxy). On "
    "loopback only 127.0.0.1, localhost and ::1 are answered (another site's page that "
    "made its name resolve to 127.0.0.1 reads nothing); beyond loopback any, unless given.",
)
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=8800,
    show_default=True,
    help="The port to listen on (1-65535).",
)
@schema_option
@trusted_role_option
@click.option(
    "--group-name",
    "group_names",
    metavar="GROUP:NAME",
    multiple=True,
    help="A name of a Coordinator group, to show by name (repeatable): a group's "
    "sessions show only its names' keys (its checkpoint table's rows give names too).",
)
@seconds_option(
    "--interval",
    default=1.0,
    text="The longest time between two refreshes (at most 1 s); a new leader's "
    "notification refreshes at once.",
)
@seconds_option("--timeout", default=5.0, text="Connect timeout and statement timeout.")
@count_option(
    "--max-pages",
    minimum=1,
    maximum=10_000,
    default=100,
    text="The most pages open at once (each costs a socket, never a database session).",
)
@seconds_option("--grace", default=2.0, text="On SIGINT/SIGTERM: how long open pages may stay.")
@log_options(cli="INFO", library="WARNING")
def dashboard(
    dsn: str | None,
    host: str,
    allowed_hosts: tuple[str, ...],
    port: int,
    schema: str,
    trusted_roles: tuple[str, ...],
    group_names: tuple[str, ...],
    interval: float,
    timeout: float,
    max_pages: int,
    grace: float,
) -> int:
    """Serve a read-only web page of who leads what, live.

    Locks (leader, role, pid, metadata, since, term; waiting sessions and their
    priority; observers; impostor sessions marked), Coordinator groups (members, the
    names each leads, balance), semaphores (slots and holders) and schedules (next
    slot, a timeline of recent slots by outcome), and the leadership changes seen since
    the dashboard started. Pages follow server-sent events fed by one refresher.
    """
    try:
        from ..dashboard import Dashboard
        from ..dashboard.server import DashboardServer
    except ImportError as exc:
        raise CliError(str(missing_extra("pgleaderlock dashboard", "Starlette and uvicorn",
                                         "dashboard", exc))) from None  # fmt: skip
    dsn = resolve_dsn(dsn)
    interval = positive("--interval", interval)
    if interval > 1.0:
        raise CliError(
            f"--interval must be at most 1 s (a page is live within it), got {interval:g}"
        )
    timeout = positive("--timeout", timeout)
    grace = positive("--grace", grace)
    names: dict[str, list[str]] = {}
    for given in group_names:
        group, colon, name = given.partition(":")
        if not colon or not group or not name:
            raise CliError(f"--group-name takes GROUP:NAME, got {given!r}")
        names.setdefault(group, []).append(name)
    try:
        board = Dashboard(
            dsn,
            schema=schema,
            trusted_roles=trusted_roles,
            group_names=names,
            period_s=interval,
            timeout_s=timeout,
            max_clients=max_pages,
            allowed_hosts=_allowed(host, allowed_hosts),
        )
    except ConfigurationError as exc:
        raise CliError(str(exc)) from None
    sock = _listen(host, port)
    url = f"http://{_url_host(host)}:{sock.getsockname()[1]}/"
    click.echo(f"pgleaderlock dashboard: {url} (read-only; Ctrl-C stops it)", err=True)
    if not _loopback(host):
        click.echo(
            f"pgleaderlock dashboard: warning: listening on {host}, beyond loopback: whoever "
            "reaches it reads who leads what",
            err=True,
        )
    server = DashboardServer(
        board,
        log_level="warning",
        timeout_graceful_shutdown=max(1, round(grace)),
        access_log=False,
        server_header=False,
    )
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return EXIT_OK


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound now: a bad address or a port in use is a CliError."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        raise CliError(f"--host {host!r} is not an address to listen on: {exc}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise CliError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def _allowed(host: str, given: tuple[str, ...]) -> tuple[str, ...] | None:
    """The host names to answer to: on loopback its names (and ``given``); beyond
    loopback ``given`` (with the loopback names and ``host``), else any."""
    from ..dashboard.app import LOOPBACK_HOSTS

    if _loopback(host):
        return (*LOOPBACK_HOSTS, *given)
    return (*LOOPBACK_HOSTS, host, *given) if given else None


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
