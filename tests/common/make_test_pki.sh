#!/usr/bin/env bash
# Makes the certificates the TLS tests use, fresh each time, with openssl (P-256 keys, 1 day):
#   ca.pem                      the cluster CA (its key ca.key)
#   member.pem / member.key     a member's certificate from that CA (server and client auth;
#                               names localhost, 127.0.0.1, ::1)
#   member2.pem / member2.key   a second one from the same CA (CN moe-member-2), for rotation
#   other-ca.pem                another CA, and rogue.pem / rogue.key from it (a wrong-CA peer)
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
leaf() {  # leaf NAME CN CA
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$2" \
    -keyout "$1.key" -out "$1.csr" 2>/dev/null
  openssl x509 -req -in "$1.csr" -CA "$3.pem" -CAkey "$3.key" -CAcreateserial -days 1 \
    -extfile "$ext" -out "$1.pem" 2>/dev/null
  rm -f "$1.csr"
}
ca ca "moe test CA"
leaf member moe-member ca
leaf member2 moe-member-2 ca
ca other-ca "some other CA"
leaf rogue moe-rogue other-ca
chmod 644 ./*.pem
