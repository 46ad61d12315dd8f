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

-- What locks publish about themselves (LeaderLock(..., metadata=, identity=,
-- priority=, eligible=False)): row-level security lets a session write only its
-- own rows.
DO $pgleaderlock$ BEGIN CREATE TABLE IF NOT EXISTS "public"."pgleaderlock_participants" (key1 int4 NOT NULL, key2 int4 NOT NULL, pid int4 NOT NULL, backend_start timestamptz NOT NULL, identity text NOT NULL, name text, priority int4, eligible bool NOT NULL, metadata jsonb, since timestamptz, term int8, writer name NOT NULL, updated_at timestamptz NOT NULL, reserved_for text, reserved_until timestamptz, reserved_at timestamptz, PRIMARY KEY (key1, key2, pid, identity)); ALTER TABLE "public"."pgleaderlock_participants" ADD COLUMN IF NOT EXISTS reserved_at timestamptz; CREATE INDEX IF NOT EXISTS "pgleaderlock_participants_reserved" ON "public"."pgleaderlock_participants" (key1, key2) WHERE reserved_for IS NOT NULL; ALTER TABLE "public"."pgleaderlock_participants" ENABLE ROW LEVEL SECURITY; ALTER TABLE "public"."pgleaderlock_participants" FORCE ROW LEVEL SECURITY; DROP POLICY IF EXISTS pgleaderlock_delete ON "public"."pgleaderlock_participants"; CREATE POLICY pgleaderlock_delete ON "public"."pgleaderlock_participants" FOR DELETE USING (pid = pg_catalog.pg_backend_pid() OR NOT EXISTS (SELECT 1 FROM pg_catalog.pg_stat_activity a WHERE a.pid = "pgleaderlock_participants".pid AND (a.backend_start IS NULL OR a.backend_start = "pgleaderlock_participants".backend_start))); DROP POLICY IF EXISTS pgleaderlock_insert ON "public"."pgleaderlock_participants"; CREATE POLICY pgleaderlock_insert ON "public"."pgleaderlock_participants" FOR INSERT WITH CHECK ((pid = pg_catalog.pg_backend_pid() AND backend_start = (SELECT a.backend_start FROM pg_catalog.pg_stat_activity a WHERE a.pid = pg_catalog.pg_backend_pid()) AND writer = CURRENT_USER) AND ((reserved_for IS NULL AND reserved_until IS NULL AND reserved_at IS NULL) OR (reserved_at <= pg_catalog.clock_timestamp() AND EXISTS (SELECT 1 FROM pg_catalog.pg_locks l WHERE l.pid = pg_catalog.pg_backend_pid() AND l.granted AND l.locktype = 'advisory'::text AND l.objsubid = 2 AND l.database = (SELECT d.oid FROM pg_catalog.pg_database d WHERE d.datname = pg_catalog.current_database()) AND l.classid = ("pgleaderlock_participants".key1)::oid AND l.objid = ("pgleaderlock_participants".key2)::oid)))); DROP POLICY IF EXISTS pgleaderlock_read ON "public"."pgleaderlock_participants"; CREATE POLICY pgleaderlock_read ON "public"."pgleaderlock_participants" FOR SELECT USING (true); DROP POLICY IF EXISTS pgleaderlock_update ON "public"."pgleaderlock_participants"; CREATE POLICY pgleaderlock_update ON "public"."pgleaderlock_participants" FOR UPDATE USING (pid = pg_catalog.pg_backend_pid()) WITH CHECK ((pid = pg_catalog.pg_backend_pid() AND backend_start = (SELECT a.backend_start FROM pg_catalog.pg_stat_activity a WHERE a.pid = pg_catalog.pg_backend_pid()) AND writer = CURRENT_USER) AND ((reserved_for IS NULL AND reserved_until IS NULL AND reserved_at IS NULL) OR (reserved_at <= pg_catalog.clock_timestamp() AND EXISTS (SELECT 1 FROM pg_catalog.pg_locks l WHERE l.pid = pg_catalog.pg_backend_pid() AND l.granted AND l.locktype = 'advisory'::text AND l.objsubid = 2 AND l.database = (SELECT d.oid FROM pg_catalog.pg_database d WHERE d.datname = pg_catalog.current_database()) AND l.classid = ("pgleaderlock_participants".key1)::oid AND l.objid = ("pgleaderlock_participants".key2)::oid)))); END $pgleaderlock$;

-- Then, for the role that runs the locks (here app_role):
-- GRANT USAGE ON SCHEMA "public" TO "app_role";
-- GRANT SELECT, INSERT, UPDATE ON "public"."pgleaderlock_terms" TO "app_role";
-- GRANT SELECT, INSERT, UPDATE ON "public"."pgleaderlock_subscriptions" TO "app_role";
-- GRANT SELECT, INSERT, UPDATE, DELETE ON "public"."pgleaderlock_runs" TO "app_role";
-- GRANT SELECT, INSERT, UPDATE ON "public"."pgleaderlock_schedules" TO "app_role";
-- GRANT SELECT, INSERT, UPDATE, DELETE ON "public"."pgleaderlock_participants" TO "app_role";
