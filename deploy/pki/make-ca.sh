#!/usr/bin/env bash
# Make a site's certificate authority: DIR/ca.key (0600, keep it offline) and DIR/ca.crt
# (public: every broker, agent, controller and API client of the site trusts it, and only
# it). docs/operations.md, "Certificates", says where each file goes.
#
#   deploy/pki/make-ca.sh [--dir DIR] [--name NAME] [--days DAYS]
#
# DIR defaults to $POWERD_PKI_DIR or ./pki; NAME to "powerd CA"; DAYS to 3650. An existing
# CA is never overwritten. Needs openssl (1.1.1 or 3.x).
set -euo pipefail

dir=${POWERD_PKI_DIR:-./pki}
name="powerd CA"
days=3650

die() { printf 'make-ca.sh: %s\n' "$*" >&2; exit 2; }

while [ $# -gt 0 ]; do
  case $1 in
    --dir) dir=${2:?--dir needs a directory}; shift 2 ;;
    --name) name=${2:?--name needs a name}; shift 2 ;;
    --days) days=${2:?--days needs a number}; shift 2 ;;
    -h | --help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument: $1 (see --help)" ;;
  esac
done
[[ $name =~ ^[A-Za-z0-9][A-Za-z0-9\ ._:-]{0,63}$ ]] || die "NAME: letters, digits, ' ._:-' (64 at most)"
[[ $days =~ ^[1-9][0-9]{0,4}$ ]] || die "DAYS must be a whole number of days"
[ ! -e "$dir/ca.key" ] && [ ! -e "$dir/ca.crt" ] || die "$dir already holds a CA; not overwritten"

umask 077
mkdir -p "$dir"
openssl req -x509 -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:P-256 -sha256 \
  -keyout "$dir/ca.key" -out "$dir/ca.crt" -days "$days" -subj "/CN=$name" \
  -addext "basicConstraints=critical,CA:TRUE,pathlen:0" \
  -addext "keyUsage=critical,keyCertSign,cRLSign" \
  -addext "subjectKeyIdentifier=hash" 2>/dev/null
chmod 0644 "$dir/ca.crt"
printf '%s\n' "$dir/ca.crt" "$dir/ca.key"
