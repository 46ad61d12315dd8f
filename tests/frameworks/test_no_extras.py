"""LeaderTasks and ThreadedLeaderLock need no extra: importing and using them must not
import a framework. Each check runs in a fresh interpreter in which every framework
module is blocked (``sys.modules[name] = None`` makes any import of it fail)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(60)

BLOCKED = ("fastapi", "starlette", "pydantic", "apscheduler")
"""The extras' frameworks (and what FastAPI is built on)."""


def run_without_frameworks(body: str) -> None:
    block = f"import sys\nfor _name in {BLOCKED!r}:\n    sys.modules[_name] = None\n"
    subprocess.run([sys.executable, "-c", block + textwrap.dedent(body)], check=True, timeout=50)


def test_leader_tasks_and_threaded_lock_import_without_frameworks() -> None:
    run_without_frameworks(
        """
        import pgleaderlock.integrations
        import pgleaderlock.tasks
        import pgleaderlock.threaded
        from pgleaderlock import LeaderTasks, ThreadedLeaderLock

        assert LeaderTasks is pgleaderlock.tasks.LeaderTasks
        assert ThreadedLeaderLock is pgleaderlock.threaded.ThreadedLeaderLock
        """
    )


def test_threaded_lock_leads_and_shuts_down_without_frameworks() -> None:
    run_without_frameworks(
        """
        import threading

        from pgleaderlock import FixedInterval, LeaderLock, LockState, ThreadedLeaderLock
        from pgleaderlock.testing.fake import FakeServer

        server = FakeServer()
        lock = LeaderLock(
            None, 1, 2, connect_fn=server.connect, retry_strategy=FixedInterval(0.01)
        )
        seen = []
        lock.on_acquired(lambda: seen.append(threading.current_thread().name))
        with ThreadedLeaderLock(lock) as threaded:
            assert threaded.wait_for_leadership(10)
        assert threaded.state is LockState.STOPPED and not threaded.running
        assert seen == ["pgleaderlock:1,2"], seen  # the callback ran in the lock's thread
        assert server.open_sessions == []
        """
    )
