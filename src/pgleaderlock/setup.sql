-- pgleaderlock: the library's tables, made beforehand by a migration (run it as
-- the role that is to own them; the library trusts a table only when its owner is
-- the lock's own role, a superuser, or a role named in trusted_roles).
-- The lock's role then needs no CREATE anywhere: only what is granted below.

-- Fencing terms (LeaderLock(..., fencing=True), Coordinator(..., fencing=True)).
CREATE TABLE IF NOT EXISTS "public"."pgleaderlock_terms" (key1 int4 NOT NULL, key2 int4 NOT NULL, term int8 NOT NULL, holder text, acquired_at timestamptz NOT NULL, PRIMARY KEY (key1, key2));

-- Checkpoints of a Coordinator's named workers (one row per '<group>:<name>').
CREATE TABLE IF NOT EXISTS "public"."pgleaderlock_subscriptions" (subscription_name text PRIMARY KEY, last_position bigint, updated_at timestamptz NOT NULL DEFAULT pg_catalog.now());

-- The schedule ledger (pgleaderlock.schedule.Scheduler, the Celery beat and
-- APScheduler integrations, pgleaderlock cron): one row per (schedule, slot),
-- and one per schedule.
CREATE TABLE IF NOT EXISTS "public"."pgleaderlock_runs" (schedule text NOT NULL, slot timestamptz NOT NULL, term int8 NOT NULL, holder text, outcome text NOT NULL, attempt int4 NOT NULL DEFAULT 1, claimed_at timestamptz NOT NULL, started_at timestamptz, finished_at timestamptz, detail text, PRIMARY KEY (schedule, slot));
CREATE TABLE IF NOT EXISTS "public"."pgleaderlock_schedules" (schedule text PRIMARY KEY, spec text NOT NULL, since timestamptz NOT NULL, next_slot timestamptz, updated_at timestamptz NOT NULL);

-- Then, for the role that runs the locks (here app_role):
-- GRANT USAGE ON SCHEMA "public" TO "app_role";
-- GRANT SELECT, INSERT, UPDATE ON "public"."pgleaderlock_terms" TO "app_role";
-- GRANT SELECT, INSERT, UPDATE ON "public"."pgleaderlock_subscriptions" TO "app_role";
-- GRANT SELECT, INSERT, UPDATE, DELETE ON "public"."pgleaderlock_runs" TO "app_role";
-- GRANT SELECT, INSERT, UPDATE ON "public"."pgleaderlock_schedules" TO "app_role";
