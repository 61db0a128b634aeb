#!/usr/bin/env bash
# Make a server certificate signed by the site's CA (make-ca.sh) for the broker or an admin
# API: DIR/NAME.crt and DIR/NAME.key (0600), valid for every HOST given (DNS names or IP
# addresses: what clients put in their URL, mqtts://HOST:8883 or https://HOST:8080; clients
# check it).
#
#   deploy/pki/make-server-cert.sh [--dir DIR] [--days DAYS] NAME HOST [HOST...]
#
# e.g. make-server-cert.sh broker broker.example.net 10.0.0.5
#      make-server-cert.sh api-ctl-1 ctl-1.example.net
# DIR defaults to $POWERD_PKI_DIR or ./pki; DAYS to 825. Nothing is overwritten.
set -euo pipefail

dir=${POWERD_PKI_DIR:-./pki}
days=825
args=()

die() { printf 'make-server-cert.sh: %s\n' "$*" >&2; exit 2; }

while [ $# -gt 0 ]; do
  case $1 in
    --dir) dir=${2:?--dir needs a directory}; shift 2 ;;
    --days) days=${2:?--days needs a number}; shift 2 ;;
    -h | --help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option: $1 (see --help)" ;;
    *) args+=("$1"); shift ;;
  esac
done
[ ${#args[@]} -ge 2 ] || die "want NAME and at least one HOST (see --help)"
name=${args[0]}
[[ $name =~ ^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$ ]] || die "NAME $name: letters, digits, '_.-'"
[[ $days =~ ^[1-9][0-9]{0,4}$ ]] || die "DAYS must be a whole number of days"
[ -r "$dir/ca.key" ] && [ -r "$dir/ca.crt" ] || die "no CA in $dir: run make-ca.sh first"
[ ! -e "$dir/$name.key" ] && [ ! -e "$dir/$name.crt" ] || die "$dir/$name.crt exists; not overwritten"
sans=()
for host in "${args[@]:1}"; do
  if [[ $host =~ ^[0-9.]+$ || $host == *:* ]]; then
    sans+=("IP:$host")
  elif [[ $host =~ ^[A-Za-z0-9*]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$ ]]; then
    sans+=("DNS:$host")
  else
    die "HOST $host is neither a DNS name nor an IP address"
  fi
done

umask 077
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat >"$work/ext" <<EXT
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
subjectAltName = $(IFS=,; printf '%s' "${sans[*]}")
EXT
openssl req -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:P-256 -sha256 \
  -keyout "$dir/$name.key" -out "$work/csr" -subj "/CN=${args[1]}" 2>/dev/null
openssl x509 -req -in "$work/csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" \
  -set_serial "0x$(openssl rand -hex 16)" -days "$days" -sha256 \
  -extfile "$work/ext" -out "$dir/$name.crt" 2>/dev/null
chmod 0644 "$dir/$name.crt"
printf '%s\n' "$dir/$name.crt" "$dir/$name.key"
