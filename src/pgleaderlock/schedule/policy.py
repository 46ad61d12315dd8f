"""[`Policy`][pgleaderlock.schedule.Policy]: what a leader does with the slots nobody
ran (missed, or interrupted mid-run), written once and taken by every entry point that
schedules: [`Scheduler.add`][pgleaderlock.schedule.Scheduler.add] and its decorators,
``bind_scheduler``, the Celery beat integration and ``pgleaderlock cron``."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypedDict, TypeVar

from ..lowlevel import ConfigurationError, positive

__all__ = [
    "CatchUp",
    "Interrupted",
    "Policy",
    "PolicyKeywords",
    "policy_from",
    "takes_old_keywords",
]

T = TypeVar("T")

CatchUp = Literal["none", "latest", "all"]
"""What a leader does with the slots that fell due while nobody led (older than the
misfire grace when it looks): ``"none"`` records them all as missed, ``"latest"`` runs
the newest of them and records the rest as missed, ``"all"`` runs them all, oldest
first (at most ``max_catch_up`` of them: the newest ones)."""

Interrupted = Literal["lost", "rerun"]
"""What the next leader does with a slot whose leader ended mid-run (killed, frozen,
cut off): ``"lost"`` records it as lost (at most once: the job may have done part of its
work), ``"rerun"`` runs it again under the new term (at least once; exactly once for the
effects of a job that writes through [`Run.transaction`][pgleaderlock.schedule.Run.transaction],
whose transaction commits only if the slot is still its own)."""


@dataclasses.dataclass(frozen=True)
class Policy:
    """The catch-up policy of scheduled jobs: one small immutable value, checked when
    it is made.

    ```python
    from pgleaderlock.schedule import Policy

    policy = Policy(catch_up="all", max_catch_up=10, interrupted="rerun")
    sched.add(job, Every(dt.timedelta(minutes=5)), policy=policy)
    bind_scheduler(scheduler, lock, policy=policy)
    ```

    Attributes:
        catch_up: the slots that fell due while nobody led, later than the misfire
            grace when a leader looks (see [`CatchUp`][pgleaderlock.schedule.CatchUp]).
        max_catch_up: with ``catch_up="all"``, at most this many of them run (the
            newest).
        interrupted: a slot whose leader ended mid-run (see
            [`Interrupted`][pgleaderlock.schedule.Interrupted]).
        misfire_grace_s: a slot started later than this after its time counts as
            missed, and ``catch_up`` decides it. Celery beat's default is 30 s; under
            ``bind_scheduler`` each APScheduler job's own ``misfire_grace_time`` is its
            grace, and a policy that sets this is refused.

    Raises:
        ConfigurationError: a value that is not one of the documented ones; the
            message begins with the field's name.
    """

    catch_up: CatchUp = "latest"
    max_catch_up: int = 100
    interrupted: Interrupted = "lost"
    misfire_grace_s: float = 1.0

    def __post_init__(self) -> None:
        if self.catch_up not in ("none", "latest", "all"):
            raise ConfigurationError(
                f"catch_up must be 'none', 'latest' or 'all', got {self.catch_up!r}"
            )
        if self.interrupted not in ("lost", "rerun"):
            raise ConfigurationError(
                f"interrupted must be 'lost' or 'rerun', got {self.interrupted!r}"
            )
        count = self.max_catch_up
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigurationError(f"max_catch_up must be an int >= 1, got {count!r}")
        grace = positive("misfire_grace_s", self.misfire_grace_s)
        object.__setattr__(self, "misfire_grace_s", grace)  # an int given: as a float


class PolicyKeywords(TypedDict, total=False):
    """The keywords that [`Policy`][pgleaderlock.schedule.Policy] replaces: still taken,
    for one release, with a ``DeprecationWarning``."""

    catch_up: CatchUp
    max_catch_up: int
    interrupted: Interrupted
    misfire_grace_s: float


_FIELDS = tuple(field.name for field in dataclasses.fields(Policy))


def policy_from(
    policy: Policy | None,
    old: Mapping[str, object],
    *,
    where: str,
    default: Policy | None = None,
    stacklevel: int = 3,
) -> Policy:
    """The policy an entry point was given: ``policy``, or the old keywords ``old``
    (with a ``DeprecationWarning`` naming the new spelling) laid over ``default``.

    Raises:
        TypeError: a keyword in ``old`` that was never one of the policy's.
        ConfigurationError: both ``policy`` and old keywords, or a bad value.
    """
    base = Policy() if default is None else default
    unknown = [name for name in old if name not in _FIELDS]
    if unknown:
        raise TypeError(f"{where}() got an unexpected keyword argument {unknown[0]!r}")
    if not old:
        if policy is None:
            return base
        if not isinstance(policy, Policy):
            raise ConfigurationError(f"{where}: policy must be a Policy, got {policy!r}")
        return policy
    names = ", ".join(f"{name}=" for name in old)
    if policy is not None:
        raise ConfigurationError(
            f"{where}: pass either policy=Policy(...) or the deprecated {names}, not both"
        )
    new = dataclasses.replace(base, **old)  # type: ignore[arg-type]
    spelled = ", ".join(f"{name}={value!r}" for name, value in old.items())
    warnings.warn(
        f"{where}({names}...) is deprecated and goes in the next release: pass "
        f"policy=Policy({spelled}) (from pgleaderlock.schedule import Policy)",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
    return new


def takes_old_keywords(default: Policy | None = None) -> Callable[[type[T]], type[T]]:
    """Class decorator for a dataclass with a ``policy`` field: its constructor also
    takes the old keywords, for one release (see
    [`policy_from`][pgleaderlock.schedule.policy.policy_from])."""

    def decorate(cls: type[T]) -> type[T]:
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self: T, *args: Any, **kwargs: Any) -> None:
            old = {name: kwargs.pop(name) for name in _FIELDS if name in kwargs}
            if old:
                kwargs["policy"] = policy_from(kwargs.get("policy"), old, where=cls.__name__,
                                               default=default, stacklevel=3)  # fmt: skip
            init(self, *args, **kwargs)

        setattr(cls, "__init__", __init__)  # noqa: B010  # mypy refuses a method assigned
        return cls

    return decorate
