-- The compose PostgreSQL holds two databases: `mlflow` (POSTGRES_DB, MLflow's backend store) and `optuna`
-- (research studies: `lorafleet research run --storage postgresql+psycopg://lorafleet:…@postgres:5432/optuna`).
-- Separate databases: both keep an `alembic_version` table of their own.
CREATE DATABASE optuna OWNER lorafleet;
