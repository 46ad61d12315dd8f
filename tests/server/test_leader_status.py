"""``pgleaderlock status`` shows what the locks published: identity, priority and
metadata of the holder and of the waiting sessions, and the observers."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from typing import Any

import pytest

from pgleaderlock import LeaderLock, LockOptions, Participation
from support.poll import eventually
from support.timings import lock_args, timings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

FAST: dict[str, Any] = timings(retry_s=0.05, health_interval_s=0.2, load_plugins=False)


async def _status(pg_dsn: str, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pgleaderlock.cli", "status", "--dsn", pg_dsn, *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_status_shows_metadata_and_observers(pg_dsn: str, schema: str) -> None:
    name = f"status-leader-{uuid.uuid4().hex[:8]}"
    common: dict[str, Any] = {"participants_schema": schema, **FAST}

    def member(participation: Participation) -> LeaderLock:
        options = LockOptions(participation=participation)
        return LeaderLock.from_name(name, pg_dsn, **lock_args(common, options=options))

    leader = member(Participation(identity="web-1", metadata={"address": "http://web-1"}))
    follower = member(Participation(identity="web-2", metadata={"address": "http://web-2"}))
    observer = member(Participation(identity="dash", eligible=False))
    observer.on_leader_changed(lambda info: None)
    try:
        await leader.start()
        assert await leader.wait_for_leadership(10)
        await follower.start()
        await observer.start()
        args = ("--name", name, "--participants-schema", schema)

        async def observed() -> bool:
            code, out, _ = await _status(pg_dsn, *args, "--json")
            return code == 0 and len(json.loads(out)["observers"]) == 1

        await eventually(observed, what="the observer listed")
        code, out, err = await _status(pg_dsn, *args, "--json")
        assert code == 0, err
        report = json.loads(out)
        [holder] = report["holders"]
        assert holder["pid"] == leader.backend_pid
        assert holder["identity"] == "web-1"
        assert holder["metadata"] == {"address": "http://web-1"}
        [waiting] = report["waiting"]
        assert waiting["identity"] == "web-2"
        assert [o["identity"] for o in report["observers"]] == ["dash"]
        assert report["participants_table"]["not_read"] is None

        code, text, err = await _status(pg_dsn, *args)
        assert code == 0, err
        assert 'identity web-1  metadata {"address": "http://web-1"}' in text
        assert "identity web-2" in text
        assert "observers 1" in text
        assert "dash" in text
    finally:
        for lock in (observer, follower, leader):
            await lock.shutdown()
