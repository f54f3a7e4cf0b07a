#!/bin/sh
# The environment contract of the official postgres image's entrypoint (POSTGRES_USER, POSTGRES_PASSWORD,
# POSTGRES_DB, PGDATA), on Debian's PostgreSQL: the image deploy/kubernetes/postgres.yaml names cannot be pulled in
# the tests, so tests/kube_play.py builds a stand-in from Debian's packages with this as its entrypoint.
set -eu
PATH=/usr/lib/postgresql/15/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
PGDATA="${PGDATA:-/var/lib/postgresql/data}"
export PGDATA
user="${POSTGRES_USER:-postgres}"
db="${POSTGRES_DB:-$user}"
mkdir -p "$PGDATA" /var/run/postgresql
chown postgres:postgres "$PGDATA" /var/run/postgresql
chmod 700 "$PGDATA"
as_postgres() { setpriv --reuid=postgres --regid=postgres --init-groups "$@"; }
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  [ -n "${POSTGRES_PASSWORD:-}" ] || { echo "POSTGRES_PASSWORD is not set" >&2; exit 1; }
  pwfile=$(mktemp)
  printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
  chown postgres "$pwfile"
  as_postgres initdb -D "$PGDATA" -U "$user" --pwfile="$pwfile" --auth-local=trust --auth-host=scram-sha-256 >/dev/null
  rm -f "$pwfile"
  echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
  if [ "$db" != postgres ]; then
    echo "CREATE DATABASE \"$db\" OWNER \"$user\";" | as_postgres postgres --single -D "$PGDATA" postgres >/dev/null
  fi
  echo "initialised $PGDATA: database $db, user $user"
fi
exec setpriv --reuid=postgres --regid=postgres --init-groups postgres -D "$PGDATA" -c listen_addresses='*'
