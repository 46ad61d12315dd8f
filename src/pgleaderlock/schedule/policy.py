"""[`Policy`][pgleaderlock.schedule.Policy]: what a leader does with the slots nobody
ran (missed, or interrupted mid-run) and with runs that failed
([`Retry`][pgleaderlock.schedule.Retry]), written once and taken by every entry point that
schedules: [`Scheduler.add`][pgleaderlock.schedule.Scheduler.add] and its decorators,
``bind_scheduler``, the Celery beat integration and ``pgleaderlock cron``."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypedDict, TypeVar

from ..lowlevel import ConfigurationError, not_negative, positive

__all__ = [
    "CatchUp",
    "Interrupted",
    "Policy",
    "PolicyKeywords",
    "Retry",
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


MAX_ATTEMPTS = 100
"""The most attempts a [`Retry`][pgleaderlock.schedule.Retry] may allow a slot."""


@dataclasses.dataclass(frozen=True)
class Retry:
    """How often a slot whose job raised is tried again: at most ``max_attempts``
    attempts in all, each retry after a back-off that doubles from ``backoff_s`` up to
    ``max_backoff_s`` (Oban's ``max_attempts``, Celery's ``autoretry_for``).

    ```python
    import psycopg
    from pgleaderlock.schedule import Policy, Retry

    # a database that went away: the driver's error (psycopg's), or a refused connect
    policy = Policy(retry=Retry(max_attempts=3, backoff_s=2.0,
                                on=(psycopg.OperationalError, OSError)))
    ```

    A retry is a new attempt of the same slot (the ledger's ``attempt`` column counts
    it, as ``run.attempt`` does), claimed under the current leader's term: never two
    successful attempts of one slot. While a retry is due the slot's row says
    ``failed`` with no ``finished_at`` (``pgleaderlock status``: "retry pending"); if
    leadership moves meanwhile the next leader retries it, its back-off counted from
    when it begins. The last failure stays ``failed``, with its error. Runs of one job
    never overlap: a retry waits for a run in progress, and a slot that falls due
    during a back-off runs first (the back-off is a pause, not a block).

    Attributes:
        max_attempts: attempts in all, the first included (1: no retry, the default).
            Attempts that reran a slot after its leader ended mid-run
            (``interrupted="rerun"``) count too.
        backoff_s: the pause before the first retry (0: at once); each next one
            doubles it.
        max_backoff_s: the longest pause.
        on: the errors retried (their subclasses too), a class or a tuple (kept as a
            tuple); any other error is a final failure.
            [`RunFailed`][pgleaderlock.schedule.RunFailed] is an ``Exception``: leave it
            out of ``on`` to make it final.

    Raises:
        ConfigurationError: a value that is not one of the documented ones; the
            message begins with the field's name.
    """

    max_attempts: int = 1
    backoff_s: float = 1.0
    max_backoff_s: float = 60.0
    on: type[Exception] | tuple[type[Exception], ...] = (Exception,)

    def __post_init__(self) -> None:
        count = self.max_attempts
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_ATTEMPTS:
            raise ConfigurationError(
                f"max_attempts must be an int from 1 to {MAX_ATTEMPTS}, got {count!r}"
            )
        backoff = not_negative("backoff_s", self.backoff_s)
        longest = not_negative("max_backoff_s", self.max_backoff_s)
        if longest < backoff:
            raise ConfigurationError(
                f"max_backoff_s must be at least backoff_s ({backoff!r}), got {longest!r}"
            )
        on = self.on
        errors = (on,) if isinstance(on, type) else tuple(on) if isinstance(on, list) else on
        if (
            not isinstance(errors, tuple)
            or not errors
            or not all(isinstance(e, type) and issubclass(e, Exception) for e in errors)
        ):
            raise ConfigurationError(
                "on must be an Exception class or a non-empty tuple of them, got "
                f"{on!r} (BaseException that is not an Exception, such as "
                "asyncio.CancelledError, is never retried)"
            )
        object.__setattr__(self, "backoff_s", backoff)  # an int given: as a float
        object.__setattr__(self, "max_backoff_s", longest)
        object.__setattr__(self, "on", errors)

    def delay_s(self, attempt: int, error: BaseException) -> float | None:
        """The pause before the retry that follows attempt ``attempt`` failing with
        ``error``; ``None``: no retry (the attempts are used up, or ``error`` is not
        one of ``on``)."""
        if attempt >= self.max_attempts or not isinstance(error, self.on):
            return None
        return self.backoff_after(attempt)

    def backoff_after(self, attempt: int) -> float:
        """The pause after attempt ``attempt`` (1, 2, ...): ``backoff_s`` doubled
        ``attempt - 1`` times, at most ``max_backoff_s``."""
        return min(self.backoff_s * 2.0 ** min(max(attempt, 1) - 1, 64), self.max_backoff_s)


@dataclasses.dataclass(frozen=True)
class Policy:
    """The catch-up policy of scheduled jobs, and their retries: one small immutable
    value, checked when it is made.

    ```python
    from pgleaderlock.schedule import Policy, Retry

    policy = Policy(catch_up="all", max_catch_up=10, interrupted="rerun",
                    retry=Retry(max_attempts=3, backoff_s=1.0))
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
        retry: a slot whose job raised (see [`Retry`][pgleaderlock.schedule.Retry]);
            the default, ``Retry()``, makes one attempt: no retry. ``bind_scheduler``
            refuses a policy with retries (APScheduler runs the job); Celery beat's
            integration retries a send that raised.

    Raises:
        ConfigurationError: a value that is not one of the documented ones; the
            message begins with the field's name.
    """

    catch_up: CatchUp = "latest"
    max_catch_up: int = 100
    interrupted: Interrupted = "lost"
    misfire_grace_s: float = 1.0
    retry: Retry = dataclasses.field(default_factory=Retry)

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
        if not isinstance(self.retry, Retry):
            raise ConfigurationError(
                f"retry must be a Retry (from pgleaderlock.schedule import Retry), "
                f"got {self.retry!r}"
            )


class PolicyKeywords(TypedDict, total=False):
    """The keywords that [`Policy`][pgleaderlock.schedule.Policy] replaces: still taken,
    for one release, with a ``DeprecationWarning``."""

    catch_up: CatchUp
    max_catch_up: int
    interrupted: Interrupted
    misfire_grace_s: float


_FIELDS = tuple(PolicyKeywords.__annotations__)
"""The old keywords (``retry`` never was one)."""


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
