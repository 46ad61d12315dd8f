"""Coordinated workers: many named workers across the replicas of a service, each name
run by exactly one replica at a time, balanced, with fenced checkpoints.

[`Coordinator`][pgleaderlock.Coordinator] is built on the core: in dedicated session
mode on one [`LeaderLock`][pgleaderlock.LeaderLock] per name, in shared session mode on
one session per replica that holds all its names' locks.
"""

from __future__ import annotations

from .coordinator import Coordinator
from .member import GroupView
from .workers import WorkerContext, WorkerFunction

__all__ = ["Coordinator", "GroupView", "WorkerContext", "WorkerFunction"]
