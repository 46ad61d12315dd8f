"""The status routes' response models: pydantic models of what a replica reports.

[`LeaderView`][pgleaderlock.integrations.fastapi.LeaderView] is derived from
[`LeaderInfo`][pgleaderlock.LeaderInfo]'s fields (all but ``keys``, which
[`LeaderStatus`][pgleaderlock.integrations.fastapi.LeaderStatus] shows once), so that
the two cannot drift.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import typing
from typing import Any, Literal

from pydantic import BaseModel, Field, create_model

from ...health import HealthReport
from ...lowlevel import LeaderInfo, LockState

__all__ = ["GroupStatus", "HealthStatus", "LeaderStatus", "LeaderView", "view_fields"]

LEFT_OUT = frozenset({"keys"})
"""`LeaderInfo` fields the view leaves out: ``keys`` is the lock's, in `LeaderStatus`."""


def view_fields(info: type[Any], left_out: frozenset[str] = LEFT_OUT) -> dict[str, Any]:
    """The fields of the dataclass ``info`` (but ``left_out``) as pydantic's
    `create_model` takes them: ``{name: (type, default)}`` (``...``: required), with
    the types ``info`` declares."""
    hints = typing.get_type_hints(info)
    return {
        field.name: (hints[field.name], _default(field))
        for field in dataclasses.fields(info)
        if field.name not in left_out
    }


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return Field(default_factory=field.default_factory)
    return ... if field.default is dataclasses.MISSING else field.default


class _LeaderViewBase(BaseModel):
    @classmethod
    def of(cls, info: LeaderInfo | None) -> typing.Self | None:
        """The view of ``info`` (its fields by name; ``keys`` left out)."""
        return None if info is None else cls.model_validate(info, from_attributes=True)


if not typing.TYPE_CHECKING:
    LeaderView = create_model(
        "LeaderView", __base__=_LeaderViewBase, __module__=__name__, **view_fields(LeaderInfo)
    )
    """Who leads, as the status route shows it (see [Who leads](../guides/who-leads.md)):
    a pydantic model with the fields of [`LeaderInfo`][pgleaderlock.LeaderInfo] but
    ``keys`` (their names, types and defaults, read from it: ``pid``,
    ``application_name``, ``role``, ``identity``, ``name``, ``priority``, ``metadata``,
    ``since``, ``term``, ``trusted``). ``LeaderView.of(info)`` makes one from a
    ``LeaderInfo`` (``None`` from ``None``)."""
    LeaderView.__doc__ = "Who leads: the fields of a LeaderInfo but keys."
else:  # what a type checker sees: a model (its fields, LeaderInfo's, are made above)
    LeaderView = _LeaderViewBase


class LeaderStatus(BaseModel):
    """This replica's view of the leadership, as served by
    [`LeaderLifespan.router`][pgleaderlock.integrations.fastapi.LeaderLifespan.router].

    Attributes:
        name: the lock's name (``None`` for a lock made from raw keys).
        keys: the advisory lock keys ``[key1, key2]``.
        state: the lock's state: ``stopped``, ``follower``, ``acquiring``, ``leader``,
            ``reconnecting`` or ``releasing``.
        is_leader: True only in state ``leader``.
        ready: True while the lock takes part in the election (any state but
            ``stopped``), and during a cool-down after giving leadership away
            (``paused_until``). False before the app's startup, after its shutdown,
            and once the lock has stopped by itself, in particular on an error that
            retrying cannot mend (authentication failed, unknown database or role, a
            transaction-mode pooler): such a replica will never lead.
        leader_since: when the current leadership began (UTC), or ``None``.
        term: with ``Fencing(enabled=True)``, the fencing term of the current
            leadership ([`LeaderLock.term`][pgleaderlock.LeaderLock.term]); ``None``
            while not leader, and always without fencing. Terms exceed 2^32 (the
            server's timeline is in the high 32 bits) and stay below 2^53 for
            timelines below 2^21, so JavaScript clients read them exactly.
        last_error: the lock's last database error as ``"TypeName: message"``
            (passwords masked), from
            [`statistics()`][pgleaderlock.LeaderLock.statistics]; ``None`` when the last
            attempt succeeded.
        tasks: names of the leader-only tasks running in this replica now.
        paused_until: with ``give_away_after_crashes``: after a task crashed that many
            times in a row, this replica gave its leadership away and stays out of the
            election until then (UTC); ``None`` otherwise.
        leader: who leads the lock (any replica, this one included), as the process's
            leader watch was last told (``on_leader_changed``: milliseconds after a
            change); ``None`` while nobody leads, or before the watch first looked.
    """

    name: str | None
    keys: tuple[int, int]
    state: LockState
    is_leader: bool
    ready: bool
    leader_since: dt.datetime | None
    term: int | None
    last_error: str | None
    tasks: list[str]
    paused_until: dt.datetime | None = None
    leader: LeaderView | None = None


class HealthStatus(BaseModel):
    """A [health check][pgleaderlock.health]'s verdict, as served by
    [`LeaderLifespan.router`][pgleaderlock.integrations.fastapi.LeaderLifespan.router]'s
    ``/live`` and ``/health`` routes (200 when ``ok``, else 503).

    Attributes:
        ok: every condition holds.
        reasons: why not, one sentence each (``wedged: ...``, ``stopped``,
            ``failing for ...``).
        details: what the verdict was made from
            ([`HealthReport.details`][pgleaderlock.health.HealthReport]).
    """

    ok: bool
    reasons: list[str]
    details: dict[str, Any]

    @classmethod
    def of(cls, report: HealthReport) -> HealthStatus:
        return cls(ok=report.ok, reasons=list(report.reasons), details=dict(report.details))


class GroupStatus(BaseModel):
    """Who leads what in a group, as this replica sees it, as served by
    [`GroupLifespan.router`][pgleaderlock.integrations.fastapi.GroupLifespan.router].

    Attributes:
        group: the group's name.
        member: this replica's member id in the group (new at every process start).
        sessions: the coordinator's session mode, ``dedicated`` or ``shared``.
        ready: True while the coordinator runs (from the app's startup to its
            shutdown); False before and after, and once it stopped on an error that
            retrying cannot mend (``last_error`` says which).
        names: the task names registered in this replica.
        owned: the names this replica leads now.
        running: the names whose task runs in this replica now.
        members: the live members of the group and how many of these names each
            leads.
        leaders: for each name: the member that leads it, ``""`` for a session outside
            the group (for example a plain [`LeaderLock`][pgleaderlock.LeaderLock] on
            that name), ``null`` while nobody does.
        moves: how many names this replica has handed to other members so far.
        last_error: the error that stopped the coordinator, as ``"TypeName:
            message"``; ``None`` while it runs.

    ``members`` and ``leaders`` are the coordinator's last look at the group
    ([`Coordinator.view`][pgleaderlock.Coordinator.view]), at most ``idle_tick_s``
    old; ``owned`` and ``running`` are this replica's own, exact.
    """

    group: str
    member: str
    sessions: Literal["dedicated", "shared"]
    ready: bool
    names: list[str]
    owned: list[str]
    running: list[str]
    members: dict[str, int]
    leaders: dict[str, str | None]
    moves: int
    last_error: str | None
