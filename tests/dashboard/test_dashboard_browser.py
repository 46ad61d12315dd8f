"""The dashboard in headless Chromium, on a cluster shared by two teams' roles
(`support.shared_roles`): the dashboard reads as ``app``, the least-privilege role of
the Security page (``pgleaderlock sql`` grants, ``pg_monitor``), trusting ``owner``.

- the page names a running lock and its leader; after ``hand_over(to=...)`` the new
  leader appears without a reload (the page keeps a marker set before); a Coordinator
  group's names per member (two replicas, balanced), a semaphore's slot holder and a
  Scheduler's slots (coloured by outcome) appear;
- a participants row written by ``attacker`` (another real role) with a terminal escape
  sequence, ``<script>`` and an ``onerror`` in its identity, and an ``attacker``
  session named like pgleaderlock's, are shown as literal text: no element is made of
  them and no script runs; the page's theme follows the browser's light or dark;
- no request leaves loopback (every other one is aborted and recorded, and Chromium
  resolves no host name but 127.0.0.1), and the console shows no error (a load the
  Content-Security-Policy refused, a script error).

With ``PGLEADERLOCK_DASHBOARD_SCREENSHOT=PATH`` the first test saves its screenshot
there (``docs/assets/dashboard.png`` is made so); it always saves one under its tmp path.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from pgleaderlock import Coordinator, LeaderLock, LockOptions, Participation, Semaphore, lock_keys
from pgleaderlock.schedule import Run, Scheduler
from support.chromium import launch_options
from support.poll import eventually
from support.shared_roles import FAST, SCHEMA, Database, publish
from support.timings import lock_args, timings

pytestmark = [pytest.mark.integration, pytest.mark.throwaway, pytest.mark.timeout(180)]

SHOWN_WITHIN_MS = 5_000
"""How long the page may take to show a change (the benchmark measures the latency)."""
EVIL = (
    "\x1b[31m<script>window.__pwned = 1</script>"
    '<img src="http://evil.example/x.png" onerror="window.__pwned = 2">\x1b[0m'
)
"""Another role's identity: a terminal colour, a script and an image with a handler."""
GROUP_NAMES = ("alpha", "beta", "gamma")


@contextlib.asynccontextmanager
async def browser_page(chromium: Path, base_url: str) -> AsyncIterator[tuple[Any, list[str]]]:
    """A Chromium page that may only reach ``base_url``: every other request is aborted
    and recorded in the list yielded with it, as are the console's errors."""
    from playwright.async_api import async_playwright

    left: list[str] = []
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(**launch_options(chromium))
        try:
            page = await browser.new_page(viewport={"width": 1280, "height": 900})

            async def only_loopback(route: Any) -> None:
                if route.request.url.startswith(base_url):
                    await route.continue_()
                else:
                    left.append(route.request.url)
                    await route.abort()

            await page.route("**/*", only_loopback)

            # A refused load (the Content-Security-Policy's doing) or a script error is
            # a console error: recorded with the requests that left.
            def console(message: Any) -> None:
                if message.type == "error":
                    left.append(f"console: {message.text}")

            def page_error(error: Any) -> None:
                left.append(f"page error: {error}")

            page.on("console", console)
            page.on("pageerror", page_error)
            yield page, left
        finally:
            await browser.close()


def app_lock(database: Database, name: str, identity: str, **more: Any) -> LeaderLock:
    """A lock of ``app`` named ``name``, publishing ``identity`` in the participants
    table (schema ``pgl``, trusting ``owner``)."""
    return LeaderLock.from_name(
        name,
        database.dsn("app"),
        **lock_args(
            {**FAST, **more},
            options=LockOptions(
                participation=Participation(identity=identity, metadata={"zone": identity[-1]})
            ),
        ),
    )


async def idle(ctx: Any = None) -> None:
    await asyncio.Event().wait()


async def test_the_page_follows_leaders_groups_and_schedules_live(
    roles_db: Database, serve: Callable[..., Any], chromium_path: Path, tmp_path: Path
) -> None:
    database = roles_db
    a = app_lock(database, "billing", "replica-a")
    b = app_lock(database, "billing", "replica-b")
    reports = LeaderLock.from_name(
        "reports",
        database.dsn("app"),
        **lock_args(
            timings(retry_s=0.2, health_interval_s=0.5, load_plugins=False),
            fencing=True,
            fencing_schema=SCHEMA,
            trusted_roles=["owner"],
        ),
    )
    sched = Scheduler(reports)

    @sched.every(seconds=1)
    async def nightly(run: Run) -> None:
        if run.slot.second % 3 == 0:
            raise RuntimeError("every third slot fails, for the timeline")

    quick = timings(retry_s=0.05, health_interval_s=0.5, load_plugins=False)
    replicas = [
        Coordinator(
            database.dsn("app"),
            **lock_args(
                quick,
                group="grp",
                sessions="shared",
                balance_interval_s=0.1,
                trusted_roles=["owner"],
            ),
        )
        for _ in range(2)
    ]
    for replica in replicas:
        for name in GROUP_NAMES:
            replica.add(name, idle)
    exports = Semaphore(database.dsn("app"), "exports", slots=2, **lock_args(quick))
    async with a:
        assert await a.wait_for_leadership(10)
        async with b, reports, sched, replicas[0], replicas[1], exports:

            async def b_waits() -> bool:
                return any(
                    p.info.identity == "replica-b" and p.waiting for p in await a.participants()
                )

            await eventually(b_waits, 15)
            with serve(
                database.dsn("app"),
                schema=SCHEMA,
                trusted_roles=["owner"],
                group_names={"grp": list(GROUP_NAMES)},
            ) as app:
                async with browser_page(chromium_path, app.url) as (page, left):
                    await page.goto(app.url)
                    billing = page.locator('[data-lock="billing"]')
                    leader = billing.locator('[data-role="leader"]')
                    await leader.filter(has_text="replica-a").wait_for(timeout=SHOWN_WITHIN_MS)
                    assert "replica-b" in await billing.inner_text()  # waiting
                    group = page.locator('[data-group="grp"]')
                    for name in GROUP_NAMES:
                        await group.locator(".names", has_text=name).wait_for(timeout=10_000)
                    # Two members, three names: balanced within one.
                    await group.locator(".tag.balanced").wait_for(timeout=10_000)
                    assert await group.locator("tr").count() == 3  # a header, two members
                    semaphore = page.locator('[data-semaphore="exports"]')
                    await semaphore.locator(".who").first.wait_for(timeout=10_000)
                    schedule = page.locator('[data-schedule="reports:nightly"]')
                    await schedule.locator('[data-outcome="done"]').first.wait_for(timeout=15_000)
                    await schedule.locator('[data-outcome="failed"]').first.wait_for(timeout=15_000)
                    # A fenced leader that publishes no row: its term from the terms table.
                    reports_leader = page.locator('[data-lock="reports"] p', has_text="term ")
                    await reports_leader.wait_for(timeout=SHOWN_WITHIN_MS)

                    await page.evaluate("window.__marker = 42")
                    started = time.monotonic()
                    await a.hand_over(to="replica-b")
                    await leader.filter(has_text="replica-b").wait_for(timeout=SHOWN_WITHIN_MS)
                    took_ms = (time.monotonic() - started) * 1000
                    print(f"hand-over to the page: {took_ms:.0f} ms (hand_over() included)")
                    assert await page.evaluate("window.__marker") == 42  # no reload
                    # The old leader queues again (after a retry delay): waiting now.
                    await billing.locator("table", has_text="replica-a").wait_for(timeout=10_000)

                    await screenshot(page, tmp_path)
                    assert left == []


async def screenshot(page: Any, tmp_path: Path) -> None:
    """The page, saved under ``tmp_path`` and, when asked, where the docs want it."""
    await page.locator("#live[data-state='live']").wait_for()
    shot = tmp_path / "dashboard.png"
    await page.screenshot(path=str(shot), full_page=True)
    print(f"screenshot: {shot}")
    wanted = os.environ.get("PGLEADERLOCK_DASHBOARD_SCREENSHOT")
    if wanted:
        await page.screenshot(path=wanted, full_page=True)
        print(f"screenshot: {wanted}")


async def test_another_roles_text_is_shown_as_text(
    roles_db: Database, serve: Callable[..., Any], chromium_path: Path
) -> None:
    database = roles_db
    keys = lock_keys("billing")
    async with app_lock(database, "billing", "replica-a") as lock:
        assert await lock.wait_for_leadership(10)
        attacker = await database.connect("attacker")
        impostor = await database.connect("attacker")
        try:
            await publish(attacker, keys, EVIL)
            await impostor.execute(
                "SELECT set_config('application_name', %s, false)",
                ("pgleaderlock:<b>boss</b>\x1b[2J@host:1",),
            )
            await impostor.execute("SELECT pg_advisory_lock(1, 2)")
            with serve(database.dsn("app"), schema=SCHEMA, trusted_roles=["owner"]) as app:
                async with browser_page(chromium_path, app.url) as (page, left):
                    await page.goto(app.url)
                    row = page.locator('[data-lock="billing"] .untrusted-row')
                    await row.wait_for(timeout=SHOWN_WITHIN_MS)
                    text = await row.inner_text()
                    assert "<script>window.__pwned = 1</script>" in text
                    assert 'onerror="window.__pwned = 2"' in text
                    assert "\\x1b[31m" in text  # the escape, made visible
                    assert "\x1b" not in text
                    named = page.locator(".impostor-name")
                    await named.wait_for(timeout=SHOWN_WITHIN_MS)
                    # (the server itself turns the escape in an application_name into "?")
                    assert "pgleaderlock:<b>boss</b>" in await named.inner_text()
                    # Nothing of it became an element, and no script ran.
                    assert await page.locator("main script, main img, main b").count() == 0
                    assert await page.evaluate("window.__pwned") is None
                    # Light and dark themes follow the browser.
                    background = "getComputedStyle(document.body).backgroundColor"
                    await page.emulate_media(color_scheme="light")
                    light = await page.evaluate(background)
                    await page.emulate_media(color_scheme="dark")
                    assert await page.evaluate(background) != light
                    assert left == []
        finally:
            await attacker.close()
            await impostor.close()
