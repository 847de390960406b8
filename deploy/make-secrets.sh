#!/usr/bin/env bash
# Writes the secrets a containerised lorafleet needs into OUT (default: deploy/secrets), once:
#
#   OUT/creds/{admin,gateway,worker,control}.nk   one nkey credential per role (`lorafleet creds add`), 0600
#   OUT/nats-auth.conf     nats-server's authorization block: public keys and role permissions, no secret
#   OUT/nats-routes.conf   the route password every NATS node shares, and the routes to ROUTE_HOSTs
#   OUT/postgres-password  PostgreSQL's password (MLflow's backend store and Optuna's storage)
#
# usage: deploy/make-secrets.sh [OUT [ROUTE_HOST...]]
#   compose:     deploy/make-secrets.sh deploy/secrets n1 n2 n3          (the default)
#   Kubernetes:  deploy/make-secrets.sh deploy/k8s/secrets nats-0.nats-headless nats-1.nats-headless nats-2.nats-headless
#
# Existing files are kept (run it again after `LORAFLEET_HOME=OUT lorafleet creds add worker-gpu3` to admit
# a new credential: nats-auth.conf is always rendered again from OUT/creds). Needs lorafleet installed
# (LORAFLEET=path/to/lorafleet and PYTHON=path/to/python override the ones on PATH).
set -euo pipefail
OUT=${1:-deploy/secrets}
shift || true
HOSTS=("$@")
[ ${#HOSTS[@]} -gt 0 ] || HOSTS=(n1 n2 n3)
LORAFLEET=${LORAFLEET:-lorafleet}
PYTHON=${PYTHON:-python3}
umask 077
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

for role in admin gateway worker control; do
  LORAFLEET_HOME="$OUT" "$LORAFLEET" creds add "$role" >/dev/null
done

# Public keys only: what nats-server checks signatures against (lorafleet.nats.auth.PERMISSIONS per role).
"$PYTHON" -c 'import sys; from lorafleet.nats.auth import authorization_config, load_credentials
sys.stdout.write(authorization_config(load_credentials(sys.argv[1])))' "$OUT/creds" > "$OUT/nats-auth.conf.tmp"
mv "$OUT/nats-auth.conf.tmp" "$OUT/nats-auth.conf"

secret() { "$PYTHON" -c 'import secrets; print(secrets.token_urlsafe(24))'; }

# A route URL carries the password (nats-server does not fill it in from the cluster's authorization),
# so the whole list lives here, as variables the node config includes.
if [ ! -f "$OUT/nats-routes.conf" ]; then
  pw=$(secret)
  routes=""
  for h in "${HOSTS[@]}"; do routes+="${routes:+, }\"nats-route://route:${pw}@${h}:6222\""; done
  printf '# Route credential of the NATS cluster (deploy/make-secrets.sh): a secret.\nROUTE_PASSWORD: "%s"\nROUTES: [%s]\n' \
    "$pw" "$routes" > "$OUT/nats-routes.conf"
fi
[ -f "$OUT/postgres-password" ] || secret > "$OUT/postgres-password"
chmod 600 "$OUT"/nats-routes.conf "$OUT"/postgres-password "$OUT"/creds/*.nk
echo "secrets in $OUT: creds/{admin,gateway,worker,control}.nk, nats-auth.conf, nats-routes.conf, postgres-password"
