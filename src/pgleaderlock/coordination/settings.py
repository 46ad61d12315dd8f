"""A coordinator's validated settings, which every part of a member reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..lowlevel import Backend, LockConfig, RetryStrategy, SessionFactory, TermTable
from .workers import CheckpointTable

__all__ = ["Settings"]


@dataclass(frozen=True)
class Settings:
    """A coordinator's validated settings (see [`Coordinator`][pgleaderlock.Coordinator])."""

    group: str
    member: str
    config: LockConfig
    retry: RetryStrategy
    backend: Backend | None
    dsn: Any = field(repr=False)  # it may hold a password
    """The DSN the backend's driver takes (``resolve``'s)."""
    user_dsn: Any = field(repr=False)
    """The DSN as given (a LeaderLock resolves it again)."""
    connect_fn: SessionFactory | None
    checkpoints: CheckpointTable
    give_away_after_crashes: int | None
    give_away_cooldown_s: float
    balance_interval_s: float
    idle_tick_s: float
    lock_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def terms(self) -> TermTable | None:
        return self.config.term_table
