"""What a fencing term says about the server's timeline, and the warning after a
timeline change.

A term's high 32 bits are the timeline of the primary that wrote it
([`bump_term_statement`][pgleaderlock.backends.sql.bump_term_statement]): a promoted
standby starts a new timeline, so its first term of a lock is ``timeline << 32 | 1``,
above every term of the old primary. With **asynchronous** replication the old primary
may have acknowledged commits that never reached the standby: whatever was committed
there after the last replicated point is gone on the new timeline (ledger claims, so
those slots can run again; checkpoints, which move back; any fenced rows). When a
fenced lock becomes leader on a newer timeline than the last term known (the term row's
previous term on the new primary, or the last term this process saw), the engine logs
``timeline_changed`` once, at WARNING (see ``docs/guarantees.md``, "What survives a
failover").
"""

from __future__ import annotations

import datetime as dt

__all__ = ["BumpedTerm", "timeline_change", "timeline_of"]

DOCS = "docs/guarantees.md#what-survives-a-failover"
"""Where the warning points."""

MAY_BE_LOST = (
    "unless replication was synchronous, commits the old primary acknowledged after its "
    "last replicated point are gone: ledger claims (those slots can run again), "
    "checkpoints (they move back) and fenced rows"
)


def timeline_of(term: int) -> int:
    """The server timeline that wrote ``term`` (its high 32 bits; 0 for a term from
    before terms carried it)."""
    return term >> 32


class BumpedTerm(int):
    """A new fencing term, as a backend's ``bump_term`` returns it, with what the term
    row held before the bump on that server (an ``int``: sessions that know nothing of
    the row may return a plain one).

    Attributes:
        prior: the row's previous term (``None``: there was no row).
        prior_at: when that previous leadership began (the row's ``acquired_at``).
    """

    prior: int | None
    prior_at: dt.datetime | None

    def __new__(
        cls, term: int, prior: int | None = None, prior_at: dt.datetime | None = None
    ) -> BumpedTerm:
        made = super().__new__(cls, term)
        made.prior = prior
        made.prior_at = prior_at
        return made


def timeline_change(
    term: int,
    prior: int | None,
    prior_at: dt.datetime | None,
    seen: int | None,
) -> dict[str, object] | None:
    """The fields of the ``timeline_changed`` warning, or ``None`` when there is none to
    give: ``term`` (the new leadership's) is on a later timeline than the latest of
    ``prior`` (the term row's previous term on this server) and ``seen`` (the last term
    this process knew of the lock). Terms of timeline 0 (before terms carried the
    timeline) and an unknown past say nothing."""
    known = [t for t in (prior, seen) if t is not None and timeline_of(t) > 0]
    if not known:
        return None
    last = max(known)
    if timeline_of(term) <= timeline_of(last):
        return None
    fields: dict[str, object] = {
        "from_timeline": timeline_of(last),
        "to_timeline": timeline_of(term),
        "term": term,
        "last_known_term": prior,
    }
    if prior_at is not None:
        fields["since"] = prior_at.isoformat()
    if seen is not None and (prior is None or seen > prior):
        fields["lost_term"] = seen  # this process led under a term the new primary lacks
    fields["may_be_lost"] = MAY_BE_LOST
    fields["docs"] = DOCS
    return fields
