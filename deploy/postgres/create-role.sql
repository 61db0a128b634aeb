-- powerd's PostgreSQL role and database, with no more rights than powerd uses.
--
--   psql -h DB-HOST -U postgres -v ON_ERROR_STOP=1 \
--        -v role=powerd -v db=powerd [-v reader=powerd_reader] \
--        -f deploy/postgres/create-role.sql
--   psql -h DB-HOST -U postgres -c '\password powerd'      # then, interactively
--
-- Run it as a superuser (or a role with CREATEROLE and CREATEDB), once per database: the
-- controllers' (db=powerd) and the coordinators' (db=powerd_coordinator), with the same
-- role or another. Running it again changes nothing that exists. `-v password=...` sets
-- the role's password from a script (it shows in the process list: prefer \password).
--
-- What the role gets (docs/operations.md, "PostgreSQL"):
--   * LOGIN and nothing else: not a superuser, cannot create databases or roles, cannot
--     replicate, does not bypass row security.
--   * CONNECT on its database only (PUBLIC's default rights there are revoked), which
--     another role owns, so powerd cannot drop or alter the database itself.
--   * Its own schema `powerd` in that database, first on its search_path: the migrations
--     (`powerd db upgrade`, or the controller at start) create the tables there. Nothing in
--     `public`.
-- `reader` (optional): a login that can only read powerd's tables, with every transaction
-- read-only: for a shadow controller (docs/operations.md, "Shadow mode") and dashboards.
-- tests/test_pg_role.py runs this file and checks each of these.

\set ON_ERROR_STOP on
\if :{?role}
\else
  \set role powerd
\endif
\if :{?db}
\else
  \set db powerd
\endif

SELECT format(
  'CREATE ROLE %I LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS '
  'NOINHERIT', :'role')
WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'role') \gexec
\if :{?password}
  SELECT format('ALTER ROLE %I PASSWORD %L', :'role', :'password') \gexec
\endif

SELECT format('CREATE DATABASE %I', :'db')
WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = :'db') \gexec
SELECT format('REVOKE ALL ON DATABASE %I FROM PUBLIC', :'db') \gexec
SELECT format('GRANT CONNECT ON DATABASE %I TO %I', :'db', :'role') \gexec
SELECT format('ALTER ROLE %I IN DATABASE %I SET search_path = powerd', :'role', :'db') \gexec

\connect :"db"
-- PostgreSQL before 15 lets every role create tables in `public`.
REVOKE CREATE ON SCHEMA public FROM PUBLIC;
SELECT format('CREATE SCHEMA IF NOT EXISTS powerd AUTHORIZATION %I', :'role') \gexec

\if :{?reader}
  SELECT format(
    'CREATE ROLE %I LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS '
    'NOINHERIT CONNECTION LIMIT 16', :'reader')
  WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'reader') \gexec
  SELECT format('ALTER ROLE %I SET default_transaction_read_only = on', :'reader') \gexec
  SELECT format('GRANT CONNECT ON DATABASE %I TO %I', :'db', :'reader') \gexec
  SELECT format('ALTER ROLE %I IN DATABASE %I SET search_path = powerd', :'reader', :'db')
  \gexec
  SELECT format('GRANT USAGE ON SCHEMA powerd TO %I', :'reader') \gexec
  SELECT format('GRANT SELECT ON ALL TABLES IN SCHEMA powerd TO %I', :'reader') \gexec
  -- Tables the migrations make later, too.
  SELECT format(
    'ALTER DEFAULT PRIVILEGES FOR ROLE %I IN SCHEMA powerd GRANT SELECT ON TABLES TO %I',
    :'role', :'reader') \gexec
\endif
