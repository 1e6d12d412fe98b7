#!/usr/bin/env bash
# Make a throw-away PostgreSQL reachable at postgresql://vitreg:vitreg@127.0.0.1:5432/vitreg for
# tests/test_server.py (Debian/Ubuntu CI images; run as root).
#
#   PYTHON=.venv/bin/python bash tracking/ci_postgres.sh
#
# Installs the Debian `postgresql` package if needed, starts a cluster on 127.0.0.1:5432, creates
# the user and database `vitreg` (password `vitreg`; a test credential, never use it for a real
# server) and pip-installs the driver "psycopg[binary]" (psycopg 3, SQLAlchemy 2.1's default for
# postgresql://) into $PYTHON (default: `python`, else `python3`) when it can import neither
# psycopg nor psycopg2. Safe to run again. It never fails the build: when something cannot
# be done it prints "ci_postgres: skipped: <why>" and exits 0, and the PostgreSQL test then skips
# with its own reason.
set -u

PY=${PYTHON:-$(command -v python || command -v python3)}
URI=postgresql://vitreg:vitreg@127.0.0.1:5432/vitreg
LOG=${TMPDIR:-/tmp}/vitreg-ci-postgres.log

say() { echo "ci_postgres: $*"; }
skip() { say "skipped: $*"; exit 0; }

as_postgres() {
    if [ "$(id -u)" = 0 ]; then
        if command -v runuser >/dev/null; then runuser -u postgres -- "$@"; else su postgres -s /bin/sh -c "$(printf '%q ' "$@")"; fi
    elif [ "$(id -un)" = postgres ]; then
        "$@"
    else
        sudo -n -u postgres "$@"
    fi
}

psql_admin() {  # psql_admin SQL -> the one value it returns
    as_postgres psql -X -q -h 127.0.0.1 -p 5432 -d postgres -v ON_ERROR_STOP=1 -tAc "$1" 2>>"$LOG" \
        || as_postgres psql -X -q -p 5432 -d postgres -v ON_ERROR_STOP=1 -tAc "$1" 2>>"$LOG"
}

can_connect() {
    "$PY" - "$URI" >/dev/null 2>>"$LOG" <<'EOF'
import sys
try:
    import psycopg
except ImportError:
    import psycopg2 as psycopg
psycopg.connect(sys.argv[1], connect_timeout=3).close()
EOF
}

: >"$LOG"
[ -n "$PY" ] || skip "no python found; set PYTHON=/path/to/python"

# 1. The driver, into the Python that runs the tests.
if ! "$PY" -c "import psycopg" 2>/dev/null && ! "$PY" -c "import psycopg2" 2>/dev/null; then
    say "installing psycopg[binary] into $PY"
    "$PY" -m pip install -q "psycopg[binary]" >>"$LOG" 2>&1 \
        || skip "pip install 'psycopg[binary]' failed (see $LOG)"
fi

# 2. Already there (a CI service container, an earlier run)? Then nothing else to do.
if can_connect; then say "ready: $URI"; exit 0; fi

# 3. The server binaries.
if ! ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1; then
    [ "$(id -u)" = 0 ] || skip "PostgreSQL is not installed and installing it needs root (apt-get install postgresql)"
    command -v apt-get >/dev/null || skip "PostgreSQL is not installed and there is no apt-get"
    say "installing the Debian postgresql package"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq postgresql >>"$LOG" 2>&1 \
        || { apt-get update -qq >>"$LOG" 2>&1 && apt-get install -y -qq postgresql >>"$LOG" 2>&1; } \
        || skip "apt-get install postgresql failed (see $LOG)"
fi
command -v pg_lsclusters >/dev/null || skip "postgresql-common (pg_lsclusters, pg_ctlcluster) is missing"

# 4. A cluster on port 5432, running. Debian creates "<version> main" on 5432 at install time.
read -r VER NAME STATUS < <(pg_lsclusters -h 2>/dev/null | awk '$3 == 5432 {print $1, $2, $4; exit}')
if [ -z "${VER:-}" ]; then
    VER=$(ls /usr/lib/postgresql | sort -V | tail -1)
    NAME=vitreg
    say "creating cluster $VER/$NAME on port 5432"
    pg_createcluster "$VER" "$NAME" --port 5432 >>"$LOG" 2>&1 || skip "pg_createcluster failed (see $LOG)"
    STATUS=down
fi
if [ "$STATUS" != online ]; then
    say "starting cluster $VER/$NAME"
    pg_ctlcluster "$VER" "$NAME" start >>"$LOG" 2>&1 \
        || skip "pg_ctlcluster $VER $NAME start failed (see $LOG and /var/log/postgresql/)"
fi
for _ in $(seq 1 30); do
    as_postgres pg_isready -q -h 127.0.0.1 -p 5432 && break
    sleep 0.5
done
as_postgres pg_isready -q -h 127.0.0.1 -p 5432 || skip "PostgreSQL did not come up on 127.0.0.1:5432"

# 5. The role and the database (idempotent).
if [ "$(psql_admin "SELECT 1 FROM pg_roles WHERE rolname = 'vitreg'")" != 1 ]; then
    psql_admin "CREATE ROLE vitreg LOGIN PASSWORD 'vitreg'" >/dev/null || skip "cannot create role vitreg (see $LOG)"
else
    psql_admin "ALTER ROLE vitreg LOGIN PASSWORD 'vitreg'" >/dev/null || skip "cannot reset role vitreg (see $LOG)"
fi
if [ "$(psql_admin "SELECT 1 FROM pg_database WHERE datname = 'vitreg'")" != 1 ]; then
    psql_admin "CREATE DATABASE vitreg OWNER vitreg" >/dev/null || skip "cannot create database vitreg (see $LOG)"
fi

can_connect || skip "cannot connect to $URI (pg_hba.conf? see $LOG)"
say "ready: $URI"
exit 0
