-- The projector example's tables. Idempotent: projector.py and produce.py run it at
-- start (under a transaction-level advisory lock, so that replicas starting together
-- do not race on CREATE ... IF NOT EXISTS).

-- The event log: account deposits and withdrawals, appended by produce.py.
CREATE TABLE IF NOT EXISTS events (
    id         bigserial PRIMARY KEY,
    account    text NOT NULL,
    kind       text NOT NULL CHECK (kind IN ('deposit', 'withdrawal')),
    amount     bigint NOT NULL CHECK (amount > 0),
    created_at timestamptz NOT NULL DEFAULT now()
);

-- Read model of "projection:balances": one row per account.
CREATE TABLE IF NOT EXISTS balances (
    account text PRIMARY KEY,
    balance bigint NOT NULL,
    events  bigint NOT NULL
);

-- Read model of "projection:counts": one row per kind of event.
CREATE TABLE IF NOT EXISTS event_counts (
    kind   text PRIMARY KEY,
    events bigint NOT NULL,
    amount bigint NOT NULL
);

-- Which projection applied which event, under which fencing term. No unique key on
-- purpose: an event applied twice shows up as two rows instead of failing the batch.
-- (A real application would declare PRIMARY KEY (projection, event_id).)
CREATE TABLE IF NOT EXISTS applied_events (
    projection text NOT NULL,
    event_id   bigint NOT NULL,
    term       bigint NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS applied_events_projection_event
    ON applied_events (projection, event_id);

-- Every insert into events wakes the projectors up (one notification per transaction).
CREATE OR REPLACE FUNCTION projector_notify_events() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('projector_events', '');
    RETURN NULL;
END
$$;
CREATE OR REPLACE TRIGGER events_notify AFTER INSERT ON events
    FOR EACH STATEMENT EXECUTE FUNCTION projector_notify_events();
