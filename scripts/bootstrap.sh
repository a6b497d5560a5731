#!/usr/bin/env bash
# Create (or reuse) the project's virtualenv and print its path.
# `scripts/bootstrap.sh scan`: the same for the security scanner's own venv
# (requirements-scan.txt: checkov's pins cannot share vLLM's venv).
#
# The venv lives outside the checkout, keyed by a hash of requirements-dev.txt and the
# Python version, so a fresh clone (CI) on the same machine reuses it in seconds; a change
# to the pins builds a new one. The project itself is installed editable on every call,
# because the cached venv may last have pointed at another checkout.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${PYTHON:-python3}
if [ "${1:-}" = scan ]; then
  key=$( { cat "$root/requirements-scan.txt"; "$py" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16)
  cache=${HOTSWAP_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-hotswap}
  venv="$cache/scan-$key"
  if [ ! -f "$venv/.complete" ]; then
    echo "bootstrap: building $venv (the scanner's venv: about a minute)" >&2
    rm -rf "$venv"
    mkdir -p "$cache"
    "$py" -m venv "$venv"
    log="$cache/install-scan-$key.log"
    { "$venv/bin/pip" install -q --upgrade pip && "$venv/bin/pip" install -q -r "$root/requirements-scan.txt"; } \
      >"$log" 2>&1 || { tail -n 40 "$log" >&2; exit 1; }
    touch "$venv/.complete"
  fi
  echo "$venv"
  exit 0
fi
key=$( { cat "$root/requirements-dev.txt"; "$py" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16)
cache=${HOTSWAP_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-hotswap}
venv="$cache/venv-$key"
if [ ! -f "$venv/.complete" ]; then
  echo "bootstrap: building $venv (first run on this machine: about 3 minutes)" >&2
  rm -rf "$venv"
  mkdir -p "$cache"
  "$py" -m venv "$venv"
  log="$cache/install-$key.log"
  { "$venv/bin/pip" install -q --upgrade pip && "$venv/bin/pip" install -q -r "$root/requirements-dev.txt"; } \
    >"$log" 2>&1 || { tail -n 40 "$log" >&2; exit 1; }
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break transformers on CPU torch.
  "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >&2 || true
  touch "$venv/.complete"
fi
"$venv/bin/pip" install -q --no-deps --no-build-isolation -e "$root" >"$cache/editable.log" 2>&1 \
  || { cat "$cache/editable.log" >&2; exit 1; }
echo "$venv"
