#!/usr/bin/env bash
# Build powerd's container images with buildah from the Containerfiles users build, then
# smoke-test them. CI runs it (.ci/run); so can a site.
#
#   deploy/containers/build.sh [--local-base] [--ca-bundle FILE] [--no-smoke]
#
# --local-base: no registry is reachable (CI here): make the base image the Containerfiles
#   name (docker.io/library/debian:bookworm-slim) locally, from a debootstrap rootfs of
#   Debian bookworm, committed under that name, and build with --pull=never. The
#   Containerfiles are the same either way.
# --ca-bundle FILE: the CA bundle pip needs behind a proxy that re-signs TLS (default:
#   $PIP_CERT when it is set), mounted into the build, never copied into an image.
# The wheel comes from dist/ (built here with `python -m build --wheel` if there is none).
set -euo pipefail
cd "$(dirname "$0")/../.."

BASE=docker.io/library/debian:bookworm-slim
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -n 1)
export BUILDAH_ISOLATION=chroot
local_base=0
smoke=1
ca_bundle=${PIP_CERT:-}
while [ $# -gt 0 ]; do
  case "$1" in
    --local-base) local_base=1 ;;
    --no-smoke) smoke=0 ;;
    --ca-bundle) ca_bundle=$2; shift ;;
    *) echo "usage: $0 [--local-base] [--ca-bundle FILE] [--no-smoke]" >&2; exit 2 ;;
  esac
  shift
done
ca=()
if [ -n "$ca_bundle" ]; then
  ca=(--volume "$(realpath "$ca_bundle"):/run/powerd-build/ca.crt:ro"
      --build-arg BUILD_CA=/run/powerd-build/ca.crt)
fi

log() { printf '\n== %s\n' "$*"; }

pull=(--pull=missing)
if [ "$local_base" -eq 1 ]; then
  pull=(--pull=never)
  if ! buildah inspect --type image "$BASE" >/dev/null 2>&1; then
    log "base image $BASE from debootstrap (no registry)"
    rootfs=$(mktemp -d)
    trap 'rm -rf "$rootfs"' EXIT
    debootstrap --variant=minbase --include=ca-certificates bookworm "$rootfs/root" \
      http://deb.debian.org/debian >/dev/null
    rm -rf "$rootfs/root/var/cache/apt/archives/"*.deb "$rootfs/root/var/lib/apt/lists/"*
    ctr=$(buildah from scratch)
    buildah add "$ctr" "$rootfs/root" / >/dev/null
    buildah config --cmd '["/bin/bash"]' --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
    buildah commit -q "$ctr" "$BASE" >/dev/null
    buildah rm "$ctr" >/dev/null
  fi
fi

if ! ls dist/powerd-"$VERSION"-*.whl >/dev/null 2>&1; then
  log "wheel"
  "${PYTHON:-python3}" -m build --wheel --outdir dist . >/dev/null
fi

for role in controller agent; do
  log "image powerd-$role:$VERSION"
  buildah bud -q "${pull[@]}" "${ca[@]}" --format docker --layers \
    -f "deploy/containers/Containerfile.$role" -t "localhost/powerd-$role:$VERSION" . >/dev/null
  buildah inspect --type image --format '{{.Docker.Config.Healthcheck.Test}} user={{.Docker.Config.User}}' \
    "localhost/powerd-$role:$VERSION"
done

[ "$smoke" -eq 1 ] || exit 0

# `podman run` does not work on these machines (crun cannot set RLIMIT_NOFILE); buildah
# runs a command in a working container of the image, chroot-isolated, on the host network.
run_in() {
  local image=$1; shift
  local ctr rc=0
  ctr=$(buildah from --pull=never "$image")
  buildah run "${RUN_OPTS[@]}" "$ctr" -- "$@" || rc=$?
  buildah rm "$ctr" >/dev/null
  return $rc
}
RUN_OPTS=()

log "smoke: the controller image"
run_in "localhost/powerd-controller:$VERSION" powerd --version
RUN_OPTS=(--user powerd)
# The solver was compiled at build time: as the user powerd, `powerd warm` only loads it.
run_in "localhost/powerd-controller:$VERSION" powerd warm
# The daemon itself, as the unprivileged user, on the example policy and the local broker:
# its API must answer /healthz from outside the container.
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
RUN_OPTS=(--user powerd --volume "$PWD/policies:/etc/powerd/policies:ro")
run_in "localhost/powerd-controller:$VERSION" timeout 40 powerd controller \
  --policy /etc/powerd/policies/example.yaml --broker "${POWERD_SMOKE_BROKER:-mqtt://127.0.0.1:1883}" \
  --db sqlite:////var/lib/powerd/powerd.db --api-port "$port" --dev >/tmp/powerd-smoke.log 2>&1 &
daemon=$!
healthy=0
for _ in $(seq 1 60); do
  if python3 -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:$port/healthz', timeout=1).status != 200)" 2>/dev/null; then
    healthy=1; break
  fi
  sleep 0.5
done
pkill -f "powerd controller --policy /etc/powerd/policies/example.yaml" 2>/dev/null || true
wait "$daemon" 2>/dev/null || true
if [ "$healthy" -ne 1 ]; then
  echo "the controller image never answered /healthz:" >&2
  tail -n 20 /tmp/powerd-smoke.log >&2
  exit 1
fi
echo "controller in the image answered /healthz on :$port"
RUN_OPTS=()

log "smoke: the agent image"
run_in "localhost/powerd-agent:$VERSION" powerd --version
# The agent image carries none of the controller's libraries.
run_in "localhost/powerd-agent:$VERSION" python3 -c "
import importlib.util, sys
heavy = [m for m in ('numpy', 'numba', 'scipy', 'cvxpy', 'sqlalchemy', 'fastapi', 'matplotlib')
         if importlib.util.find_spec(m) is not None]
sys.exit(f'agent image installs {heavy}' if heavy else 0)"
# No GPU here: the agent must say so in one line and exit non-zero, not crash.
if out=$(run_in "localhost/powerd-agent:$VERSION" powerd agent --node-id smoke-1 --backend nvml 2>&1); then
  echo "the agent started without a GPU driver: $out" >&2
  exit 1
fi
echo "agent without NVML: $(echo "$out" | grep '^powerd agent:' | tail -n 1)"
[ -n "$(echo "$out" | grep '^powerd agent:')" ] || { echo "the agent gave no one-line reason: $out" >&2; exit 1; }
echo "images: localhost/powerd-controller:$VERSION localhost/powerd-agent:$VERSION"
