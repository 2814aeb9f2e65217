#!/usr/bin/env bash
# Services the tests need: a local PostgreSQL server with a test role and database, for the
# distributed Optuna tests (tests/test_distributed.py). Idempotent: installs PostgreSQL from the
# distribution's packages when missing, starts it when it is down, creates what is missing.
#
#   role autotune / password autotune / database autotune_test on 127.0.0.1:5432
#   (tests read AUTOTUNE_TEST_PG_URL, default postgresql://autotune:autotune@127.0.0.1:5432/autotune_test)
#
# Exports nothing. Needs root (or a user allowed to run apt-get and `su postgres`).
set -euo pipefail

PG_USER=autotune
PG_PASSWORD=autotune
PG_DB=autotune_test
PG_PORT=5432

log() { echo "services: $*"; }

if ! command -v pg_ctlcluster >/dev/null 2>&1; then
    log "installing postgresql from the distribution's packages"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq postgresql >/dev/null
fi

# the newest installed cluster (Debian creates "main" when it installs the server)
read -r PG_VER PG_CLUSTER < <(pg_lsclusters --no-header 2>/dev/null | awk '{print $1, $2}' | sort -V | tail -1) || true
if [ -z "${PG_VER:-}" ]; then
    PG_VER=$(ls /usr/lib/postgresql | sort -V | tail -1)
    PG_CLUSTER=main
    log "creating cluster $PG_VER/$PG_CLUSTER"
    pg_createcluster "$PG_VER" "$PG_CLUSTER" --port "$PG_PORT" >/dev/null
fi

if ! pg_lsclusters --no-header | awk -v v="$PG_VER" -v c="$PG_CLUSTER" '$1==v && $2==c {print $4}' | grep -q online; then
    log "starting PostgreSQL $PG_VER/$PG_CLUSTER"
    pg_ctlcluster "$PG_VER" "$PG_CLUSTER" start || service postgresql start
fi

# wait until it accepts connections (up to 30 s)
for _ in $(seq 1 60); do
    if su postgres -c "psql -p $PG_PORT -Atqc 'select 1'" >/dev/null 2>&1; then
        break
    fi
    sleep 0.5
done

psql_admin() { su postgres -c "psql -p $PG_PORT -v ON_ERROR_STOP=1 -Atqc \"$1\""; }

if [ "$(psql_admin "select 1 from pg_roles where rolname='$PG_USER'")" != "1" ]; then
    log "creating role $PG_USER"
    psql_admin "create role $PG_USER login password '$PG_PASSWORD'"
fi
if [ "$(psql_admin "select 1 from pg_database where datname='$PG_DB'")" != "1" ]; then
    log "creating database $PG_DB"
    psql_admin "create database $PG_DB owner $PG_USER"
fi

# password login over TCP on 127.0.0.1 (Debian's default pg_hba.conf allows scram/md5 there)
if PGPASSWORD="$PG_PASSWORD" psql -h 127.0.0.1 -p "$PG_PORT" -U "$PG_USER" -d "$PG_DB" -Atqc 'select 1' >/dev/null 2>&1; then
    log "PostgreSQL ready: $PG_USER@127.0.0.1:$PG_PORT/$PG_DB"
else
    log "PostgreSQL is running but $PG_USER cannot log in over TCP; see /var/log/postgresql/"
    exit 1
fi
