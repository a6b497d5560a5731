#!/usr/bin/env bash
# The one check script, the same locally and in CI: ruff format, ruff lint, mypy --strict,
# import-linter, then pytest with our own warnings as errors. Arguments go to pytest.
#
# vLLM's caches: VLLM_CACHE_ROOT persists next to the cached venv (the first engine of each
# architecture spends ~10 s inspecting the model, once per machine); TMPDIR is private to
# this run (vLLM drops its dist-init files there) and removed at exit, together with any
# /dev/shm/vllm_dist_* segment this run left behind.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
venv=${HOTSWAP_VENV:-$(scripts/bootstrap.sh)}
# The venv holds dependencies only: this checkout's code comes first on the path.
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
cache=${HOTSWAP_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-hotswap}
mkdir -p "$cache/vllm"
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$cache/vllm}
# An overriding VLLM_CPU_KVCACHE_SPACE would give every test engine at least 1 GiB of KV.
unset VLLM_CPU_KVCACHE_SPACE

run_tmp=$(mktemp -d "${TMPDIR:-/tmp}/hotswap-check.XXXXXX")
shm_before=$(ls -1 /dev/shm 2>/dev/null | grep '^vllm_dist_' || true)
cleanup() {
  local f
  for f in $(ls -1 /dev/shm 2>/dev/null | grep '^vllm_dist_' || true); do
    # Only segments that appeared during this run and that no live process still maps.
    grep -qxF "$f" <<<"$shm_before" && continue
    grep -qsF "/dev/shm/$f" /proc/[0-9]*/maps && continue
    rm -f "/dev/shm/$f"
  done
  rm -rf "$run_tmp"
}
trap cleanup EXIT
export TMPDIR=$run_tmp

failed=()
# Every step runs even after a failure, so one run shows everything that is wrong.
step() {
  local name=$1
  shift
  printf '\n== %s\n' "$name"
  "$@" || failed+=("$name")
}
step "ruff format --check" "$venv/bin/ruff" format --check .
step "ruff check" "$venv/bin/ruff" check .
step "mypy (strict: controller, worker_ext)" "$venv/bin/mypy"
step "lint-imports" "$venv/bin/lint-imports"

printf '\n== pytest %s\n' "$*"
rc=0
# --durations: the slowest steps (engine start-ups) are where CI time goes.
"$venv/bin/python" -m pytest --durations=15 "$@" || rc=$?
if [ "$rc" -eq 5 ]; then
  echo "check: pytest collected no test at all (exit 5); a run that tests nothing is not green" >&2
  failed+=("pytest (no tests)")
elif [ "$rc" -ne 0 ]; then
  failed+=("pytest (exit $rc)")
fi

if [ ${#failed[@]} -gt 0 ]; then
  printf 'check: FAILED: %s\n' "$(IFS=,; echo "${failed[*]}" | sed 's/,/, /g')" >&2
  exit 1
fi
echo "check: all green"
