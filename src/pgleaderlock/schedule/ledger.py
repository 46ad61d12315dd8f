"""The ledger of scheduled runs: one row per (schedule, slot), in PostgreSQL.

A slot's row is written once, by the leader, on the session that holds the lock, under
the lock's current fencing term (checked in the same statement): the primary key
makes a slot claimable at most once, ever, across failovers and restarts. The row then
records what became of the slot:

| outcome   | meaning                                                                   |
|-----------|---------------------------------------------------------------------------|
| `running` | claimed, its job started (under ``term``)                                 |
| `done`    | the job returned (or its ``run.transaction`` committed)                   |
| `failed`  | the job raised (``detail`` says what); no ``finished_at``: a retry is due |
| `sent`    | handed to another system (Celery beat sent the task)                      |
| `executed`| a worker began the work handed over (``SlotGuard``); no other copy will  |
| `lost`    | its leader died mid-run and the schedule does not run it again            |
| `missed`  | it fell due while nobody led, and the catch-up policy skipped it          |

A second table keeps one row per schedule: its spec, since when it exists (slots before
that were never due), and its next slot (for ``pgleaderlock status``).

Every statement here is one of the library's own, on trusted tables named with their
schema (see [`LibraryTable`][pgleaderlock.core.tables.LibraryTable]).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

from ..lowlevel import LibraryTable, TermTable

__all__ = [
    "ADMITTED",
    "OUTCOMES",
    "OUTCOME_CHECK",
    "WORKER_COLUMNS",
    "WORKER_POLICY",
    "Ledger",
    "RunTable",
    "ScheduleTable",
    "WorkerRunTable",
]

OUTCOMES = ("running", "done", "failed", "sent", "executed", "lost", "missed")
"""What a run's row can record (see the module's table): the runs table's ``CHECK``
(`OUTCOME_CHECK`) refuses any other text."""

ADMITTED = ("running", "sent", "failed", "lost")
"""The outcomes a worker's [`SlotGuard`][pgleaderlock.schedule.SlotGuard] may turn into
``executed``: a slot handed over (``sent``), or whose hand-over was not recorded as such
(still ``running``, or ``failed``/``lost`` after the send may have left). A ``done``
slot ran on its leader, an ``executed`` one on a worker already, a ``missed`` one never."""

OUTCOME_CHECK = "pgleaderlock_outcome"
"""The name of the runs table's ``CHECK`` constraint on ``outcome`` (one of
`OUTCOMES`); ``pgleaderlock doctor`` looks for it."""

WORKER_POLICY = "pgleaderlock_worker"
"""The name of the runs table's restrictive row-level security policy: a role that may
update the runs but not insert into them (a worker's) may only record ``executed``, on
a slot whose outcome is one of `ADMITTED`; ``pgleaderlock doctor`` looks for it."""

WORKER_COLUMNS: dict[str, tuple[str, ...]] = {
    "SELECT": ("schedule", "slot", "term", "outcome", "finished_at"),
    "UPDATE": ("outcome", "finished_at", "detail"),
}
"""What a worker's ``admit`` statement reads and writes: all a worker's role is granted
(``pgleaderlock sql --worker-role``)."""


def _array(values: tuple[str, ...]) -> str:
    return "ARRAY[" + ", ".join(f"'{v}'" for v in values) + "]"


@dataclass(frozen=True)
class RunTable(LibraryTable):
    """The runs: one row per (schedule, slot)."""

    name: str = "pgleaderlock_runs"

    knobs: ClassVar[tuple[str, str]] = ("runs_table", "schema")
    privileges: ClassVar[tuple[str, ...]] = ("SELECT", "INSERT", "UPDATE", "DELETE")
    columns: ClassVar[str] = (
        "schedule text NOT NULL, slot timestamptz NOT NULL, term int8 NOT NULL,"
        " holder text, outcome text NOT NULL, attempt int4 NOT NULL DEFAULT 1,"
        " claimed_at timestamptz NOT NULL, started_at timestamptz,"
        " finished_at timestamptz, detail text, PRIMARY KEY (schedule, slot),"
        f" CONSTRAINT {OUTCOME_CHECK} CHECK (outcome = ANY ({_array(OUTCOMES)}))"
    )

    @property
    def create(self) -> str:
        """The table, then (in one ``DO`` block, each step only if missing, so that it
        also upgrades a table made by an older version): the ``CHECK`` on ``outcome``,
        row-level security, a policy that lets every role with privileges on the table
        use them as granted (``pgleaderlock_all``), and the restrictive
        `WORKER_POLICY`: a role that may not ``INSERT`` into the runs (a worker's,
        see `WorkerRunTable`) may only update a row whose outcome is one of `ADMITTED`,
        and only to ``executed``. The table's owner, superusers and roles that may
        insert (the leaders') are not limited by it."""
        t = self.sql
        oid = "'" + t.replace("'", "''") + "'::regclass"
        leader = f"pg_catalog.has_table_privilege({oid}, 'INSERT')"
        policy = f"SELECT 1 FROM pg_catalog.pg_policy WHERE polrelid = {oid} AND polname = "
        return (
            "DO $pgleaderlock$ BEGIN"
            f" CREATE TABLE IF NOT EXISTS {t} ({self.columns});"
            " IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_constraint"
            f" WHERE conrelid = {oid} AND conname = '{OUTCOME_CHECK}') THEN"
            f" ALTER TABLE {t} ADD CONSTRAINT {OUTCOME_CHECK}"
            f" CHECK (outcome = ANY ({_array(OUTCOMES)})); END IF;"
            f" IF NOT (SELECT relrowsecurity FROM pg_catalog.pg_class WHERE oid = {oid}) THEN"
            f" ALTER TABLE {t} ENABLE ROW LEVEL SECURITY; END IF;"
            f" IF NOT EXISTS ({policy}'pgleaderlock_all') THEN"
            f" CREATE POLICY pgleaderlock_all ON {t} USING (true) WITH CHECK (true); END IF;"
            f" IF NOT EXISTS ({policy}'{WORKER_POLICY}') THEN"
            f" CREATE POLICY {WORKER_POLICY} ON {t} AS RESTRICTIVE FOR UPDATE"
            f" USING ({leader} OR outcome = ANY ({_array(ADMITTED)}))"
            f" WITH CHECK ({leader} OR outcome = 'executed'); END IF;"
            " END $pgleaderlock$"
        )

    @property
    def admit(self) -> str:
        """``{0}`` schedule, ``{1}`` slot, ``{2}`` the worker: a worker is about to begin
        the slot's work that the leader handed over (a task Celery beat sent): record the
        slot ``executed``, if its outcome is one of `ADMITTED`. A row back (the term that
        claimed the slot): begin; none: another copy of the work began (or the slot has
        no row, ran on its leader, or nobody ran it: ``missed``). A send the ledger
        recorded ``lost`` or ``failed`` may still have reached the worker: it admits, as
        the slot's one copy. It reads and writes only the columns of `WORKER_COLUMNS`."""
        return (
            f"UPDATE {self.sql} SET outcome = 'executed', detail = 'by ' || ({{2}})::text,"
            " finished_at = coalesce(finished_at, pg_catalog.clock_timestamp())"
            " WHERE schedule = ({0})::text AND slot = ({1})::timestamptz"
            f" AND outcome = ANY ({_array(ADMITTED)}) RETURNING term"
        )


@dataclass(frozen=True)
class WorkerRunTable(RunTable):
    """The runs, as a worker behind a [`SlotGuard`][pgleaderlock.schedule.SlotGuard]
    uses them: it reads five columns and updates three (`WORKER_COLUMNS`), nothing else.
    The runs table's row-level security (see
    [`RunTable.create`][pgleaderlock.schedule.ledger.RunTable.create]) lets such a role record
    only ``executed``."""

    privileges: ClassVar[tuple[str, ...]] = ()
    column_privileges: ClassVar[dict[str, tuple[str, ...]]] = WORKER_COLUMNS


@dataclass(frozen=True)
class ScheduleTable(LibraryTable):
    """The schedules: one row each, with its spec, since when it exists and its next
    slot."""

    name: str = "pgleaderlock_schedules"

    knobs: ClassVar[tuple[str, str]] = ("schedules_table", "schema")
    columns: ClassVar[str] = (
        "schedule text PRIMARY KEY, spec text NOT NULL, since timestamptz NOT NULL,"
        " next_slot timestamptz, updated_at timestamptz NOT NULL"
    )


@dataclass(frozen=True)
class Ledger:
    """The statements on a schedule's tables. Parameters are numbered ``{0}``, ...,
    each cast explicitly (every driver sends them the same way)."""

    runs: RunTable
    schedules: ScheduleTable
    terms: TermTable

    def _term_ok(self, term: str, key1: str, key2: str) -> str:
        """A condition: the lock's term row still holds ``term`` (the claim's leader
        has not been followed by another)."""
        return (
            f"EXISTS (SELECT 1 FROM {self.terms.sql} WHERE key1 = ({key1})::int4"
            f" AND key2 = ({key2})::int4 AND term = ({term})::int8)"
        )

    @functools.cached_property
    def register(self) -> str:
        """``{0}`` schedule, ``{1}`` spec, ``{2}`` the oldest slot to keep rows of:
        upsert the schedule (a changed spec starts it afresh: ``since`` = now), prune
        old rows, and return ``since``, the newest slot with a row, and the server's
        time."""
        s, r = self.schedules.sql, self.runs.sql
        return (
            f"WITH up AS (INSERT INTO {s} AS s (schedule, spec, since, updated_at)"
            " VALUES (({0})::text, ({1})::text, pg_catalog.clock_timestamp(),"
            " pg_catalog.clock_timestamp()) ON CONFLICT (schedule) DO UPDATE SET"
            " spec = EXCLUDED.spec, updated_at = EXCLUDED.updated_at,"
            " since = CASE WHEN s.spec = EXCLUDED.spec THEN s.since ELSE EXCLUDED.since END"
            " RETURNING since),"
            f" pruned AS (DELETE FROM {r} WHERE schedule = ({{0}})::text"
            " AND slot < ({2})::timestamptz AND slot < (SELECT max(slot) FROM"
            f" {r} WHERE schedule = ({{0}})::text))"
            " SELECT (SELECT since FROM up),"
            f" (SELECT max(slot) FROM {r} WHERE schedule = ({{0}})::text),"
            " pg_catalog.clock_timestamp()"
        )

    @functools.cached_property
    def interrupted(self) -> str:
        """``{0}`` schedule, ``{1}`` term: the slots still ``running`` under an older
        term (their leader died mid-run), oldest first (at most 1,000)."""
        return (
            f"SELECT slot FROM {self.runs.sql} WHERE schedule = ({{0}})::text"
            " AND outcome = 'running' AND term < ({1})::int8 ORDER BY slot LIMIT 1000"
        )

    @functools.cached_property
    def retries(self) -> str:
        """``{0}`` schedule: the slots whose last attempt failed with a retry due
        (``failed`` without ``finished_at``), oldest first (at most 1,000), with that
        attempt."""
        return (
            f"SELECT slot, attempt FROM {self.runs.sql} WHERE schedule = ({{0}})::text"
            " AND outcome = 'failed' AND finished_at IS NULL ORDER BY slot LIMIT 1000"
        )

    @functools.cached_property
    def give_up(self) -> str:
        """``{0}`` schedule, ``{1}`` slots, ``{2}`` term, ``{3}`` ``{4}`` keys: a retry
        due for ``slots`` will not come (the schedule's policy allows no more
        attempts): their failure is final. Returns how many, and whether the term
        holds."""
        return (
            f"WITH ok AS (SELECT {self._term_ok('{2}', '{3}', '{4}')} AS held),"
            f" up AS (UPDATE {self.runs.sql} SET finished_at = pg_catalog.clock_timestamp()"
            " WHERE schedule = ({0})::text AND slot = ANY(({1})::timestamptz[])"
            " AND outcome = 'failed' AND finished_at IS NULL AND (SELECT held FROM ok)"
            " RETURNING 1)"
            " SELECT (SELECT count(*) FROM up), (SELECT held FROM ok)"
        )

    @functools.cached_property
    def claim(self) -> str:
        """``{0}`` schedule, ``{1}`` slot, ``{2}`` term, ``{3}`` ``{4}`` the lock's keys,
        ``{5}`` holder, ``{6}`` rerun (may take over a slot left ``running`` by an older
        term), ``{7}`` the schedule's next slot (``NULL``: unchanged), ``{8}`` outcome
        (``running`` or ``sent``), ``{9}`` a retry's ``max_attempts`` (may take over a
        slot whose last attempt failed with a retry due, if it made fewer attempts; 0:
        not a retry):
        claim the slot if the server's clock has reached it and the term holds.
        Returns the server's time, the attempt (``NULL``: not claimed) and whether the
        term holds. A ``done`` (or ``sent``, ``executed``, ``missed``, ``lost``) slot
        is never claimed again."""
        r, s = self.runs.sql, self.schedules.sql
        now = "pg_catalog.clock_timestamp()"
        return (
            f"WITH ok AS (SELECT {self._term_ok('{2}', '{3}', '{4}')} AS held),"
            f" ins AS (INSERT INTO {r} AS r (schedule, slot, term, holder, outcome,"
            " claimed_at, started_at)"
            f" SELECT ({{0}})::text, ({{1}})::timestamptz, ({{2}})::int8, ({{5}})::text,"
            f" ({{8}})::text, {now}, {now} FROM ok WHERE ok.held"
            f" AND {now} >= ({{1}})::timestamptz"
            " ON CONFLICT (schedule, slot) DO UPDATE SET term = EXCLUDED.term,"
            " holder = EXCLUDED.holder, outcome = EXCLUDED.outcome,"
            " attempt = r.attempt + 1, claimed_at = EXCLUDED.claimed_at,"
            " started_at = EXCLUDED.started_at, finished_at = NULL, detail = NULL"
            " WHERE (({6})::bool AND r.outcome = 'running' AND r.term < EXCLUDED.term)"
            " OR (r.outcome = 'failed' AND r.finished_at IS NULL"
            " AND r.attempt < ({9})::int4)"
            " RETURNING attempt),"
            f" nxt AS (UPDATE {s} SET next_slot = coalesce(({{7}})::timestamptz, next_slot),"
            f" updated_at = {now} WHERE schedule = ({{0}})::text"
            " AND (SELECT held FROM ok))"
            f" SELECT {now}, (SELECT attempt FROM ins), (SELECT held FROM ok)"
        )

    @functools.cached_property
    def miss(self) -> str:
        """``{0}`` schedule, ``{1}`` slots, ``{2}`` term, ``{3}`` ``{4}`` keys, ``{5}``
        holder: record ``slots`` as ``missed`` (those with a row keep it). Returns how
        many were recorded and whether the term holds."""
        return (
            f"WITH ok AS (SELECT {self._term_ok('{2}', '{3}', '{4}')} AS held),"
            f" ins AS (INSERT INTO {self.runs.sql} (schedule, slot, term, holder, outcome,"
            " claimed_at) SELECT ({0})::text, s, ({2})::int8, ({5})::text, 'missed',"
            " pg_catalog.clock_timestamp()"
            " FROM ok, pg_catalog.unnest(({1})::timestamptz[]) AS s WHERE ok.held"
            " ON CONFLICT (schedule, slot) DO NOTHING RETURNING 1)"
            " SELECT (SELECT count(*) FROM ins), (SELECT held FROM ok)"
        )

    @functools.cached_property
    def lose(self) -> str:
        """``{0}`` schedule, ``{1}`` slots, ``{2}`` term, ``{3}`` ``{4}`` keys: record
        slots left ``running`` by an older term as ``lost``. Returns how many."""
        return (
            f"WITH ok AS (SELECT {self._term_ok('{2}', '{3}', '{4}')} AS held),"
            f" up AS (UPDATE {self.runs.sql} SET outcome = 'lost',"
            " finished_at = pg_catalog.clock_timestamp(),"
            " detail = 'its leader (term ' || term || ') ended mid-run'"
            " WHERE schedule = ({0})::text AND slot = ANY(({1})::timestamptz[])"
            " AND outcome = 'running' AND term < ({2})::int8 AND (SELECT held FROM ok)"
            " RETURNING 1)"
            " SELECT (SELECT count(*) FROM up), (SELECT held FROM ok)"
        )

    @functools.cached_property
    def finish(self) -> str:
        """``{0}`` schedule, ``{1}`` slot, ``{2}`` term, ``{3}`` outcome, ``{4}``
        detail, ``{5}`` a retry is due (``finished_at`` stays ``NULL``): record how a
        run of this term ended, unless something else did already
        (``run.transaction``). Never waits for a row lock: a row a transaction holds is
        left to it. Returns a row if it recorded."""
        r = self.runs.sql
        return (
            f"UPDATE {r} SET outcome = ({{3}})::text, finished_at = CASE WHEN ({{5}})::bool"
            " THEN NULL ELSE pg_catalog.clock_timestamp() END, detail = ({4})::text"
            f" WHERE (schedule, slot) IN (SELECT schedule, slot FROM {r}"
            " WHERE schedule = ({0})::text AND slot = ({1})::timestamptz"
            " AND term = ({2})::int8 AND outcome = 'running' FOR UPDATE SKIP LOCKED)"
            " RETURNING 1"
        )

    @functools.cached_property
    def done(self) -> str:
        """``{0}`` schedule, ``{1}`` slot, ``{2}`` term: in the job's own (fenced)
        transaction, mark the run ``done``. No row: another term took the slot over."""
        return (
            f"UPDATE {self.runs.sql} SET outcome = 'done',"
            " finished_at = pg_catalog.clock_timestamp()"
            " WHERE schedule = ({0})::text AND slot = ({1})::timestamptz"
            " AND term = ({2})::int8 AND outcome = 'running' RETURNING 1"
        )
