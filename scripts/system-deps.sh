#!/usr/bin/env bash
# System packages the tests need that no Python wheel ships: Prometheus and promtool (Debian
# package `prometheus`) for tests/deploy; podman, runc and debootstrap for tests/docker, which
# build and run the images (debootstrap makes the stand-in base image where no registry of
# images is reachable). Idempotent: does nothing when they are installed.
# kubectl and hadolint come pinned from PyPI through requirements-dev.txt instead.
set -euo pipefail
need=()
command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
for cmd in podman runc debootstrap; do
  # runc and debootstrap live in sbin, which a non-login PATH may lack.
  command -v "$cmd" >/dev/null 2>&1 || [ -x "/usr/sbin/$cmd" ] || need+=("$cmd")
done
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "system-deps: need root to install: ${need[*]}" >&2
  exit 1
fi
echo "system-deps: installing ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# No recommends: crun (which fails on this machine class's cgroups) stays out; runc is used.
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
