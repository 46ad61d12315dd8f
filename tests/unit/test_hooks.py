"""pluggy hooks: plugins and decorator callbacks are one mechanism with one contract."""

from __future__ import annotations

import asyncio
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from pgleaderlock import LeaderLock, LockState
from pgleaderlock.core import hooks
from pgleaderlock.core.hooks import hookimpl
from pgleaderlock.testing import FakeServer
from support.fixture_types import MakeLock, MakeRecorder
from support.poll import eventually

if TYPE_CHECKING:
    pass

S = LockState


class Collector:
    def __init__(self, log: list[str], tag: str = "plugin") -> None:
        self.log = log
        self.tag = tag

    @hookimpl
    def pgleaderlock_acquired(self, lock: LeaderLock) -> None:
        self.log.append(f"{self.tag}:acquired:{lock.keys}:{lock.state.value}")

    @hookimpl
    async def pgleaderlock_state_change(self, old: LockState, new: LockState) -> None:
        await asyncio.sleep(0)  # kept: an async hook that really yields
        self.log.append(f"{self.tag}:{old.value}->{new.value}")

    @hookimpl
    def pgleaderlock_acquire_failed(self, attempt: int) -> None:
        self.log.append(f"{self.tag}:failed:{attempt}")

    @hookimpl
    def pgleaderlock_released(self) -> None:
        self.log.append(f"{self.tag}:released")

    @hookimpl
    def pgleaderlock_stopped(self, lock: LeaderLock) -> None:
        self.log.append(f"{self.tag}:stopped:{lock.state.value}")


async def test_plugin_sees_lifecycle_with_the_lock(make_lock: MakeLock) -> None:
    log: list[str] = []
    lock = make_lock()
    lock.plugins.register(Collector(log))
    await lock.start()
    assert await lock.wait_for_leadership(5)
    await lock.shutdown()
    assert log == [
        "plugin:stopped->follower",
        "plugin:follower->acquiring",
        "plugin:acquiring->leader",
        "plugin:acquired:(1, 2):leader",
        "plugin:leader->releasing",
        "plugin:releasing->stopped",  # the state changes first, then the row's events
        "plugin:released",
        "plugin:stopped:stopped",
    ]


async def test_callbacks_and_plugins_run_in_registration_order(
    make_lock: MakeLock,
) -> None:
    log: list[str] = []
    lock = make_lock()
    lock.on_acquired(lambda: log.append("cb1"))
    lock.plugins.register(Collector(log, "p1"))
    lock.on_acquired(lambda: log.append("cb2"))

    class First:
        @hookimpl(tryfirst=True)
        def pgleaderlock_acquired(self) -> None:
            log.append("first")

    lock.plugins.register(First())
    await lock.start()
    assert await lock.wait_for_leadership(5)
    acquired = [entry for entry in log if "->" not in entry]
    assert acquired == ["first", "cb1", "p1:acquired:(1, 2):leader", "cb2"]


async def test_failing_plugin_never_stops_others_or_the_lock(
    make_lock: MakeLock, recorder: MakeRecorder
) -> None:
    log: list[str] = []
    errors: list[Exception] = []
    lock = make_lock()
    rec = recorder(lock)

    class Broken:
        @hookimpl
        def pgleaderlock_acquired(self) -> None:
            raise RuntimeError("plugin bug")

    class ErrorWatcher:
        @hookimpl
        def pgleaderlock_error(self, lock: LeaderLock, error: Exception) -> None:
            errors.append(error)

    lock.plugins.register(Broken())
    lock.plugins.register(Collector(log))
    lock.plugins.register(ErrorWatcher())
    await lock.start()
    assert await lock.wait_for_leadership(5)
    await rec.wait_event("error")
    assert "plugin:acquired:(1, 2):leader" in log
    assert [type(e) for e in errors] == [RuntimeError]
    assert isinstance(rec.errors()[0], RuntimeError)  # on_error callbacks get it too
    assert lock.is_leader


async def test_acquire_failed_carries_the_attempt(make_lock: MakeLock, server: FakeServer) -> None:
    holder = await server.connect()
    assert await holder.try_lock(1, 2)
    log: list[str] = []
    lock = make_lock()
    lock.plugins.register(Collector(log))
    await lock.start()
    await eventually(lambda: sum("failed" in e for e in log) >= 3, 5, "3 failed attempts")
    assert [e for e in log if "failed" in e][:3] == [
        "plugin:failed:1",
        "plugin:failed:2",
        "plugin:failed:3",
    ]
    await holder.close()


def test_unknown_hook_argument_is_rejected(make_lock: MakeLock) -> None:
    class Wrong:
        @hookimpl
        def pgleaderlock_acquired(self, nonsense: int) -> None: ...

    lock = make_lock()
    with pytest.raises(Exception, match="nonsense"):
        lock.plugins.register(Wrong())


@pytest.fixture
def entry_point_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A distribution on sys.path declaring a plugin in the pgleaderlock.plugins group."""
    (tmp_path / "demo_plugin_mod.py").write_text(
        textwrap.dedent(
            """
            from pgleaderlock.core.hooks import hookimpl
            SEEN = []

            @hookimpl
            def pgleaderlock_acquired(lock):
                SEEN.append(lock.keys)
            """
        )
    )
    dist = tmp_path / "demo_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: demo-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[pgleaderlock.plugins]\ndemo = demo_plugin_mod\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(hooks.AUTOLOAD_ENV, raising=False)
    hooks.entry_point_plugins.cache_clear()
    yield
    hooks.entry_point_plugins.cache_clear()
    sys.modules.pop("demo_plugin_mod", None)


async def test_entry_point_plugins_are_loaded_for_every_lock(
    entry_point_plugin: None, make_lock: MakeLock
) -> None:
    import demo_plugin_mod  # type: ignore[import-not-found]

    lock = make_lock()
    assert lock.plugins.get_plugin("demo") is demo_plugin_mod
    await lock.start()
    assert await lock.wait_for_leadership(5)
    assert demo_plugin_mod.SEEN == [(1, 2)]  # type: ignore[union-attr]


async def test_autoload_can_be_disabled(
    entry_point_plugin: None, make_lock: MakeLock, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert make_lock(load_plugins=False).plugins.get_plugin("demo") is None
    monkeypatch.setenv(hooks.AUTOLOAD_ENV, "1")
    assert make_lock().plugins.get_plugin("demo") is None
