"""GPU benchmarks of the sleep and wake paths, run on the lent device.

    . .gpu/install-vllm-bundle.sh || exit 1; bash benchmarks/run-on-device.sh STEP...
    python3 -m benchmarks.wake --shape llama3-8b      # one bench, from the repository root

`common` holds the shapes and the engine launch; a run goes to docs/benchmarks-log.md, dated,
and its figures replace their rows in docs/benchmarks.md. The GPU
tests stay in tests/gpu.
"""
