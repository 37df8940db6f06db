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
    env "${envs[@]}" timeout 150 python3 -m exl2.cli.main bench --modes fp16 --contexts 2048 "$@" \
        > "$OUT/ab_$name.txt" 2>&1
    echo "== $name (rc=$?)"; grep -E "^\| (prefill|decode)" "$OUT/ab_$name.txt"
}
run base            EXL2_X=0 -- 
run grouped         EXL2_FUSE_SHARED_INPUT=1 -- 
run mixed_base      EXL2_X=0 -- --mixed
run mixed_chunked   EXL2_CHUNKED_MIXED=1 -- --mixed
run mixed_both      EXL2_CHUNKED_MIXED=1 EXL2_FUSE_SHARED_INPUT=1 -- --mixed
