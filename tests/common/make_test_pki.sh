#!/usr/bin/env bash
# Makes the certificates the TLS tests use, fresh each time, with openssl (P-256 keys, 1 day):
#   ca.pem                      the cluster CA (its key ca.key)
#   member.pem / member.key     a member's certificate from that CA (server and client auth;
#                               names localhost, 127.0.0.1, ::1)
#   member2.pem / member2.key   a second one from the same CA (CN moe-member-2), for rotation
#   other-ca.pem                another CA, and rogue.pem / rogue.key from it (a wrong-CA peer)
#   <name>.pem / <name>.key     one per process of a local cluster, naming it by a SPIFFE ID
#                               (spiffe://moe/<role>/<name>: shard-0..3 expert, attention-svc
#                               attention, router-svc router, client client), CN moe-member;
#                               <name>-2.pem / .key the same identity with CN moe-member-2 (for
#                               rotation); LocalCluster picks them with a cert file "{name}.pem"
# Usage: make_test_pki.sh DIR
set -euo pipefail
dir=$1
mkdir -p "$dir"
cd "$dir"
umask 077
ext=$(mktemp)
trap 'rm -f "$ext"' EXIT
cat >"$ext" <<'EXT'
basicConstraints=CA:FALSE
keyUsage=digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth,clientAuth
subjectAltName=DNS:localhost,IP:127.0.0.1,IP:::1
EXT
ca() {  # ca NAME CN
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 \
    -subj "/CN=$2" -keyout "$1.key" -out "$1.pem" 2>/dev/null
}
leaf() {  # leaf NAME CN CA [URI]: with a URI, the certificate names that identity too
  local e
  e=$(mktemp)
  if [ $# -ge 4 ]; then
    sed "s|^subjectAltName=.*|&,URI:$4|" "$ext" >"$e"
  else
    cp "$ext" "$e"
  fi
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$2" \
    -keyout "$1.key" -out "$1.csr" 2>/dev/null
  openssl x509 -req -in "$1.csr" -CA "$3.pem" -CAkey "$3.key" -CAcreateserial -days 1 \
    -extfile "$e" -out "$1.pem" 2>/dev/null
  rm -f "$1.csr" "$e"
}
ca ca "moe test CA"
leaf member moe-member ca
leaf member2 moe-member-2 ca
ca other-ca "some other CA"
leaf rogue moe-rogue other-ca
for name in router-svc attention-svc shard-0 shard-1 shard-2 shard-3 client; do
  case $name in
    shard-*) role=expert ;;
    attention-*) role=attention ;;
    router-*) role=router ;;
    *) role=client ;;
  esac
  leaf "$name" moe-member ca "spiffe://moe/$role/$name"
  leaf "$name-2" moe-member-2 ca "spiffe://moe/$role/$name"
done
# A member certificate of the same CA that names shard-1 (an impostor for shard-0's name).
leaf impostor moe-impostor ca "spiffe://moe/expert/shard-1"
chmod 644 ./*.pem
