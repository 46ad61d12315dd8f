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
-- and one per schedule. The runs' outcome is CHECKed; their row-level security
-- holds a worker's role (pgleaderlock sql --worker-role) to recording 'executed'.
-- Run again on an existing install, it adds what an older version lacked.
DO $pgleaderlock$ BEGIN CREATE TABLE IF NOT EXISTS "public"."pgleaderlock_runs" (schedule text NOT NULL, slot timestamptz NOT NULL, term int8 NOT NULL, holder text, outcome text NOT NULL, attempt int4 NOT NULL DEFAULT 1, claimed_at timestamptz NOT NULL, started_at timestamptz, finished_at timestamptz, detail text, PRIMARY KEY (schedule, slot), CONSTRAINT pgleaderlock_outcome CHECK (outcome = ANY (ARRAY['running', 'done', 'failed', 'sent', 'executed', 'lost', 'missed']))); IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_constraint WHERE conrelid = '"public"."pgleaderlock_runs"'::regclass AND conname = 'pgleaderlock_outcome') THEN ALTER TABLE "public"."pgleaderlock_runs" ADD CONSTRAINT pgleaderlock_outcome CHECK (outcome = ANY (ARRAY['running', 'done', 'failed', 'sent', 'executed', 'lost', 'missed'])); END IF; IF NOT (SELECT relrowsecurity FROM pg_catalog.pg_class WHERE oid = '"public"."pgleaderlock_runs"'::regclass) THEN ALTER TABLE "public"."pgleaderlock_runs" ENABLE ROW LEVEL SECURITY; END IF; IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_policy WHERE polrelid = '"public"."pgleaderlock_runs"'::regclass AND polname = 'pgleaderlock_all') THEN CREATE POLICY pgleaderlock_all ON "public"."pgleaderlock_runs" USING (true) WITH CHECK (true); END IF; IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_policy WHERE polrelid = '"public"."pgleaderlock_runs"'::regclass AND polname = 'pgleaderlock_worker') THEN CREATE POLICY pgleaderlock_worker ON "public"."pgleaderlock_runs" AS RESTRICTIVE FOR UPDATE USING (pg_catalog.has_table_privilege('"public"."pgleaderlock_runs"'::regclass, 'INSERT') OR outcome = ANY (ARRAY['running', 'sent', 'failed', 'lost'])) WITH CHECK (pg_catalog.has_table_privilege('"public"."pgleaderlock_runs"'::regclass, 'INSERT') OR outcome = 'executed'); END IF; END $pgleaderlock$;
CREATE TABLE IF NOT EXISTS "public"."pgleaderlock_schedules" (schedule text PRIMARY KEY, spec text NOT NULL, since timestamptz NOT NULL, next_slot timestamptz, updated_at timestamptz NOT NULL);

-- What locks publish about themselves (LeaderLock(..., metadata=, identity=,
-- priority=, eligible=False)): row-level security lets a session write only its
-- own rows.
DO $pgleaderlock$ BEGIN CREATE TABLE IF NOT EXISTS "public"."pgleaderlock_participants" (key1 int4 NOT NULL, key2 int4 NOT NULL, pid int4 NOT NULL, backend_start timestamptz NOT NULL, identity text NOT NULL, name text, priority int4, eligible bool NOT NULL, metadata jsonb, since timestamptz, term int8, writer name NOT NULL, updated_at timestamptz NOT NULL, reserved_for text, reserved_until timestamptz, PRIMARY KEY (key1, key2, pid, identity)); ALTER TABLE "public"."pgleaderlock_participants" ENABLE ROW LEVEL SECURITY; ALTER TABLE "public"."pgleaderlock_participants" FORCE ROW LEVEL SECURITY; IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_policy WHERE polrelid = '"public"."pgleaderlock_participants"'::regclass AND polname = 'pgleaderlock_read') THEN CREATE POLICY pgleaderlock_read ON "public"."pgleaderlock_participants" FOR SELECT USING (true); CREATE POLICY pgleaderlock_insert ON "public"."pgleaderlock_participants" FOR INSERT WITH CHECK (pid = pg_catalog.pg_backend_pid() AND backend_start = (SELECT a.backend_start FROM pg_catalog.pg_stat_activity a WHERE a.pid = pg_catalog.pg_backend_pid()) AND writer = current_user); CREATE POLICY pgleaderlock_update ON "public"."pgleaderlock_participants" FOR UPDATE USING (pid = pg_catalog.pg_backend_pid()) WITH CHECK (pid = pg_catalog.pg_backend_pid() AND backend_start = (SELECT a.backend_start FROM pg_catalog.pg_stat_activity a WHERE a.pid = pg_catalog.pg_backend_pid()) AND writer = current_user); CREATE POLICY pgleaderlock_delete ON "public"."pgleaderlock_participants" FOR DELETE USING (pid = pg_catalog.pg_backend_pid() OR NOT EXISTS (SELECT 1 FROM pg_catalog.pg_stat_activity a WHERE a.pid = "pgleaderlock_participants".pid AND (a.backend_start IS NULL OR a.backend_start = "pgleaderlock_participants".backend_start))); END IF; END $pgleaderlock$;

-- Then, for the role that runs the locks (here app_role):
-- GRANT USAGE ON SCHEMA "public" TO "app_role";
-- GRANT SELECT, INSERT, UPDATE ON "public"."pgleaderlock_terms" TO "app_role";
-- GRANT SELECT, INSERT, UPDATE ON "public"."pgleaderlock_subscriptions" TO "app_role";
-- GRANT SELECT, INSERT, UPDATE, DELETE ON "public"."pgleaderlock_runs" TO "app_role";
-- GRANT SELECT, INSERT, UPDATE ON "public"."pgleaderlock_schedules" TO "app_role";
-- GRANT SELECT, INSERT, UPDATE, DELETE ON "public"."pgleaderlock_participants" TO "app_role";
