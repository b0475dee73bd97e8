-- The module's schema, shared by every deployment that loads the module.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = 'tenant_jobs') THEN
        CREATE SCHEMA tenant_jobs;
    END IF;
END
$$;
CREATE TABLE IF NOT EXISTS tenant_jobs.visits (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    deployment text   NOT NULL,
    run_id     bigint NOT NULL
);
