"""The option groups (``LockOptions`` of ``Timing``, ``Fencing``, ``Participation``,
``Session``): each checks its own fields when it is made, their defaults are the lock's,
and every flat keyword of 0.1 still works, with a warning that names its new spelling."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any

import pytest

import pgleaderlock
from pgleaderlock import (
    ConfigurationError,
    Coordinator,
    Fencing,
    LeaderLock,
    LockOptions,
    Participation,
    Semaphore,
    Session,
    Timing,
)
from pgleaderlock.core.config import lock_config
from pgleaderlock.core.options import (
    DEPRECATED_KEYWORDS,
    deprecated_spelling,
    old_keywords,
    options_from_keywords,
)

DSN = "postgresql://u@h.invalid/db"
QUIET = LockOptions(load_plugins=False)

# ---------------------------------------------------------------------- each group's checks

untyped: Any = pgleaderlock  # the bad values below are of the wrong type on purpose
BAD: list[tuple[Any, str]] = [
    (lambda: untyped.Timing(health_timeout_s=0), "health_timeout_s must be a positive"),
    (lambda: untyped.Timing(connect_timeout_s=float("nan")), "connect_timeout_s must be a finite"),
    (lambda: untyped.Timing(command_timeout_s=True), "command_timeout_s must be a number"),
    (lambda: untyped.Timing(tcp_user_timeout_s=3e6), "INT_MAX ms"),
    (lambda: untyped.Timing(lease_s=-1), "lease_s must be a positive"),
    (lambda: untyped.Timing(drain_s=-1), "drain_s must not be negative"),
    (lambda: untyped.Timing(escalate_after_s="30"), "escalate_after_s must be a number"),
    (lambda: untyped.Fencing(enabled=1), "Fencing.enabled must be a bool"),
    (lambda: untyped.Fencing(table="a; drop"), "Fencing.table must be a plain SQL identifier"),
    (lambda: untyped.Fencing(schema=None), "Fencing.schema must be a plain SQL identifier"),
    (lambda: untyped.Fencing(acquire_delay_s=1.0), "acquire_delay_s needs fencing"),
    (lambda: untyped.Fencing(enabled=True, grace_s=0), "grace_s must be a positive"),
    (lambda: untyped.Participation(identity="a\nb"), "identity"),
    (lambda: untyped.Participation(metadata=[1]), "metadata must be a mapping"),
    (lambda: untyped.Participation(priority=2**31), "priority must be a 32-bit integer"),
    (lambda: untyped.Participation(priority=True), "priority must be a 32-bit integer"),
    (lambda: untyped.Participation(eligible="no"), "eligible must be a bool"),
    (lambda: untyped.Participation(handover_delay_s=-0.5), "handover_delay_s must not be negative"),
    (lambda: untyped.Participation(watch_interval_s=0), "watch_interval_s must be a positive"),
    (lambda: untyped.Participation(table="x y"), "Participation.table"),
    (lambda: untyped.Session(backend=3), "backend must be a name"),
    (lambda: untyped.Session(application_name=""), "non-empty string"),
    (lambda: untyped.Session(follower_mode="sleep"), "follower_mode must be 'wait' or 'poll'"),
    (lambda: untyped.Session(retry_permanent_errors=None), "retry_permanent_errors must be a bool"),
    (lambda: untyped.LockOptions(timing=Fencing()), "LockOptions.timing must be a Timing"),
    (lambda: untyped.LockOptions(trusted_roles="admin"), "trusted_roles must be a list"),
    (lambda: untyped.LockOptions(load_plugins="yes"), "load_plugins must be a bool"),
]


@pytest.mark.parametrize(("make", "message"), BAD, ids=[m for _, m in BAD])
def test_each_group_refuses_a_bad_field_when_it_is_made(make: Any, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        make()


def test_groups_are_immutable_and_normalise_once() -> None:
    timing = Timing(lease_s=20, drain_s=1)
    assert timing.lease_s == 20.0
    assert isinstance(timing.lease_s, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        timing.lease_s = 5  # type: ignore[misc]
    assert not hasattr(timing, "__dict__")  # slots
    roles = LockOptions(trusted_roles=["b", "a", "b"]).trusted_roles
    assert roles == ("a", "b")
    source = {"address": "10.0.0.1"}
    part = Participation(metadata=source)
    source["address"] = "changed"
    assert part.metadata == {"address": "10.0.0.1"}
    assert part.metadata_json == '{"address":"10.0.0.1"}'
    with pytest.raises(TypeError):
        part.metadata["x"] = 1  # type: ignore[index]


def test_an_options_argument_of_another_type_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="options must be a LockOptions"):
        LeaderLock(DSN, 1, 2, options=Timing())  # type: ignore[arg-type]


def test_cross_group_rules_are_the_locks() -> None:
    """What spans groups (the lease and the partition bound against the probe timing)
    is checked where both are known: by the lock."""
    with pytest.raises(ConfigurationError, match="lease_s=6 must exceed"):
        LeaderLock(DSN, 1, 2, options=dataclasses.replace(QUIET, timing=Timing(lease_s=6)))
    options = dataclasses.replace(QUIET, timing=Timing(tcp_user_timeout_s=6))
    with pytest.raises(ConfigurationError, match="tcp_user_timeout_s=6 must exceed"):
        LeaderLock(DSN, 1, 2, options=options)
    LeaderLock(DSN, 1, 2, health_interval_s=1, options=options)  # 6 > 1 + 2


# ---------------------------------------------------------------------- defaults, once


def test_the_defaults_are_the_groups_field_defaults() -> None:
    """``LockOptions()`` is what a lock without options gets, and its effective config is
    made from the groups' defaults: nowhere else are they written."""
    lock = LeaderLock(DSN, 1, 2, options=QUIET)
    config = lock._config
    timing, fencing, session = Timing(), Fencing(), Session()
    assert config.health_timeout_s == timing.health_timeout_s
    assert config.connect_timeout_s == timing.connect_timeout_s
    assert config.command_timeout_s == timing.command_timeout_s
    assert config.drain_s == timing.drain_s
    assert config.escalate_after_s == timing.escalate_after_s
    assert config.fencing_grace_s == fencing.grace_s
    assert config.acquire_delay_s == fencing.acquire_delay_s
    assert (config.term_table is not None) == fencing.enabled
    assert config.follower_mode == session.follower_mode
    assert config.retry_permanent_errors == session.retry_permanent_errors
    assert config.trusted_roles == tuple(LockOptions().trusted_roles)
    assert dataclasses.replace(config, connect_budget_s=None) == lock_config()  # no DSN yet
    assert lock.options == QUIET
    assert lock._handover_delay_s == Participation().handover_delay_s
    assert lock.eligible == Participation().eligible
    assert lock._participants.name == Participation().table
    fenced = LockOptions(fencing=Fencing(enabled=True), load_plugins=False)
    table = LeaderLock(DSN, 1, 2, options=fenced)._config.term_table
    assert table is not None
    assert (table.name, table.schema) == (fencing.table, fencing.schema)


def test_the_public_signatures_are_short() -> None:
    """At most 12 parameters: the specification's, the name, ``options`` and the
    deprecated keywords (measured as ``inspect.signature`` shows them)."""
    assert len(inspect.signature(LeaderLock).parameters) <= 12
    assert len(inspect.signature(Semaphore).parameters) <= 12
    assert len(inspect.signature(LeaderLock.from_name).parameters) <= 12
    for entry in (LeaderLock, Semaphore, LeaderLock.from_name, Coordinator):
        kinds = [p.kind for p in inspect.signature(entry).parameters.values()]
        assert kinds.count(inspect.Parameter.VAR_KEYWORD) == 1  # the typed deprecated ones


# ---------------------------------------------------------------------- the old spelling

# One value per old keyword that differs from its default and is valid on its own.
OLD_VALUES: dict[str, Any] = {
    "health_timeout_s": 1.5,
    "connect_timeout_s": 3.0,
    "command_timeout_s": 4.0,
    "tcp_user_timeout_s": 9.0,
    "lease_s": 12.0,
    "drain_s": 1.0,
    "escalate_after_s": 60.0,
    "fencing": True,
    "fencing_table": "my_terms",
    "fencing_schema": "locks",
    "acquire_delay_s": 0.5,
    "fencing_grace_s": 3.0,
    "identity": "replica-a",
    "metadata": {"address": "10.0.0.1"},
    "priority": 5,
    "eligible": False,
    "handover_delay_s": 1.0,
    "watch_interval_s": 2.0,
    "participants_table": "my_participants",
    "participants_schema": "locks",
    "backend": "psycopg",
    "application_name": "my-app",
    "follower_mode": "poll",
    "retry_permanent_errors": True,
    "trusted_roles": ("admin",),
    "load_plugins": False,
}
NEEDS = {"acquire_delay_s": {"fencing": True}}  # acquire_delay_s follows the term bump


def test_the_table_of_old_keywords_is_complete() -> None:
    assert set(OLD_VALUES) == set(DEPRECATED_KEYWORDS)
    assert len(DEPRECATED_KEYWORDS) == 26


@pytest.mark.parametrize("keyword", sorted(DEPRECATED_KEYWORDS))
def test_every_old_keyword_maps_to_its_new_spelling_and_warns(keyword: str) -> None:
    value = OLD_VALUES[keyword]
    extra = NEEDS.get(keyword, {})
    group, name = DEPRECATED_KEYWORDS[keyword]
    with pytest.warns(DeprecationWarning, match="is deprecated; use options=") as caught:
        lock = LeaderLock(DSN, 1, 2, **{keyword: value, **extra})
    messages = [str(w.message) for w in caught]
    expected = f"{keyword}= is deprecated; use {deprecated_spelling(keyword)}"
    assert expected in messages
    assert all(w.filename == __file__ for w in caught)  # points at the caller
    holder = lock.options if group is None else getattr(lock.options, group)
    assert getattr(holder, name) == (tuple(value) if keyword == "trusted_roles" else value)
    # The new spelling makes the same lock, without a warning.
    new = options_from_keywords({keyword: value, **extra})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same = LeaderLock(DSN, 1, 2, options=new)
    assert same.options == lock.options
    assert same._config == lock._config


def test_the_spelling_named_is_the_group_and_field() -> None:
    assert deprecated_spelling("lease_s") == "options=LockOptions(timing=Timing(lease_s=...))"
    assert deprecated_spelling("fencing") == "options=LockOptions(fencing=Fencing(enabled=...))"
    assert deprecated_spelling("trusted_roles") == "options=LockOptions(trusted_roles=...)"


@pytest.mark.parametrize(
    "make",
    [
        lambda **kw: LeaderLock(DSN, 1, 2, **kw),
        lambda **kw: LeaderLock.from_name("x", DSN, **kw),
        lambda **kw: Semaphore(DSN, "s", slots=2, **kw),
        lambda **kw: Semaphore.from_name("s", DSN, slots=2, **kw),
        lambda **kw: Coordinator(DSN, group="g", **kw),
    ],
    ids=["LeaderLock", "from_name", "Semaphore", "Semaphore.from_name", "Coordinator"],
)
def test_every_entry_point_warns_takes_options_and_refuses_both(make: Any) -> None:
    with pytest.warns(DeprecationWarning, match=r"(lease_s|load_plugins)= is deprecated") as caught:
        old = make(lease_s=12.0, load_plugins=False)
    assert len(caught) == 2
    assert all(w.filename == __file__ for w in caught)
    options = LockOptions(timing=Timing(lease_s=12.0), load_plugins=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = make(options=options)
    assert new.options == old.options == options
    with pytest.raises(ConfigurationError, match="lease_s= and options set the same setting"):
        make(lease_s=15.0, options=options)
    # An unknown keyword: Python's TypeError (a Coordinator's ConfigurationError, as in 0.1).
    with pytest.raises(
        (TypeError, ConfigurationError), match=r"unexpected keyword.*'lease'|unknown"
    ):
        make(lease=1.0)


def test_an_old_keyword_beside_options_that_leave_it_default_is_merged() -> None:
    options = LockOptions(fencing=Fencing(enabled=True), load_plugins=False)
    with pytest.warns(DeprecationWarning, match="lease_s= is deprecated"):
        lock = LeaderLock(DSN, 1, 2, options=options, lease_s=12.0)
    assert lock.options.fencing.enabled
    assert lock.lease_s == 12.0
    with pytest.raises(ConfigurationError, match="fencing= and options"):
        LeaderLock(DSN, 1, 2, options=options, fencing=False)


def test_old_keywords_are_the_inverse_of_options_from_keywords() -> None:
    flat = {k: v for k, v in OLD_VALUES.items() if k != "trusted_roles"}
    made = options_from_keywords(flat)
    assert options_from_keywords(old_keywords(made)) == made
    assert old_keywords(LockOptions()) == {}


def test_a_coordinator_takes_no_participation_nor_application_name() -> None:
    with pytest.raises(ConfigurationError, match="no Participation"):
        Coordinator(DSN, group="g", options=LockOptions(participation=Participation(priority=1)))
    with pytest.raises(ConfigurationError, match="names its sessions itself"):
        Coordinator(DSN, group="g", options=LockOptions(session=Session(application_name="x")))


def test_a_semaphore_takes_no_leader_participation() -> None:
    options = LockOptions(participation=Participation(priority=1), load_plugins=False)
    with pytest.raises(ConfigurationError, match="not a Semaphore"):
        Semaphore(DSN, "s", slots=2, options=options)
