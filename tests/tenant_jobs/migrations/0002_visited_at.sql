ALTER TABLE tenant_jobs.visits ADD COLUMN IF NOT EXISTS at timestamptz NOT NULL DEFAULT now();
