#!/bin/sh
# Make the secrets and TLS material compose.secure.yaml mounts (run once, from anywhere):
# random passwords for one Redis ACL user per role, the internal token, one API key (printed once),
# and a CA with certificates for worker, scheduler and gateway. Needs openssl. Nothing is
# overwritten: delete deploy/compose/secrets and deploy/compose/tls to start again.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
secrets="$here/secrets"
tls="$here/tls"
[ -e "$secrets" ] || [ -e "$tls" ] && { echo "$secrets or $tls exists; delete them to start again" >&2; exit 1; }
mkdir -p "$secrets" "$tls"
umask 077
rand() { openssl rand -hex 24; }
gw=$(rand); sc=$(rand); wk=$(rand)
# Key patterns assume the default key prefix "ps:". Workers only write their registry entries.
# INFO: gateways read the replica count for durable admissions (with Sentinels).
cat > "$secrets/redis.acl" <<ACL
user default off
user health on nopass -@all +ping
user gateway on >$gw ~ps:* &* +@all -@dangerous +info
user scheduler on >$sc ~ps:* &* +@all -@dangerous +info
user worker on >$wk ~ps:workers:* +@all -@dangerous
ACL
printf 'redis://gateway:%s@redis:6379/0' "$gw" > "$secrets/redis_url_gateway"
printf 'redis://scheduler:%s@redis:6379/0' "$sc" > "$secrets/redis_url_scheduler"
printf 'redis://worker:%s@redis:6379/0' "$wk" > "$secrets/redis_url_worker"
rand > "$secrets/internal_token"
key=$(rand)
printf '# API keys, one per line (or sha256:<hex digest>); edit to add or revoke, no restart needed\n%s\n' \
  "$key" > "$secrets/api_keys"
openssl req -x509 -newkey rsa:3072 -nodes -days 825 -subj "/CN=pagedserve internal CA" \
  -keyout "$tls/ca.key" -out "$tls/ca.pem" 2>/dev/null
for name in worker scheduler gateway; do
  openssl req -newkey rsa:3072 -nodes -subj "/CN=$name" -keyout "$tls/$name.key" -out "$tls/$name.csr" 2>/dev/null
  printf 'subjectAltName=DNS:%s,DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n' "$name" \
    > "$tls/$name.ext"
  openssl x509 -req -in "$tls/$name.csr" -CA "$tls/ca.pem" -CAkey "$tls/ca.key" -CAcreateserial -days 825 \
    -extfile "$tls/$name.ext" -out "$tls/$name.pem" 2>/dev/null
  rm "$tls/$name.csr" "$tls/$name.ext"
done
rm -f "$tls/ca.key" "$tls/ca.srl"  # nothing signs later; keep a CA key offline if you want to issue more
# Readable by the containers' user (uid of "pagedserve" in the image), which bind mounts keep: on a
# shared host, chown these files to that uid and chmod 600 instead.
chmod 755 "$secrets" "$tls"
chmod 644 "$tls"/* "$secrets"/*
echo "API key (also in $secrets/api_keys): $key"
