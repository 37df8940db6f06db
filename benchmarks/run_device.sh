#!/usr/bin/env bash
# One device-machine session: GPU tests, the end-to-end benchmark, then the kernel sweep, each under its own time
# limit, all output under $OUT. Usage (device machine, repo root): [CONVERT_LAYERS=N CONVERT_ARGS=...]
# bash benchmarks/run_device.sh [SWEEP_SECONDS]
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export EXL2_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo "?")
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
# SKIP_TESTS=1 leaves the GPU tests out (the first call of a session compiles every kernel: ~4 minutes).
if [ -z "${SKIP_TESTS:-}" ]; then
# SIGINT on timeout: pytest then still prints which tests ran and their durations. Kernel compilation dominates
# (the golden-model tests each compile the mixed-width kernels), so tests run in parallel where pytest-xdist is
# installed (the device image has it): one worker per test, sharing Triton's on-disk cache.
XDIST=""; python3 -c "import xdist" 2>/dev/null && XDIST="-n ${TEST_WORKERS:-6}"
timeout -s INT -k 30 "${TEST_TIMEOUT:-300}" python3 -m pytest -m gpu ${TESTS:-tests/} -v -x $XDIST \
    -p no:cacheprovider --durations=0 > "$OUT/gpu_tests.txt" 2>&1
echo "gpu tests rc=$?" | tee -a "$OUT/gpu_tests.txt"; grep -E "PASSED|FAILED|ERROR|passed|failed|^[0-9.]+s call" "$OUT/gpu_tests.txt" | tail -60
fi
timeout 200 python3 -m exl2.cli.main bench --breakdown > "$OUT/bench.txt" 2>&1
echo "bench rc=$?"; cat "$OUT/bench.txt" | tail -40
if [ -n "${CONVERT_LAYERS:-}" ]; then
  timeout "${CONVERT_TIMEOUT:-200}" python3 benchmarks/convert_8b.py --layers "$CONVERT_LAYERS" ${CONVERT_ARGS:-} \
      --json "$OUT/convert.json" > "$OUT/convert.txt" 2>&1
  echo "convert rc=$?"; tail -30 "$OUT/convert.txt"
fi
timeout "${1:-150}" python3 benchmarks/kernels.py --only "${KERNELS_ONLY:-matmul}" --sweep --budget "$(( ${1:-150} - 20 ))" \
    --json "$OUT/kernels.json" > "$OUT/kernels.txt" 2>&1
echo "kernels rc=$?"; grep -v "^    " "$OUT/kernels.txt" | tail -80
