#!/usr/bin/env bash
# One-command GPU run on the lent device, from the repo root, after the vLLM bundle:
#   . .gpu/install-vllm-bundle.sh || exit 1; bash benchmarks/run-on-device.sh STEP...
# STEP: smoke | tests | vllmsleep:SHAPE (benchmarks.vllmsleep: vLLM's own wake through the hotswap
# sleep-mode backend beside the sidecar's RPCs and cumem; VLLMSLEEP_ARGS) | disktier:SHAPE (benchmarks.disktier; DISKTIER_BUDGET_S, DISKTIER_ARGS) | bench:SHAPE[:via] (SHAPE tiny|llama3-8b|qwen25-14b, via
# extension|backend; BENCH_ARGS adds benchmarks.wake options, e.g. "--codecs exp"; TESTS_K
# is a pytest -k expression for the tests step, e.g. "flip or cycle") | sidecar:SHAPE (benchmarks.sidecar;
# needs the controller's wheels on PYTHONPATH).
# Each step runs in its own process with a time budget and is skipped when it would end
# past DEADLINE seconds (default 560); the sidecar step takes what is left (at least
# SIDECAR_MIN_S). Logs go to $OUT.
set -u -o pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
DEADLINE=${DEADLINE:-560}
start=$(date +%s)
rc_all=0
for step in "$@"; do
  IFS=: read -r name shape via <<<"$step"
  now=$(( $(date +%s) - start ))
  case "$name" in
    smoke) budget=${SMOKE_BUDGET_S:-150}; cmd=(python3 -m benchmarks.smoke_cumem) ;;
    tests) budget=${TESTS_BUDGET_S:-300}
           # TESTS_K: a pytest -k expression (one word to the shell), e.g. "flip or cycle"
           cmd=(python3 -m pytest tests/gpu --confcutdir tests/gpu -p no:warnings -p no:cacheprovider -v -rA --timeout 250 ${TESTS_K:+-k "$TESTS_K"}) ;;
    bench) budget=${BENCH_BUDGET_S:-300}
           # a bench takes what is left before DEADLINE, down to BENCH_MIN_S
           (( DEADLINE - now - 5 < budget )) && budget=$(( DEADLINE - now - 5 ))
           (( budget >= ${BENCH_MIN_S:-90} )) || budget=${BENCH_MIN_S:-90}
           # shellcheck disable=SC2206  # BENCH_ARGS: extra words, e.g. "--codecs exp"
           cmd=(python3 -m benchmarks.wake --shape "${shape:-llama3-8b}" --via "${via:-extension}" ${BENCH_ARGS:-}) ;;
    vllmsleep) budget=${VLLMSLEEP_BUDGET_S:-200}
           cmd=(python3 -m benchmarks.vllmsleep --shape "${shape:-llama3-8b}" ${VLLMSLEEP_ARGS:-}) ;;
    disktier) budget=${DISKTIER_BUDGET_S:-160}
           # benchmarks.disktier: its own --budget-s skips cycles 10 s before the step's limit
           # shellcheck disable=SC2206  # DISKTIER_ARGS: extra words, e.g. "--readers 1,8"
           cmd=(python3 -m benchmarks.disktier --shape "${shape:-llama3-8b}" --budget-s $(( budget - 10 )) ${DISKTIER_ARGS:-}) ;;
    sidecar) budget=$(( DEADLINE - now - 5 ))
             (( budget >= ${SIDECAR_MIN_S:-150} )) || budget=${SIDECAR_MIN_S:-150}
             cmd=(python3 -m benchmarks.sidecar --shape "${shape:-llama3-8b}" --budget-s $(( budget - 25 ))) ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
  if (( now + budget > DEADLINE )); then
    echo "=== SKIP $step (at ${now}s, budget ${budget}s, deadline ${DEADLINE}s)"; rc_all=1; continue
  fi
  echo "=== STEP $step at ${now}s: ${cmd[*]}"
  timeout -k 10 "$budget" "${cmd[@]}" 2>&1 | tee "$OUT/${step//:/-}.log" \
    | grep -E --line-buffered "^\[bench\]|^\[sidecar|^\||^\{|^fingerprint|^scales|^###|passed|failed|error|Error|PASSED|FAILED|SKIPPED|Traceback|freed|took" | cut -c1-1500
  rc=${PIPESTATUS[0]}
  echo "=== END $step rc=$rc after $(( $(date +%s) - start - now ))s"
  (( rc == 0 )) || rc_all=1
  left=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)
  for pid in $left; do kill -9 "$pid" 2>/dev/null && echo "ended leftover GPU process $pid"; done
done
echo "=== all done at $(( $(date +%s) - start ))s rc=$rc_all"
exit $rc_all
