#!/usr/bin/env bash
# Make a client certificate signed by the site's CA (make-ca.sh): DIR/NAME.crt and
# DIR/NAME.key (0600). Its common name is NAME, which a broker configured with
# deploy/pki/mosquitto-tls.conf takes as the client's username, so the ACL
# (systemd/mosquitto/acl) confines it: for a GPU node NAME is its node id as in the
# policy; the controllers' is powerd-controller, the coordinators' powerd-coordinator.
#
#   deploy/pki/make-node-cert.sh [--dir DIR] [--days DAYS] NAME
#
# DIR defaults to $POWERD_PKI_DIR or ./pki; DAYS to 825. A certificate already made for
# NAME is not overwritten (revoke it by replacing the CA, or with a CRL: docs/operations.md).
set -euo pipefail

dir=${POWERD_PKI_DIR:-./pki}
days=825
node=

die() { printf 'make-node-cert.sh: %s\n' "$*" >&2; exit 2; }

while [ $# -gt 0 ]; do
  case $1 in
    --dir) dir=${2:?--dir needs a directory}; shift 2 ;;
    --days) days=${2:?--days needs a number}; shift 2 ;;
    -h | --help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option: $1 (see --help)" ;;
    *) [ -z "$node" ] || die "one NAME at a time"; node=$1; shift ;;
  esac
done
[ -n "$node" ] || die "NAME missing (see --help)"
# powerd's node id (powerd/wire.py NODE_ID_PATTERN): also safe as a file name and a CN.
[[ $node =~ ^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$ ]] || die "NAME $node is not a node id"
[[ $days =~ ^[1-9][0-9]{0,4}$ ]] || die "DAYS must be a whole number of days"
[ -r "$dir/ca.key" ] && [ -r "$dir/ca.crt" ] || die "no CA in $dir: run make-ca.sh first"
[ ! -e "$dir/$node.key" ] && [ ! -e "$dir/$node.crt" ] || die "$dir/$node.crt exists; not overwritten"

umask 077
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat >"$work/ext" <<EXT
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
EXT
openssl req -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:P-256 -sha256 \
  -keyout "$dir/$node.key" -out "$work/csr" -subj "/CN=$node" 2>/dev/null
openssl x509 -req -in "$work/csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" \
  -set_serial "0x$(openssl rand -hex 16)" -days "$days" -sha256 \
  -extfile "$work/ext" -out "$dir/$node.crt" 2>/dev/null
chmod 0644 "$dir/$node.crt"
printf '%s\n' "$dir/$node.crt" "$dir/$node.key"
