#!/usr/bin/env bash
# End-to-end A/B of the opt-in kernel paths on the device machine, one process per variant (the switches are read
# at import): decode at ctx 2048, fp16 cache, batch 1 and 16, on the pure 4-bit and the mixed 5/4/3-bit synthetic
# 8B. Usage (repo root): bash benchmarks/ab_device.sh   — output under $OUT/ab_*.txt
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
run() {  # name, env assignments..., -- bench args...
    local name=$1; shift
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
    env "${envs[@]}" timeout ${AB_TIMEOUT:-150} python3 -m exl2.cli.main bench --modes fp16 --contexts 2048 "$@" \
        > "$OUT/ab_$name.txt" 2>&1
    echo "== $name (rc=$?)"; grep -E "^\| (prefill|decode)|^  _|^  total" "$OUT/ab_$name.txt"
}
run base            EXL2_X=0 --
run grouped         EXL2_FUSE_SHARED_INPUT=1 --
run grouped_pipe3   EXL2_FUSE_SHARED_INPUT=1 EXL2_GEMV_DEPTH=0 EXL2_GEMV_STAGES=3 -- --breakdown
run grouped_pipe4   EXL2_FUSE_SHARED_INPUT=1 EXL2_GEMV_DEPTH=0 EXL2_GEMV_STAGES=4 --
run mixed_grouped   EXL2_FUSE_SHARED_INPUT=1 -- --mixed
run mixed_chunked_pipe3 EXL2_FUSE_SHARED_INPUT=1 EXL2_CHUNKED_MIXED=1 EXL2_GEMV_DEPTH=0 EXL2_GEMV_STAGES=3 -- --mixed
