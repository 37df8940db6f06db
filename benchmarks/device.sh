#!/usr/bin/env bash
# Device calls: GPU tests, end-to-end bench A/B runs, kernel sweeps and ncu profiles. Usage on the device machine,
# repo root: bash benchmarks/device.sh [STEP...] (default: s18). Output under $OUT.
# Tests: tests (every GPU test), quick (kernel-level), kvtests, dottests, gluontests.
# Benches: bench (--breakdown), final (the default bench, then a PDL-off breakdown), b128 (bs 1 and 16, fp16, ctx
# 128; BENCH_ARGS, e.g. --mixed, and TAG, the output name), nopdl, benchpdl, breakdown (PDL off), breakdown16,
# q4break, pbreak (per-kernel times of one prefill), prefetch (over PREFETCH_VALUES).
# envab runs the bench (BENCH_ARGS) once per environment in AB_SPECS ("A=1 B=2;A=2;": ';'-separated, empty = defaults);
# with BASE_SPEC=1 also the trees in .base/*.tar (carried; `git archive REF exl2` each).
# Kernel sweeps (benchmarks/kernels.py): merge, dequant, tiles, chunks, dot16, attnsweep; attnsweep2
# (benchmarks/attn_probe.py --sweep). ncu: stalls, ncugemv / ncumma (the M = 1 gemv / M = 16 Gluon kernel on
# NCU_SHAPES, gemv_probe.py: gate, q, k, down, head), ncuattn (decode attention on ATTN_SHAPES
# "batch:ctx:mode:splits ...", splits 0 = the kernel picks).
# Prefill host: gaps (prefill_host.py --gaps), hostvar (host issue time over 5 forwards, plain, after the bench's
# decode-graph capture, and pinned to HOSTVAR_PIN when set).
# Session steps: s17b (breakdowns at bs 1 and 16, then the bench over S17B_SPECS), s17c / s17d (PDL at batch 8/16),
# q4attn (attention + merge at batch 1, ctx 2048 over splits x tiles, q4 and fp16, then fp16/q4 benches three times),
# s18 (the next session's first call): every GPU test (session 17 moved the matmul kernels into modules and removed
# rejected variants without a GPU), the split-sum and shared-input tests on CUDA, then the default bench. s19 (the
# second): the EXL2_SPLIT_SUM A/B twice, then q4attn. s20 (session 18's work): the dynamic generator's and speculative
# decoding's GPU tests, then benchmarks/serving.py (N requests at once; the cost of a speculative check step). s21
# (session 19): those GPU tests, the batched sampler's tests on CUDA, serving.py (greedy and sampled, overlapped
# decode on and off), then the target bench with its breakdown. s22: the same without the bench, after the fused
# sampling draw. s24 (session 20): the q4 attention split sweep at batch 1, ctx 2048, then batches 2, 4 and 16 with the
# gemv up to 4 rows (the old default), 2 (the new one) and 1 (EXL2_GEMV_MAX_M), then benchmarks/sampling.py. s25
# (session 21): the sampler's tests on CUDA (the fused cutoff search and draw), sampling.py, serving.py, the bench.
# s26: the same without the bench, then the Gluon kernel's launch settings A/B at batches 2, 4 and 16. s27 (session
# 22): the GPU tests of the engine switches (prompt attention backends, RoPE overrides, Engine.close), eval with a
# chunked q4 cache on CUDA and CPU, sampling.py, then the target bench at batches 1, 2, 4 and 16. s28: the GPU tests of
# the extended samplers, banned strings and ranged penalties, then sampling.py with their cases. s29: the LoRA GPU
# tests with those of s27/s28, sampling.py (the extended samplers now draw through the fused kernel), a short bench.
# layout (session 23): benchmarks/layout_probe.py --stream, the batch-1 weight stream by layout against the real gemv;
# gemvsweep: the real gemv over launch settings (--sweep). s30: the classifier-free guidance GPU test, then
# serving.py with --cfg (a guided job's cost) at batches 1 and 4. s31 (session 24): the packed gemv decoders of
# every width and the PAIR_ORDER16 Gluon decoders: their GPU tests; s31b: the mixed-width bench on the trees in .base
# and this one; s31c: the same with the 4-bit body. s32: the packed gemv tests, then the mixed-width bench with the
# top bits decoded in fp16 (the default) and the integer way, PDL off, prefetch off; the 4-bit bench.
# (EXL2_GEMV_HIGH_FP16, the fp16 top-bit decoding, was removed after s32.) s33: the mixed bench with the gemv's
# prefetch off for mixed widths (the default), every prefetch off, the predicated prefetch on every weight
# (EXL2_GEMV_PREFETCH_MASKED=1), twice, and once gate/up split 2 ways (EXL2_GEMV_GROUP_PER_SM=8: shorter
# programs of fewer classes); the 4-bit bench with and without the predicated prefetch, twice.
# s34: the gemv alone on all-5/4/3-bit and mixed weights (`layout_probe.py --widths`), then s33 once. s35: the
# FP8 prompt-matmul GPU tests, then the bench with and without --prefill-fp8. s36: s35, the widths probe, and the
# mixed bench with and without the masked prefetch, to fit one call. s37: s35, then the mixed bench with the
# 64-column gemvs' registers capped at 64 and 72 (EXL2_GEMV_MAXNREG) against the compiler's choice. s38: the FP8
# GPU tests, the prefill breakdown with and without FP8, the mixed bench capped at 64 and not, alternating
# (EXL2_GEMV_MAXNREG was removed after it lost). s39: the FP8 prefill breakdown, its GPU tests, the plain prefill.
# s40: the target table (batches 2, 4, 16), the FP8 GPU tests, FP8 prefill with and without fast accumulation
# (EXL2_FP8_FAST_ACCUM, removed after it lost), the mixed bench with and without the masked prefetch (twice), the
# widths probe. s41 (session 26): the mixed bench at batches 1, 2, 16 on the trees in .base, this one, and with the
# masked prefetch (mixed-width programs now skip the classes they have no steps of); the widths probe with and
# without the masked prefetch; on an H200 the target table; the matmul GPU tests. s42: its short form (the mixed
# bench at batches 1-2 on .base and this tree, the widths probe on o and down, the mixed-width matmul GPU tests). s43: s42 without the tests, the widths probe on o alone.
# s46-s48 (session 27): A/Bs of int32 word loads of quantized KV rows (kept) and a GLU epilogue in the gate/up gemv
# (rejected); removed with their switches. s49 (next): the matmul, attention, KV and end-to-end GPU tests, the target
# table (batches 2, 4, 16), the mixed-width bench with fp16 and q4 caches. s50: decode attention tiles at batch 1,
# ctx 2048 for the q8, q6 and q3 caches, and the chunked-prefill tiles (256 queries over a 2,048-token q4 / fp16
# cache): is one stage right for every quantized mode and for prefill (session 27 measured q4 decode only)? Then
# PDL for split attention at batch 16 again (EXL2_PDL_SPLIT_ROWS=16 lost 10 % with q4 before the word loads), and
# the batch-1 gemvs with more programs (gate/up split 2 ways) or a deeper pipeline on the H200, where they are
# latency-bound (both lost on the H100 in session 11).
# s51-s53 (session 28): A/Bs of an L2 lookahead (each batch-1 gemv prefetching the next matrix's first lines as it
# ends; lost 8-10 %) and of prompt matmuls dequantizing the next one's weights on a side stream (no gain); both
# removed with their switches. s57 (session 29, run 2): the GPU tests of the 3-bit layout
# (`qweight.THREE_BIT_FIELDS`), then the mixed 5/4/3-bit bench on .base/pre3bit.tar (`git archive 4eb17f9 exl2`: the split 2 + 1-bit layout)
# and on this tree. s58 (run through s60 in session 30; the layout was reverted): the same check for the 5-bit
# layout, against .base/pre5bit.tar (`git archive fa65316 exl2`: whole 3-bit fields, split 4 + 1-bit 5-bit steps).
# s59 (session 30, for an H200): the target table, then batch 1-2 with twice the warps over the same words a thread
# (16 steps, 8 warps; also with 2 stages), register prefetch, and every matrix through the Gluon kernel. s60: s58,
# then s59's first two variants and the Gluon one. s62 (session 31): on an H200 the target table; elsewhere the
# gemv sweep with L2-resident weights (issue-bound, the H200's regime) over 32/64-column tiles, 8/16 steps and 4/8
# warps; then batch 1-2 with the narrow q/k/v setting off (EXL2_GEMV_NARROW=0, on by default since session 32),
# with 16 steps and 8 warps, and defaults. s66 (session 32): benchmarks/int8_gemv.py from DRAM on an H200 (then
# s62), from L2 elsewhere. ncumix: ncu of the grouped q/k/v and gate/up
# gemvs, 4-bit against the mixed body, both with the 64-column launch (EXL2_GEMV_NARROW=0). s68 (for session 33):
# the grouped-gemv GPU tests with EXL2_GEMV_GROUP_SELECT=1, then the mixed body with it off and on (session 33 made
# it the default and removed the own-widths switch it also tried). s69: the norm-gather's launch settings on the
# decode step's input (4 partials).
# s70: the option-table body (`--mixed table`, several width mixes a projection): a first run to compile its many
# kernels, then the one-body switch off and on, twice. s72 (for session 34): the target table (any GPU), then ncumix.
# s71: benchmarks/barrier_probe.py (a kernel boundary against a grid barrier, a phase of a dependent chain).
# s73 (session 34): the encoder's and speculative decoding's GPU tests (batched drafts: draft and verify graphs at
# batch 4), then benchmarks/serving.py's check-step table at batches 1-8. s74 (for session 35): the vision GPU test
# (fp16 Pixtral + injected image rows against transformers) and the speculative ones, then serving.py --ngram.
# s75 (session 35): the Qwen2.5-VL and Qwen3-VL GPU tests (fp16 towers, M-RoPE and DeepStack prefill rows, decode
# graphs with RoPE shifts); session 36 added their video tests and gpt-oss's (sinks in the paged kernel).
# s76 (session 36): benchmarks/moe_dispatch.py (MoE.forward's sorted dispatch against the per-expert one).
# s77 (session 37): the routed MoE GPU tests (CUDA-graph decoding of a quantized Qwen3-MoE-shaped model), then
# benchmarks/moe_decode.py (grouped / routed / graph decode of a Qwen3-30B-A3B-shaped model, MOE_LAYERS layers).
# s81: benchmarks/lora_batch.py (decode tok/s with no adapter, a global one, per-request ones).
# s80: s79 cut to fit little device time: the router, slot-sum, routed-path and per-request LoRA GPU tests, then the
# MoE bench at batches 1 and 16 with its breakdown.
# s79: the routed-expert, rotary-store and per-request LoRA tests on CUDA (session 38 made the interpreter-only ones
# run on a GPU too), the MoE bench with its breakdown (the router logits over more programs, the slot sum in one
# launch), then on an H200 the target table.
# s78: the fused router's, the q/k norm pair's, the routed GLU's and the dense routed experts' tests on CUDA (gpt-oss
# decodes through graphs with its bf16 experts stacked), then `exl2 bench --shape qwen3-30b-a3b --layers 8` with its
# per-kernel breakdown (after session 37's router in two launches and q/k norms in one).
# s54 (session 29, run 1): the register-prefetch 4-bit loop's GPU test, then the bench
# at batch 1-2 with it (EXL2_GEMV_RPF=1: no cp.async ring, so no barriers in the loop) and the one-row gemvs at 16
# steps an iteration and/or 8 warps (EXL2_GEMV_BS, EXL2_GEMV_WARPS): session 28 found them issue-bound on the H200
# (~135 of 335 instructions an iteration spent around the decoder). s56: the target table on an H200 (batches 2, 4,
# 16), then every matrix through the Gluon tensor-core kernel (EXL2_MMA_GEMV=2: its products cost no FMA a pair; it
# lost at batch 1 on the H100, 360 against 434, where the gemv was bandwidth-bound). s55: the real gemv over launch
# settings on gate/up and down (`gemvsweep`).
# s44: the widths probe on o and down, on the trees in .base and on this one. s45 (session 27 run 1, ~7 min:
# on an H100): the matmul GPU tests (the Gluon kernel's class skip), the target table, the mixed bench at batches 1-16 on
# .base (`git archive f24edf8 exl2 benchmarks`), this tree and with the masked prefetch, the widths probe on q/k/v and
# gate/up.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} EXL2_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo "?")
mkdir -p "$OUT"
layout_tests() {  # the GPU tests a new weight layout must pass, run in the current tree: layout_tests OUTFILE LABEL
  timeout -s INT -k 10 200 python3 -m pytest -m gpu tests/test_gpu_e2e.py tests/test_kernels_quant_matmul.py -q -n 8 \
    -p no:cacheprovider -rfE -k "gluon or packed or fast_4bit or real_sizes or golden_greedy_decode_matches_cpu" \
    > "$1" 2>&1; echo "$2 tests rc=$?"; tail -3 "$1"
}
steps=${*:-s18}
for s in $steps; do
  case $s in
  layout) timeout ${LAYOUT_TIMEOUT:-300} python3 benchmarks/layout_probe.py --stream --json "$OUT/layout.json" > "$OUT/layout.txt" 2>&1
         echo "layout rc=$?"; cat "$OUT/layout.txt" | tail -120 ;;
  gemvsweep) timeout ${LAYOUT_TIMEOUT:-540} python3 benchmarks/layout_probe.py --sweep --shapes ${SWEEP_SHAPES:-o,down,qkv,gateup} \
           --json "$OUT/gemvsweep.json" \
           > "$OUT/gemvsweep.txt" 2>&1; echo "gemvsweep rc=$?"; sort -t'|' -k2,2 -k4,4n "$OUT/gemvsweep.txt" | awk -F'|' '{c[$2]++} c[$2]<=8' ;;
  bench) timeout 200 python3 -m exl2.cli.main bench --breakdown > "$OUT/bench.txt" 2>&1; echo "bench rc=$?"
         tail -28 "$OUT/bench.txt" ;;
  nopdl) EXL2_PDL=0 timeout 110 python3 -m exl2.cli.main bench --modes fp16 --contexts 2048 \
           > "$OUT/bench_nopdl.txt" 2>&1; echo "bench (PDL off) rc=$?"; tail -6 "$OUT/bench_nopdl.txt" ;;
  stalls) timeout 40 ncu --clock-control none --kernel-name regex:gemv --launch-skip 9 --launch-count 1 \
           --section SchedulerStats --metrics "regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$" \
           python3 benchmarks/gemv_probe.py --shape gate > "$OUT/ncu_stalls_gate.txt" 2>&1; echo "ncu stalls rc=$?"
         grep -E "stalled|Issued Warp|Eligible" "$OUT/ncu_stalls_gate.txt" | sort -k3 -n -r | head -12 ;;
  merge) timeout 150 python3 benchmarks/kernels.py --only merge --budget 135 --json "$OUT/merge.json" \
           > "$OUT/merge.txt" 2>&1; echo "merge rc=$?"; grep -v "^    " "$OUT/merge.txt" | tail -40 ;;
  dequant) timeout ${DEQUANT_TIMEOUT:-150} python3 benchmarks/kernels.py --only dequant --budget ${DEQUANT_BUDGET:-130} \
           --json "$OUT/dequant.json" > "$OUT/dequant.txt" 2>&1; echo "dequant rc=$?"; grep -v "^    " "$OUT/dequant.txt" | tail -12 ;;
  tiles) timeout ${TILES_TIMEOUT:-105} python3 benchmarks/kernels.py --only tiles --budget ${TILES_BUDGET:-90} --json "$OUT/tiles.json" \
           > "$OUT/tiles.txt" 2>&1; echo "tiles rc=$?"; grep -v "^    " "$OUT/tiles.txt" | tail -14 ;;
  breakdown) EXL2_PDL=0 timeout 130 python3 -m exl2.cli.main bench --modes fp16 --breakdown \
           > "$OUT/bench_nopdl_breakdown.txt" 2>&1; echo "bench (PDL off) rc=$?"; tail -24 "$OUT/bench_nopdl_breakdown.txt" ;;
  benchpdl) timeout 120 python3 -m exl2.cli.main bench > "$OUT/bench_pdl.txt" 2>&1; echo "bench (PDL on) rc=$?"
         tail -9 "$OUT/bench_pdl.txt" ;;
  final) timeout 130 python3 -m exl2.cli.main bench > "$OUT/bench_final.txt" 2>&1; echo "bench rc=$?"
         tail -9 "$OUT/bench_final.txt"
         EXL2_PDL=0 timeout 100 python3 -m exl2.cli.main bench --modes fp16 --contexts 2048 --breakdown \
           > "$OUT/bench_final_breakdown.txt" 2>&1; echo "bench (PDL off) rc=$?"; tail -22 "$OUT/bench_final_breakdown.txt" ;;
  prefetch) for pf in ${PREFETCH_VALUES:-0 64 256}; do
             EXL2_PREFETCH=$pf timeout ${BENCH_TIMEOUT:-110} python3 -m exl2.cli.main bench --modes ${MODES:-fp16} \
               --contexts 2048 > "$OUT/bench_prefetch$pf.txt" 2>&1; echo "bench EXL2_PREFETCH=$pf rc=$?"
             tail -7 "$OUT/bench_prefetch$pf.txt"; done ;;
  gaps) timeout ${GAPS_TIMEOUT:-150} python3 benchmarks/prefill_host.py --top 15 --gaps --graph > "$OUT/prefill_gaps.txt" 2>&1
        echo "prefill gaps rc=$?"; grep -vE "^ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ " "$OUT/prefill_gaps.txt" | tail -40 ;;
  hostvar) lscpu | grep -E "^(Model name|NUMA node)"; nvidia-smi topo -m 2>/dev/null | grep -E "^GPU0" | tr -s ' \t' ' '
        for v in "" "--bench-setup" ${HOSTVAR_PIN:+"taskset -c $HOSTVAR_PIN"}; do
          case $v in taskset*) cmd="$v python3 benchmarks/prefill_host.py"; tag=pin ;;
                     *) cmd="python3 benchmarks/prefill_host.py $v"; tag=${v:+setup} ;; esac
          timeout 120 $cmd --repeat 5 --top 14 > "$OUT/prefill_host_${tag:-plain}.txt" 2>&1
          echo "prefill_host [$v] rc=$?"; grep -E "^host|function calls" "$OUT/prefill_host_${tag:-plain}.txt"; done ;;
  chunks) timeout ${CHUNKS_TIMEOUT:-150} python3 benchmarks/kernels.py --only chunks --budget ${CHUNKS_BUDGET:-130} \
           --json "$OUT/chunks.json" > "$OUT/chunks.txt" 2>&1; echo "chunks rc=$?"; grep -E "^  chunks|^\| " "$OUT/chunks.txt" | tail -40 ;;
  s17b) EXL2_PDL=0 timeout 100 python3 -m exl2.cli.main bench --modes fp16 --contexts 2048 --prefill 64 --breakdown \
           > "$OUT/bench_breakdown1.txt" 2>&1; echo "breakdown bs1 rc=$?"; grep -E "^  _|^  total" "$OUT/bench_breakdown1.txt" | head -12
        bash "$0" breakdown16 | grep -E "^  _|^  total|rc=" | head -12
        AB_SPECS="${S17B_SPECS:-;EXL2_PDL_SMALL_ROWS=16;EXL2_PDL_MAX_ROWS=16;EXL2_MMA4_PER_SM=3;EXL2_MMA4_PER_SM=6;EXL2_MMA4_PER_SM=8;EXL2_MMA4_STAGES=3;EXL2_MMA4_STAGES=6;EXL2_ATTN_MAX_SPLITS=16;EXL2_PREFETCH=0;}" \
          bash "$0" envab ;;
  s17c) AB_SPECS=";EXL2_PDL_MAX_ROWS=16;EXL2_PDL_MAX_ROWS=16 EXL2_PDL_SMALL_ROWS=4;EXL2_PDL_MAX_ROWS=16; " TAG=_b16 \
          BENCH_ARGS="--modes fp16,q4 --contexts 128,2048 --prefill 2047" bash "$0" envab
        AB_SPECS=";EXL2_PDL_MAX_ROWS=16" TAG=_b8 BENCH_ARGS="--modes fp16 --contexts 128 --prefill 64 --batch 8" bash "$0" envab ;;
  s17d) AB_SPECS=";EXL2_PDL_MAX_ROWS=16 EXL2_PDL_SPLIT_ROWS=4;EXL2_PDL_MAX_ROWS=16 EXL2_PDL_SPLIT_ROWS=16;EXL2_PDL_MAX_ROWS=16 EXL2_PDL_SPLIT_ROWS=4; " \
          TAG=_b16 BENCH_ARGS="--modes fp16,q4 --contexts 128 --prefill 64" bash "$0" envab
        AB_SPECS=";EXL2_PDL_MAX_ROWS=16 EXL2_PDL_SPLIT_ROWS=4;EXL2_PDL_MAX_ROWS=16 EXL2_PDL_SPLIT_ROWS=16" TAG=_b8 \
          BENCH_ARGS="--modes fp16,q4 --contexts 128 --prefill 64 --batch 8" bash "$0" envab ;;
  q4attn) for mode in q4 fp16; do timeout ${SWEEP_TIMEOUT:-150} python3 benchmarks/attn_probe.py --split-sweep --batch 1 \
            --ctx 2048 --mode $mode > "$OUT/attn_split_$mode.txt" 2>&1; echo "split sweep $mode rc=$?"
            sort -t'|' -k12 -n "$OUT/attn_split_$mode.txt" | grep -E "^\| 1 " | head -5; done
          AB_SPECS=";; " TAG=_q4 BENCH_ARGS="--modes fp16,q4 --contexts 2048 --prefill 64 --batch 2" bash "$0" envab ;;
  s18) TEST_TIMEOUT=${TEST_TIMEOUT:-330} bash "$0" tests
       timeout 100 python3 -m pytest tests/test_split_sum.py tests/test_shared_input.py -q -p no:cacheprovider -rfE \
         > "$OUT/gpu_split_shared.txt" 2>&1; echo "split-sum and shared-input tests (cuda) rc=$?"; tail -n 2 "$OUT/gpu_split_shared.txt"
       timeout 150 python3 -m exl2.cli.main bench > "$OUT/bench_s18.txt" 2>&1; echo "bench rc=$?"; tail -9 "$OUT/bench_s18.txt" ;;
  s19) AB_SPECS="EXL2_SPLIT_SUM=0;EXL2_SPLIT_SUM=1;EXL2_SPLIT_SUM=0;EXL2_SPLIT_SUM=1" TAG=_split \
         BENCH_ARGS="--modes fp16,q4 --contexts 128,2048 --prefill 64" bash "$0" envab
       bash "$0" q4attn ;;
  s20) timeout -s INT -k 15 200 python3 -m pytest -m gpu tests/test_gpu_e2e.py -k "dynamic or speculative" -q \
         -p no:cacheprovider -rfE > "$OUT/gpu_dynamic.txt" 2>&1; echo "dynamic/speculative GPU tests rc=$?"
       tail -n 4 "$OUT/gpu_dynamic.txt"
       timeout 240 python3 benchmarks/serving.py > "$OUT/serving.txt" 2>&1; echo "serving rc=$?"; tail -16 "$OUT/serving.txt" ;;
  s21) timeout -s INT -k 15 ${TEST_TIMEOUT:-150} python3 -m pytest -m gpu tests/test_gpu_e2e.py -k "dynamic or speculative" -q \
         -p no:cacheprovider -rfE > "$OUT/gpu_dynamic.txt" 2>&1; echo "dynamic/speculative GPU tests rc=$?"
       tail -n 3 "$OUT/gpu_dynamic.txt"
       timeout -s INT -k 15 90 python3 -m pytest tests/test_sampler.py -q -p no:cacheprovider -rfE > "$OUT/sampler_cuda.txt" 2>&1
       echo "sampler tests (cpu + cuda) rc=$?"; tail -n 2 "$OUT/sampler_cuda.txt"
       timeout 200 python3 benchmarks/serving.py > "$OUT/serving.txt" 2>&1; echo "serving rc=$?"; tail -22 "$OUT/serving.txt"
       timeout 150 python3 -m exl2.cli.main bench --breakdown > "$OUT/bench.txt" 2>&1; echo "bench rc=$?"; tail -28 "$OUT/bench.txt" ;;
  s22) timeout -s INT -k 10 60 python3 -m pytest tests/test_sampler.py -q -p no:cacheprovider -rfE > "$OUT/sampler_cuda.txt" 2>&1
       echo "sampler tests (cpu + cuda) rc=$?"; tail -n 2 "$OUT/sampler_cuda.txt"
       timeout ${SERVING_TIMEOUT:-150} python3 benchmarks/serving.py --batches 1,16 > "$OUT/serving.txt" 2>&1; echo "serving rc=$?"
       tail -22 "$OUT/serving.txt"
       timeout -s INT -k 10 ${TEST_TIMEOUT:-200} python3 -m pytest -m gpu tests/test_gpu_e2e.py -k "${S22_TESTS:-dynamic or speculative}" \
         -q -p no:cacheprovider -rfE --durations=3 > "$OUT/gpu_dynamic.txt" 2>&1; echo "dynamic/speculative GPU tests rc=$?"
       tail -n 6 "$OUT/gpu_dynamic.txt" ;;
  s24) timeout ${SWEEP_TIMEOUT:-170} python3 benchmarks/attn_probe.py --split-sweep --batch 1 --ctx 2048 --mode q4 \
         > "$OUT/attn_split_q4.txt" 2>&1; echo "q4 split sweep rc=$?"
       grep -E "^\| 1 " "$OUT/attn_split_q4.txt" | sort -t'|' -k12 -g | head -6
       grep -E "^\| 1 \| 2048 \| q4 \| None \| random \| perm \| 64 \| 4 \| 2 " "$OUT/attn_split_q4.txt"
       AB_SPECS="EXL2_GEMV_MAX_M=4;EXL2_GEMV_MAX_M=2;EXL2_GEMV_MAX_M=1;EXL2_GEMV_MAX_M=4;EXL2_GEMV_MAX_M=2" TAG=_rows BENCH_TIMEOUT=70 \
         BENCH_ARGS="--modes fp16 --contexts 128 --prefill 64 --batch 2,4,16" bash "$0" envab
       timeout 40 python3 benchmarks/sampling.py --profile > "$OUT/sampling.txt" 2>&1; echo "sampling rc=$?"
       head -10 "$OUT/sampling.txt" ;;
  s25) timeout -s INT -k 10 90 python3 -m pytest tests/test_sampler.py -q -p no:cacheprovider -rfE > "$OUT/sampler_cuda.txt" 2>&1
       echo "sampler tests (cpu + cuda) rc=$?"; tail -n 3 "$OUT/sampler_cuda.txt"
       timeout 60 python3 benchmarks/sampling.py --profile > "$OUT/sampling.txt" 2>&1; echo "sampling rc=$?"; head -30 "$OUT/sampling.txt"
       timeout ${SERVING_TIMEOUT:-150} python3 benchmarks/serving.py --batches 1,16 > "$OUT/serving.txt" 2>&1; echo "serving rc=$?"
       tail -14 "$OUT/serving.txt"
       timeout 200 python3 -m exl2.cli.main bench --batch 2,4,16 > "$OUT/bench.txt" 2>&1; echo "bench rc=$?"; tail -12 "$OUT/bench.txt" ;;
  s26) timeout -s INT -k 10 90 python3 -m pytest tests/test_sampler.py -q -p no:cacheprovider -rfE > "$OUT/sampler_cuda.txt" 2>&1
       echo "sampler tests (cpu + cuda) rc=$?"; tail -n 3 "$OUT/sampler_cuda.txt"
       timeout 60 python3 benchmarks/sampling.py --profile > "$OUT/sampling.txt" 2>&1; echo "sampling rc=$?"; head -26 "$OUT/sampling.txt"
       timeout ${SERVING_TIMEOUT:-150} python3 benchmarks/serving.py --batches 1,16 > "$OUT/serving.txt" 2>&1; echo "serving rc=$?"
       head -11 "$OUT/serving.txt"
       AB_SPECS=";EXL2_MMA4_PER_SM=2;EXL2_MMA4_PER_SM=6;EXL2_MMA4_PER_SM=8;EXL2_MMA4_STAGES=6;EXL2_MMA4_V=1;EXL2_MMA4_V=4;EXL2_MMA4_BS=8; " \
         TAG=_mma BENCH_TIMEOUT=60 BENCH_ARGS="--modes fp16 --contexts 128 --prefill 64 --batch 2,4,16" bash "$0" envab ;;
  s27) timeout -s INT -k 15 ${TEST_TIMEOUT:-240} python3 -m pytest -m gpu tests/test_gpu_engine.py tests/test_gpu_e2e.py \
         -k "engine or backends or rope" -q -n 4 -p no:cacheprovider -rfE > "$OUT/gpu_s27.txt" 2>&1
       echo "engine/rope/backend GPU tests rc=$?"; tail -n 12 "$OUT/gpu_s27.txt"
       for cm in fp16 q4; do for dev in cuda cpu; do echo "eval -cm $cm --chunk 32 --device $dev"
         timeout 100 python3 -m exl2.cli.main eval -m tests/fixtures/golden/b4.0_hb6 -cm $cm --chunk 32 -r 4 -l 256 \
           --device $dev --json 2>&1 | tail -n 3; done; done > "$OUT/eval_cm.txt"; cat "$OUT/eval_cm.txt"
       timeout 60 python3 benchmarks/sampling.py > "$OUT/sampling.txt" 2>&1; echo "sampling rc=$?"; head -14 "$OUT/sampling.txt"
       timeout ${BENCH_TIMEOUT:-200} python3 -m exl2.cli.main bench --batch 2,4,16 > "$OUT/bench.txt" 2>&1
       echo "bench rc=$?"; tail -n 16 "$OUT/bench.txt" ;;
  s28) timeout -s INT -k 15 ${TEST_TIMEOUT:-200} python3 -m pytest -m gpu tests/test_gpu_e2e.py \
         -k "extended" -q -p no:cacheprovider -rfE > "$OUT/gpu_s28.txt" 2>&1
       echo "extended-sampler GPU tests rc=$?"; tail -n 6 "$OUT/gpu_s28.txt"
       timeout 120 python3 benchmarks/sampling.py > "$OUT/sampling.txt" 2>&1; echo "sampling rc=$?"; cat "$OUT/sampling.txt" ;;
  s29) timeout -s INT -k 15 ${TEST_TIMEOUT:-240} python3 -m pytest -m gpu tests/test_gpu_e2e.py tests/test_gpu_engine.py \
         -k "lora or extended or rope or backends or close" -q -n 4 -p no:cacheprovider -rfE > "$OUT/gpu_s29.txt" 2>&1
       echo "LoRA/sampler/engine GPU tests rc=$?"; tail -n 8 "$OUT/gpu_s29.txt"
       timeout 120 python3 benchmarks/sampling.py > "$OUT/sampling.txt" 2>&1; echo "sampling rc=$?"; cat "$OUT/sampling.txt"
       timeout ${BENCH_TIMEOUT:-150} python3 -m exl2.cli.main bench --modes fp16 --contexts 128,2048 --prefill 64 \
         > "$OUT/bench.txt" 2>&1; echo "bench rc=$?"; tail -n 7 "$OUT/bench.txt" ;;
  attnsweep2) timeout ${SWEEP_TIMEOUT:-170} python3 benchmarks/attn_probe.py --sweep ${ATTN_SWEEP_ARGS:-} > "$OUT/attn_probe${TAG}.txt" 2>&1
           echo "attn_probe sweep rc=$?"; tail -60 "$OUT/attn_probe${TAG}.txt" ;;
  ncuattn) for shape in ${ATTN_SHAPES:-16:128:fp16:1 1:2048:fp16:0}; do IFS=: read -r ab actx amode asp <<< "$shape"
           timeout 90 ncu --clock-control none --kernel-name regex:_attn_kernel --launch-skip 3 --launch-count 1 \
             --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
             --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters \
             --metrics "regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$" \
             python3 benchmarks/attn_probe.py --batch $ab --ctx $actx --mode $amode --splits $asp \
             > "$OUT/ncu_attn_${ab}_${actx}_${amode}.txt" 2>&1; echo "ncu attn $shape rc=$?"
           grep -E "Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occ|Block Limit|Issued Warp|Eligible Warps|Warp Cycles Per Issued|Executed Instructions  |Grid Size|Waves|L2 Hit|L1/TEX Hit" "$OUT/ncu_attn_${ab}_${actx}_${amode}.txt" | head -24
           grep -E "stalled" "$OUT/ncu_attn_${ab}_${actx}_${amode}.txt" | sort -k3 -g -r | head -8; done ;;
  pbreak) timeout ${BENCH_TIMEOUT:-150} python3 -m exl2.cli.main bench --modes fp16 --contexts 128 --batch 2 --breakdown-prefill \
           $BENCH_ARGS > "$OUT/bench_prefill_breakdown${TAG}.txt" 2>&1; echo "bench (prefill breakdown) rc=$?"
         tail -22 "$OUT/bench_prefill_breakdown${TAG}.txt" ;;
  breakdown16) timeout 130 python3 -m exl2.cli.main bench --modes fp16 --contexts 128 --breakdown --breakdown-batch 16 ${BREAKDOWN_ARGS:-} \
           > "$OUT/bench_breakdown16.txt" 2>&1; echo "bench (breakdown bs16) rc=$?"; tail -24 "$OUT/bench_breakdown16.txt" ;;
  dottests) timeout -s INT -k 15 "${TEST_TIMEOUT:-150}" python3 -m pytest -m gpu tests/test_kernels_quant_matmul.py \
           tests/test_gpu_e2e.py -k "quant_matmul_real_sizes or fast_4bit_dot or grouped_gemv_real" -q -n 8 \
           -p no:cacheprovider -rfE > "$OUT/gpu_dot.txt" 2>&1; echo "dot tests rc=$?"; tail -6 "$OUT/gpu_dot.txt" ;;
  dot16) timeout ${DOT16_TIMEOUT:-260} python3 benchmarks/kernels.py --only dot16 --budget ${DOT16_BUDGET:-240} \
           --json "$OUT/dot16.json" > "$OUT/dot16.txt" 2>&1; echo "dot16 rc=$?"; grep -v "^    " "$OUT/dot16.txt" | tail -24 ;;
  gluontests) timeout -s INT -k 15 "${TEST_TIMEOUT:-200}" python3 -m pytest -m gpu tests/test_gpu_e2e.py \
           tests/test_kernels_quant_matmul.py -k "gluon or batched_decode_through" -q -n 8 -p no:cacheprovider -rfE \
           > "$OUT/gpu_gluon${TAG}.txt" 2>&1; echo "gluon tests rc=$?"; tail -6 "$OUT/gpu_gluon${TAG}.txt"
           timeout -s INT -k 15 120 python3 -m pytest tests/test_shared_input.py -q -p no:cacheprovider -rfE \
           > "$OUT/gpu_shared${TAG}.txt" 2>&1; echo "shared-input tests (cuda) rc=$?"; tail -3 "$OUT/gpu_shared${TAG}.txt" ;;
  b128) timeout ${BENCH_TIMEOUT:-110} python3 -m exl2.cli.main bench --modes fp16 --contexts 128 $BENCH_ARGS \
           > "$OUT/bench_b128${TAG}.txt" 2>&1; echo "bench fp16 ctx 128 $BENCH_ARGS $TAG rc=$?"; tail -4 "$OUT/bench_b128${TAG}.txt" ;;
  ncugemv) for shape in ${NCU_SHAPES:-gate q}; do
           timeout 60 ncu --clock-control none --kernel-name regex:gemv --launch-skip 9 --launch-count 1 \
             --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
             --section SchedulerStats --section InstructionStats \
             --metrics "regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$" \
             python3 benchmarks/gemv_probe.py --shape $shape > "$OUT/ncu_gemv_$shape.txt" 2>&1; echo "ncu gemv $shape rc=$?"
           grep -E "Duration|DRAM Throughput|Registers Per|Shared Memory Config|Achieved Occupancy|Theoretical Occ|Block Limit|Issue Slots Busy|Issued Warp|Eligible Warps|No Eligible|Warp Cycles Per Issued|Executed Instructions  |Grid Size|Waves" "$OUT/ncu_gemv_$shape.txt" | head -24
           grep -E "stalled" "$OUT/ncu_gemv_$shape.txt" | sort -k3 -g -r | head -8; done ;;
  ncumix) for spec in "qkv" "qkv --mixed" "gateup" "gateup --mixed"; do tag=$(echo "$spec" | tr -d ' -')
           EXL2_GEMV_NARROW=0 timeout 60 ncu --clock-control none --kernel-name regex:gemv_group --launch-skip 2 \
             --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
             --section SchedulerStats --section InstructionStats \
             --metrics "regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$" \
             python3 benchmarks/gemv_probe.py --shape $spec > "$OUT/ncu_$tag.txt" 2>&1; echo "ncu $spec rc=$?"
           grep -E "Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occ|Issued Warp|Eligible Warps|No Eligible|Warp Cycles Per Issued|Executed Instructions  |Grid Size" "$OUT/ncu_$tag.txt" | head -14
           grep -E "stalled" "$OUT/ncu_$tag.txt" | sort -k3 -g -r | head -6; done ;;
  s68) EXL2_GEMV_GROUP_SELECT=1 timeout -s INT -k 10 200 python3 -m pytest -m gpu \
         tests/test_gpu_e2e.py tests/test_kernels_quant_matmul.py -q -n 8 -p no:cacheprovider -rfE \
         -k "group or real_sizes or mixed or golden_greedy_decode_matches_cpu" > "$OUT/gpu_select.txt" 2>&1
       echo "one-body group tests rc=$?"; tail -3 "$OUT/gpu_select.txt"
       AB_SPECS="EXL2_GEMV_GROUP_SELECT=0;EXL2_GEMV_GROUP_SELECT=1;EXL2_GEMV_GROUP_SELECT=0;EXL2_GEMV_GROUP_SELECT=1" \
         TAG=_select BENCH_TIMEOUT=90 \
         BENCH_ARGS="--mixed --modes fp16 --contexts 128 --prefill 64 --batch 2,16" bash "$0" envab ;;
  s69) timeout 120 python3 benchmarks/kernels.py --only norm --budget 100 --json "$OUT/norm.json" > "$OUT/norm.txt" 2>&1
       echo "norm sweep rc=$?"; grep -E "rms_norm_gather|norm alone" "$OUT/norm.txt" | head -30 ;;
  s70) AB_SPECS="EXL2_GEMV_GROUP_SELECT=0;EXL2_GEMV_GROUP_SELECT=1;EXL2_GEMV_GROUP_SELECT=0;EXL2_GEMV_GROUP_SELECT=1" \
         TAG=_table BENCH_TIMEOUT=140 \
         BENCH_ARGS="--mixed table --modes fp16 --contexts 128 --prefill 64 --batch 2,16" bash "$0" envab ;;
  s72) timeout 200 python3 -m exl2.cli.main bench --batch 2,4,16 > "$OUT/bench_target.txt" 2>&1; echo "bench rc=$?"
       nvidia-smi --query-gpu=name --format=csv,noheader | head -1
       grep -E "^\| (decode|prefill)" "$OUT/bench_target.txt"; bash "$0" ncumix ;;
  s73) timeout -s INT -k 10 ${TEST_TIMEOUT:-420} python3 -m pytest -m gpu tests/test_encoder.py tests/test_gpu_e2e.py \
         -k "encoder or speculative" -q -p no:cacheprovider -rfE --durations=5 > "$OUT/gpu_spec.txt" 2>&1
       echo "encoder/speculative GPU tests rc=$?"
       tail -4 "$OUT/gpu_spec.txt"
       [ -n "${SKIP_SERVING:-}" ] && exit 0
       timeout 200 python3 benchmarks/serving.py --batches 1 --new 32 > "$OUT/serving.txt" 2>&1; echo "serving rc=$?"
       grep -A20 "^speculative" "$OUT/serving.txt" ;;
  s74) timeout -s INT -k 10 ${TEST_TIMEOUT:-300} python3 -m pytest -m gpu tests/test_vision_chat.py tests/test_gpu_e2e.py \
         -k "gpu or speculative" -q -p no:cacheprovider -rfE > "$OUT/gpu_vision.txt" 2>&1
       echo "vision/speculative GPU tests rc=$?"; tail -4 "$OUT/gpu_vision.txt"
       timeout 240 python3 benchmarks/serving.py --batches 1,2,4,8 --new 64 --ngram --no-speculative \
         > "$OUT/serving_ngram.txt" 2>&1; echo "serving --ngram rc=$?"; grep -A8 "^n-gram" "$OUT/serving_ngram.txt" ;;
  s75) timeout -s INT -k 10 ${TEST_TIMEOUT:-400} python3 -m pytest -m gpu tests/test_vision_qwen2vl_chat.py \
         tests/test_vision_qwen3vl_chat.py tests/test_vision_qwen_video.py tests/test_gpt_oss.py -q \
         -p no:cacheprovider -rfE > "$OUT/gpu_qwen2vl.txt" 2>&1
       echo "Qwen2.5-VL / Qwen3-VL GPU tests rc=$?"; tail -4 "$OUT/gpu_qwen2vl.txt" ;;
  s77) timeout -s INT -k 10 300 python3 -m pytest -m gpu tests/test_routed_experts.py tests/test_mla_cache.py -q \
         -p no:cacheprovider -rfE > "$OUT/gpu_routed.txt" 2>&1; echo "routed MoE GPU tests rc=$?"
       grep -vE "it/s\]" "$OUT/gpu_routed.txt" | tail -25
       timeout 400 python3 benchmarks/moe_decode.py --layers ${MOE_LAYERS:-8} > "$OUT/moe_decode.txt" 2>&1
       echo "moe decode rc=$?"; cat "$OUT/moe_decode.txt" | tail -20 ;;
  s81) timeout 300 python3 benchmarks/lora_batch.py --batches 1,4,16 > "$OUT/lora_batch.txt" 2>&1
       echo "lora batch rc=$?"; cat "$OUT/lora_batch.txt" ;;
  s80) timeout -s INT -k 10 150 python3 -m pytest -m "gpu or not gpu" tests/test_routed_experts.py \
         tests/test_lora_per_request.py -k "softmax or slot_sum or routed_path or graph or glu or per_request_adapters" \
         -q -p no:cacheprovider -n 8 > "$OUT/gpu_s80.txt" 2>&1
       echo "router / slot-sum / per-request LoRA tests rc=$?"; grep -E "passed|failed|FAILED" "$OUT/gpu_s80.txt" | tail -8
       timeout 150 python3 -m exl2.cli.main bench --shape qwen3-30b-a3b --layers 8 --modes fp16 --contexts 128 \
         --prefill 512 --batch 16 --breakdown > "$OUT/bench_moe.txt" 2>&1; echo "moe bench rc=$?"
       grep -vE "it/s\]|[Ww]arn" "$OUT/bench_moe.txt" | tail -22 ;;
  s79) timeout -s INT -k 10 240 python3 -m pytest -m "gpu or not gpu" tests/test_routed_experts.py \
         tests/test_lora_per_request.py tests/test_kernels_small.py -k "routed or dense or glu or rotary_store or per_request" \
         -q -p no:cacheprovider -n 8 > "$OUT/gpu_s79.txt" 2>&1
       echo "routed / per-request LoRA tests rc=$?"; grep -E "passed|failed|FAILED" "$OUT/gpu_s79.txt" | tail -12
       timeout 200 python3 -m exl2.cli.main bench --shape qwen3-30b-a3b --layers 8 --modes fp16 --contexts 128 \
         --prefill 512 --batch 4,16 --breakdown > "$OUT/bench_moe.txt" 2>&1; echo "moe bench rc=$?"
       grep -vE "it/s\]|[Ww]arn" "$OUT/bench_moe.txt" | tail -24
       gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
       if [[ "$gpu" == *H200* ]]; then
         timeout 150 python3 -m exl2.cli.main bench --batch 2,4,16 > "$OUT/bench_target.txt" 2>&1; echo "bench rc=$?"
         grep -E "^\| (decode|prefill)" "$OUT/bench_target.txt"
       fi ;;
  s78) timeout -s INT -k 10 240 python3 -m pytest -m "gpu or not gpu" tests/test_routed_experts.py \
         tests/test_kernels_small.py tests/test_gpt_oss.py tests/test_mla_cache.py -q -p no:cacheprovider -n 4 \
         > "$OUT/gpu_router.txt" 2>&1
       echo "router / norm-pair tests rc=$?"; tail -3 "$OUT/gpu_router.txt"
       timeout 300 python3 -m exl2.cli.main bench --shape qwen3-30b-a3b --layers 8 --modes fp16 --contexts 128 \
         --prefill 512 --batch 4,16 --breakdown > "$OUT/bench_moe.txt" 2>&1; echo "moe bench rc=$?"
       grep -vE "it/s\]|[Ww]arn" "$OUT/bench_moe.txt" | tail -24 ;;
  s76) timeout 120 python3 benchmarks/moe_dispatch.py > "$OUT/moe_dispatch.txt" 2>&1; echo "moe dispatch rc=$?"
       cat "$OUT/moe_dispatch.txt" ;;
  s71) timeout 120 python3 benchmarks/barrier_probe.py > "$OUT/barrier.txt" 2>&1; echo "barrier probe rc=$?"
       cat "$OUT/barrier.txt" ;;
  ncumma) for shape in ${NCU_SHAPES:-gate down}; do
           timeout 90 ncu --clock-control none --kernel-name regex:_mma_kernel --launch-skip 3 --launch-count 1 \
             --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
             --section SchedulerStats --section InstructionStats \
             --metrics "regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$" \
             python3 benchmarks/gemv_probe.py --shape $shape --rows 16 > "$OUT/ncu_mma16_$shape.txt" 2>&1
           echo "ncu mma M=16 $shape rc=$?"
           grep -E "Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occ|Block Limit|Issued Warp|Eligible Warps|Warp Cycles Per Issued|Executed Instructions  |Grid Size|Waves" "$OUT/ncu_mma16_$shape.txt" | head -20
           grep -E "stalled" "$OUT/ncu_mma16_$shape.txt" | sort -k3 -g -r | head -8; done ;;
  envab) IFS=';' read -ra specs <<< "${AB_SPECS:-}"; i=0
         if [ -n "${BASE_SPEC:-}" ]; then  # baselines: each .base/NAME.tar (git archive REF exl2), as bench_NAME.txt
           for tarf in .base/*.tar; do name=$(basename "$tarf" .tar)
             rm -rf /tmp/base && mkdir -p /tmp/base && tar -xf "$tarf" -C /tmp/base
             (cd /tmp/base && timeout ${BENCH_TIMEOUT:-110} python3 -m exl2.cli.main bench $BENCH_ARGS) > "$OUT/bench_$name${TAG}.txt" 2>&1
             echo "bench [tree $tarf] $BENCH_ARGS rc=$?"; grep -E "^\| (decode|prefill)" "$OUT/bench_$name${TAG}.txt"; done; fi
         for spec in "${specs[@]}"; do i=$((i+1))
           env $spec timeout ${BENCH_TIMEOUT:-110} python3 -m exl2.cli.main bench $BENCH_ARGS > "$OUT/bench_ab$i${TAG}.txt" 2>&1
           echo "bench [$spec] $BENCH_ARGS rc=$?"; grep -E "^\| (decode|prefill)" "$OUT/bench_ab$i${TAG}.txt"; done ;;
  quick) timeout -s INT -k 15 "${TEST_TIMEOUT:-150}" python3 -m pytest -m gpu tests/test_kernels_attention.py \
           tests/test_gpu_e2e.py -k "fast or attention or paged or prefill or group or graph" -q -n ${TEST_WORKERS:-8} \
           -p no:cacheprovider -rfE > "$OUT/gpu_quick.txt" 2>&1; echo "quick tests rc=$?"; tail -12 "$OUT/gpu_quick.txt" ;;
  kvtests) timeout -s INT -k 15 "${TEST_TIMEOUT:-200}" python3 -m pytest -m gpu tests/test_kernels_kv_quant.py \
           tests/test_gpu_e2e.py tests/test_kernels_attention.py -k "${KV_TESTS:-kv or golden or graph or paged}" -q -n 8 \
           -p no:cacheprovider -rfE > "$OUT/gpu_kv.txt" 2>&1; echo "kv tests rc=$?"; tail -8 "$OUT/gpu_kv.txt" ;;
  attnsweep) timeout ${SWEEP_TIMEOUT:-190} python3 benchmarks/kernels.py --only attention --sweep --budget ${SWEEP_BUDGET:-170} \
           --json "$OUT/attn.json" > "$OUT/attn.txt" 2>&1; echo "attention sweep rc=$?"; grep -v "^    " "$OUT/attn.txt" | tail -24 ;;
  q4break) EXL2_PDL=0 timeout 130 python3 -m exl2.cli.main bench --modes q4 --contexts 2048 --breakdown \
           --breakdown-mode q4 > "$OUT/bench_q4_breakdown.txt" 2>&1; echo "bench q4 (PDL off) rc=$?"
         tail -22 "$OUT/bench_q4_breakdown.txt" ;;
  s30) timeout -s INT -k 15 ${TEST_TIMEOUT:-240} python3 -m pytest -m gpu tests/test_gpu_engine.py -k "guidance" -q \
         -p no:cacheprovider -rfE > "$OUT/gpu_s30.txt" 2>&1; echo "CFG GPU test rc=$?"; tail -n 6 "$OUT/gpu_s30.txt"
       timeout ${SERVING_TIMEOUT:-200} python3 benchmarks/serving.py --batches 1,4 --cfg --no-speculative \
         > "$OUT/serving_cfg.txt" 2>&1; echo "serving rc=$?"; tail -n 14 "$OUT/serving_cfg.txt" ;;
  s31) timeout -s INT -k 15 ${TEST_TIMEOUT:-300} python3 -m pytest -m gpu tests/test_gpu_e2e.py tests/test_kernels_quant_matmul.py \
         -k "fast or packed or gluon or grouped or real_sizes or batched_decode_through or golden" -q -n 8 \
         -p no:cacheprovider -rfE > "$OUT/gpu_s31.txt" 2>&1; echo "packed-decoder GPU tests rc=$?"; tail -n 8 "$OUT/gpu_s31.txt"
       timeout 120 python3 -m pytest tests/test_shared_input.py tests/test_mma_decoders.py -q -p no:cacheprovider -rfE \
         > "$OUT/gpu_s31_shared.txt" 2>&1; echo "shared-input (cuda) + decoder tests rc=$?"; tail -n 2 "$OUT/gpu_s31_shared.txt" ;;
  s31b) AB_SPECS=";" BASE_SPEC=1 TAG=_mixed BENCH_TIMEOUT=${BENCH_TIMEOUT:-100} \
         BENCH_ARGS="--mixed --modes fp16 --contexts 128 --prefill 64 --batch 2,16" bash "$0" envab ;;
  s31c) AB_SPECS=";" BASE_SPEC=1 TAG=_plain BENCH_TIMEOUT=${BENCH_TIMEOUT:-100} \
         BENCH_ARGS="--modes fp16 --contexts 128 --prefill 64 --batch 2,16" bash "$0" envab ;;
  s32) timeout -s INT -k 15 ${TEST_TIMEOUT:-200} python3 -m pytest -m gpu tests/test_gpu_e2e.py -k "packed or fast_4bit_gemv" \
         -q -n 8 -p no:cacheprovider -rfE > "$OUT/gpu_s32.txt" 2>&1; echo "packed gemv GPU tests rc=$?"; tail -n 3 "$OUT/gpu_s32.txt"
       AB_SPECS=";EXL2_GEMV_HIGH_FP16=0;EXL2_PDL=0;EXL2_PREFETCH=0" TAG=_mixed BENCH_TIMEOUT=${BENCH_TIMEOUT:-90} \
         BENCH_ARGS="--mixed --modes fp16 --contexts 128 --prefill 64" bash "$0" envab
       AB_SPECS=";" TAG=_plain BENCH_TIMEOUT=${BENCH_TIMEOUT:-90} BENCH_ARGS="--modes fp16 --contexts 128 --prefill 64" \
         bash "$0" envab ;;
  s33) AB_SPECS=";EXL2_PREFETCH=0;EXL2_GEMV_PREFETCH_MASKED=1;EXL2_GEMV_GROUP_PER_SM=8;;EXL2_PREFETCH=0;EXL2_GEMV_PREFETCH_MASKED=1" \
         TAG=_mixed \
         BENCH_TIMEOUT=${BENCH_TIMEOUT:-90} BENCH_ARGS="--mixed --modes fp16 --contexts 128 --prefill 64" bash "$0" envab
       AB_SPECS=";EXL2_GEMV_PREFETCH_MASKED=1;;EXL2_GEMV_PREFETCH_MASKED=1" TAG=_plain BENCH_TIMEOUT=${BENCH_TIMEOUT:-90} \
         BENCH_ARGS="--modes fp16 --contexts 128 --prefill 64" bash "$0" envab ;;
  s34) timeout ${WIDTHS_TIMEOUT:-200} python3 benchmarks/layout_probe.py --widths --shapes gateup,down,qkv,o \
         --json "$OUT/widths.json" > "$OUT/widths.txt" 2>&1; echo "widths rc=$?"; tail -18 "$OUT/widths.txt"
       AB_SPECS=";EXL2_PREFETCH=0;EXL2_GEMV_PREFETCH_MASKED=1;EXL2_GEMV_GROUP_PER_SM=8" TAG=_mixed \
         BENCH_TIMEOUT=${BENCH_TIMEOUT:-80} BENCH_ARGS="--mixed --modes fp16 --contexts 128 --prefill 64" bash "$0" envab
       AB_SPECS=";EXL2_GEMV_PREFETCH_MASKED=1" TAG=_plain BENCH_TIMEOUT=${BENCH_TIMEOUT:-80} \
         BENCH_ARGS="--modes fp16 --contexts 128 --prefill 64" bash "$0" envab ;;
  s35) timeout -s INT -k 15 ${TEST_TIMEOUT:-200} python3 -m pytest -m gpu tests/test_fp8_prefill.py -q -p no:cacheprovider \
         -rfE > "$OUT/gpu_fp8.txt" 2>&1; echo "fp8 GPU tests rc=$?"; tail -n 8 "$OUT/gpu_fp8.txt"
       for fp8 in "" --prefill-fp8; do timeout ${BENCH_TIMEOUT:-120} python3 -m exl2.cli.main bench --modes fp16 \
         --contexts 128 --batch 16 $fp8 > "$OUT/bench_prefill$fp8.txt" 2>&1; echo "bench $fp8 rc=$?"
         grep -E "^\| (decode|prefill)" "$OUT/bench_prefill$fp8.txt"; done ;;
  s36) TEST_TIMEOUT=${TEST_TIMEOUT:-170} BENCH_TIMEOUT=${BENCH_TIMEOUT:-100} bash "$0" s35
       timeout ${WIDTHS_TIMEOUT:-120} python3 benchmarks/layout_probe.py --widths --shapes gateup,down,qkv,o \
         --json "$OUT/widths.json" > "$OUT/widths.txt" 2>&1; echo "widths rc=$?"; tail -18 "$OUT/widths.txt"
       AB_SPECS=";EXL2_GEMV_PREFETCH_MASKED=1" TAG=_mixed BENCH_TIMEOUT=60 \
         BENCH_ARGS="--mixed --modes fp16 --contexts 128 --batch 2 --prefill 64" bash "$0" envab ;;
  s37) TEST_TIMEOUT=${TEST_TIMEOUT:-130} BENCH_TIMEOUT=${BENCH_TIMEOUT:-90} bash "$0" s35
       AB_SPECS=";EXL2_GEMV_MAXNREG=64;EXL2_GEMV_MAXNREG=72" TAG=_mixed BENCH_TIMEOUT=60 \
         BENCH_ARGS="--mixed --modes fp16 --contexts 128 --batch 2 --prefill 64" bash "$0" envab ;;
  s38) timeout -s INT -k 15 ${TEST_TIMEOUT:-120} python3 -m pytest -m gpu tests/test_fp8_prefill.py -q -s -p no:cacheprovider \
         -rfE > "$OUT/gpu_fp8.txt" 2>&1; echo "fp8 GPU tests rc=$?"; grep -E "passed|failed|fp8 prefill against" "$OUT/gpu_fp8.txt"
       for fp8 in --prefill-fp8 ""; do timeout 90 python3 -m exl2.cli.main bench --modes fp16 --contexts 128 --batch 2 \
         $fp8 --breakdown-prefill > "$OUT/bench_prefill$fp8.txt" 2>&1; echo "bench $fp8 rc=$?"
         grep -E "^\| prefill" "$OUT/bench_prefill$fp8.txt"; grep -A14 "per-kernel time of one prefill" "$OUT/bench_prefill$fp8.txt"; done
       AB_SPECS="EXL2_GEMV_MAXNREG=64;;EXL2_GEMV_MAXNREG=64;" TAG=_mixed BENCH_TIMEOUT=75 \
         BENCH_ARGS="--mixed --modes fp16 --contexts 128 --batch 2 --prefill 64" bash "$0" envab ;;
  s39) timeout 90 python3 -m exl2.cli.main bench --modes fp16 --contexts 128 --batch 2 --prefill-fp8 --breakdown-prefill \
         > "$OUT/bench_prefill--prefill-fp8.txt" 2>&1; echo "bench --prefill-fp8 rc=$?"
       grep -E "^\| prefill" "$OUT/bench_prefill--prefill-fp8.txt"; grep -A9 "per-kernel time of one prefill" "$OUT/bench_prefill--prefill-fp8.txt"
       timeout -s INT -k 10 70 python3 -m pytest -m gpu tests/test_fp8_prefill.py -q -s -p no:cacheprovider -rfE \
         > "$OUT/gpu_fp8.txt" 2>&1; echo "fp8 GPU tests rc=$?"; grep -E "passed|failed|fp8 prefill against" "$OUT/gpu_fp8.txt"
       timeout 60 python3 -m exl2.cli.main bench --modes fp16 --contexts 128 --batch 2 > "$OUT/bench_prefill.txt" 2>&1
       echo "bench rc=$?"; grep -E "^\| prefill" "$OUT/bench_prefill.txt" ;;
  s40) timeout 150 python3 -m exl2.cli.main bench --batch 2,4,16 > "$OUT/bench_target.txt" 2>&1; echo "bench rc=$?"
       grep -E "^\| (decode|prefill)" "$OUT/bench_target.txt"
       timeout -s INT -k 10 90 python3 -m pytest -m gpu tests/test_fp8_prefill.py -q -s -p no:cacheprovider -rfE \
         > "$OUT/gpu_fp8.txt" 2>&1; echo "fp8 GPU tests rc=$?"; grep -E "passed|failed|fp8 prefill against" "$OUT/gpu_fp8.txt"
       for acc in 0 1; do EXL2_FP8_FAST_ACCUM=$acc timeout 80 python3 -m exl2.cli.main bench --modes fp16 --contexts 128 \
         --batch 2 --prefill-fp8 > "$OUT/bench_fp8_acc$acc.txt" 2>&1; echo "bench --prefill-fp8 fast-accum $acc rc=$?"
         grep -E "^\| prefill" "$OUT/bench_fp8_acc$acc.txt"; done
       AB_SPECS=";EXL2_GEMV_PREFETCH_MASKED=1;;EXL2_GEMV_PREFETCH_MASKED=1" TAG=_mixed BENCH_TIMEOUT=70 \
         BENCH_ARGS="--mixed --modes fp16 --contexts 128 --batch 2 --prefill 64" bash "$0" envab
       timeout ${WIDTHS_TIMEOUT:-120} python3 benchmarks/layout_probe.py --widths --shapes gateup,down,qkv,o \
         --json "$OUT/widths.json" > "$OUT/widths.txt" 2>&1; echo "widths rc=$?"; tail -18 "$OUT/widths.txt" ;;
  s41) BASE_SPEC=1 AB_SPECS=";EXL2_GEMV_PREFETCH_MASKED=1" TAG=_mixed BENCH_TIMEOUT=90 \
         BENCH_ARGS="--mixed --modes fp16 --contexts 128 --batch 2,16 --prefill 64" bash "$0" envab
       for pm in 0 1; do EXL2_GEMV_PREFETCH_MASKED=$pm timeout ${WIDTHS_TIMEOUT:-80} python3 benchmarks/layout_probe.py \
         --widths --shapes o,down,qkv > "$OUT/widths_pm$pm.txt" 2>&1; echo "widths (masked prefetch $pm) rc=$?"
         grep -E "^\| " "$OUT/widths_pm$pm.txt" | tail -12; done
       if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then  # the target table where it counts
         timeout 130 python3 -m exl2.cli.main bench > "$OUT/bench_default.txt" 2>&1; echo "bench rc=$?"
         grep -E "^\| (decode|prefill)" "$OUT/bench_default.txt"; fi
       timeout -s INT -k 10 ${TEST_TIMEOUT:-120} python3 -m pytest tests/test_kernels_quant_matmul.py tests/test_split_sum.py \
         tests/test_gpu_e2e.py -k "not golden and not dynamic and not speculative and not samplers and not lora" \
         -q -p no:cacheprovider -rfE > "$OUT/gpu_s41.txt" 2>&1; echo "matmul GPU tests rc=$?"; tail -n 4 "$OUT/gpu_s41.txt" ;;
  s42) BASE_SPEC=1 AB_SPECS=";" TAG=_mixed BENCH_TIMEOUT=75 \
         BENCH_ARGS="--mixed --modes fp16 --contexts 128 --batch 2 --prefill 64" bash "$0" envab
       timeout 50 python3 benchmarks/layout_probe.py --widths --shapes o,down > "$OUT/widths.txt" 2>&1
       echo "widths rc=$?"; grep -E "^\| " "$OUT/widths.txt" | tail -8
       timeout -s INT -k 10 ${TEST_TIMEOUT:-80} python3 -m pytest tests/test_kernels_quant_matmul.py \
         tests/test_gpu_e2e.py -k "gemv_matches or gluon or mixed or batched" \
         -q -p no:cacheprovider -rfE > "$OUT/gpu_s42.txt" 2>&1; echo "matmul GPU tests rc=$?"; tail -n 4 "$OUT/gpu_s42.txt" ;;
  s43) BASE_SPEC=1 AB_SPECS=";" TAG=_mixed BENCH_TIMEOUT=75 \
         BENCH_ARGS="--mixed --modes fp16 --contexts 128 --batch 2 --prefill 64" bash "$0" envab
       timeout 40 python3 benchmarks/layout_probe.py --widths --shapes o > "$OUT/widths.txt" 2>&1
       echo "widths rc=$?"; grep -E "^\| " "$OUT/widths.txt" | tail -4 ;;
  s44) for tarf in .base/*.tar; do rm -rf /tmp/base && mkdir -p /tmp/base && tar -xf "$tarf" -C /tmp/base
         (cd /tmp/base && timeout 50 python3 benchmarks/layout_probe.py --widths --shapes o,down) \
           > "$OUT/widths_$(basename "$tarf" .tar).txt" 2>&1; echo "widths [tree $tarf] rc=$?"
         grep -E "^\| " "$OUT/widths_$(basename "$tarf" .tar).txt" | tail -8; done
       timeout 50 python3 benchmarks/layout_probe.py --widths --shapes o,down > "$OUT/widths.txt" 2>&1
       echo "widths rc=$?"; grep -E "^\| " "$OUT/widths.txt" | tail -8 ;;
  s45) timeout -s INT -k 10 ${TEST_TIMEOUT:-150} python3 -m pytest tests/test_kernels_quant_matmul.py tests/test_split_sum.py \
         tests/test_gpu_e2e.py -k "not golden and not dynamic and not speculative and not samplers and not lora" \
         -q -p no:cacheprovider -rfE > "$OUT/gpu_s45.txt" 2>&1; echo "matmul GPU tests rc=$?"; tail -n 4 "$OUT/gpu_s45.txt"
       timeout 130 python3 -m exl2.cli.main bench --batch 2,4,16 > "$OUT/bench_target.txt" 2>&1; echo "bench rc=$?"
       grep -E "^\| (decode|prefill)" "$OUT/bench_target.txt"
       BASE_SPEC=1 AB_SPECS=";EXL2_GEMV_PREFETCH_MASKED=1" TAG=_mixed BENCH_TIMEOUT=90 \
         BENCH_ARGS="--mixed --modes fp16 --contexts 128 --batch 2,4,16 --prefill 64" bash "$0" envab
       timeout 80 python3 benchmarks/layout_probe.py --widths --shapes qkv,gateup > "$OUT/widths.txt" 2>&1
       echo "widths rc=$?"; grep -E "^\| " "$OUT/widths.txt" | tail -8 ;;
  s49) timeout -s INT -k 10 ${TEST_TIMEOUT:-200} python3 -m pytest tests/test_kernels_quant_matmul.py tests/test_split_sum.py \
         tests/test_kernels_attention.py tests/test_kernels_kv_quant.py tests/test_gpu_e2e.py \
         -k "not dynamic and not speculative and not samplers and not lora" -q -n 6 -p no:cacheprovider -rfE \
         > "$OUT/gpu_s49.txt" 2>&1; echo "GPU tests rc=$?"; tail -n 4 "$OUT/gpu_s49.txt"
       timeout 130 python3 -m exl2.cli.main bench --batch 2,4,16 > "$OUT/bench_target.txt" 2>&1; echo "bench rc=$?"
       grep -E "^\| (decode|prefill)" "$OUT/bench_target.txt"
       timeout 100 python3 -m exl2.cli.main bench --mixed --modes fp16,q4 --contexts 128,2048 --batch 4,16 --prefill 64 \
         > "$OUT/bench_mixed.txt" 2>&1; echo "mixed bench rc=$?"; grep -E "^\| (decode|prefill)" "$OUT/bench_mixed.txt" ;;
  s50) for spec in 1:q8 1:q6 1:q3 256:q4 256:fp16; do IFS=: read -r ch m <<< "$spec"
         timeout 70 python3 benchmarks/attn_probe.py --split-sweep --quick --batch 1 --ctx 2048 --chunk $ch --mode $m \
           > "$OUT/attn_${ch}_$m.txt" 2>&1; echo "attention chunk=$ch $m rc=$?"
         sort -t'|' -k12 -n "$OUT/attn_${ch}_$m.txt" | grep -E "^\| 1 " | head -3; done
       AB_SPECS=";EXL2_PDL_SPLIT_ROWS=16" TAG=_s50 BENCH_TIMEOUT=80 BENCH_ARGS="--modes q4 --contexts 2048 --batch 16 \
         --prefill 64" bash "$0" envab
       AB_SPECS=";EXL2_GEMV_GROUP_PER_SM=8;EXL2_GEMV_STAGES=4" TAG=_s50g BENCH_TIMEOUT=70 \
         BENCH_ARGS="--modes fp16 --contexts 128 --batch 2 --prefill 64" bash "$0" envab ;;
  s54) timeout -s INT -k 15 150 python3 -m pytest -m gpu tests/test_kernels_quant_matmul.py \
         -k "register_prefetch or gemv" \
         -q -p no:cacheprovider -rfE > "$OUT/gpu_rpf.txt" 2>&1; echo "rpf tests rc=$?"; tail -4 "$OUT/gpu_rpf.txt"
       AB_SPECS=";EXL2_GEMV_RPF=1;EXL2_GEMV_BS=16;EXL2_GEMV_BS=16 EXL2_GEMV_RPF=1;EXL2_GEMV_WARPS=8;" TAG=_bs \
         BENCH_TIMEOUT=80 BENCH_ARGS="--modes fp16,q4 --contexts 2048 --prefill 64 --batch 2" bash "$0" envab ;;
  s56) timeout 150 python3 -m exl2.cli.main bench --batch 2,4,16 > "$OUT/bench_target.txt" 2>&1; echo "bench rc=$?"
       grep -E "^\| (decode|prefill)" "$OUT/bench_target.txt"
       AB_SPECS=";EXL2_MMA_GEMV=2;EXL2_GEMV_BS=16 EXL2_GEMV_WARPS=8;" TAG=_mma BENCH_TIMEOUT=80 \
         BENCH_ARGS="--modes fp16,q4 --contexts 2048 --prefill 64 --batch 2" bash "$0" envab ;;
  s57) timeout -s INT -k 15 200 python3 -m pytest -m gpu tests/test_gpu_e2e.py tests/test_kernels_quant_matmul.py -q \
         -n 8 -p no:cacheprovider -rfE -k "golden or gluon or packed or fast or real_sizes or grouped or register" \
         > "$OUT/gpu_3bit.txt" 2>&1; echo "3-bit layout tests rc=$?"; tail -6 "$OUT/gpu_3bit.txt"
       BASE_SPEC=1 AB_SPECS=";" TAG=_mixed BENCH_TIMEOUT=100 \
         BENCH_ARGS="--mixed --modes fp16 --contexts 128 --batch 2,16 --prefill 64" bash "$0" envab ;;
  s58) layout_tests "$OUT/gpu_5bit.txt" "5-bit layout"
       BASE_SPEC=1 AB_SPECS=";" TAG=_mixed BENCH_TIMEOUT=100 \
         BENCH_ARGS="--mixed --modes fp16 --contexts 128 --batch 2,16 --prefill 64" bash "$0" envab ;;
  s59) timeout 150 python3 -m exl2.cli.main bench --batch 2,4,16 > "$OUT/bench_target.txt" 2>&1; echo "bench rc=$?"
       grep -E "^\| (decode|prefill)" "$OUT/bench_target.txt"
       AB_SPECS=";EXL2_GEMV_BS=16 EXL2_GEMV_WARPS=8;EXL2_GEMV_RPF=1;EXL2_GEMV_BS=16 EXL2_GEMV_WARPS=8 EXL2_GEMV_STAGES=2;EXL2_MMA_GEMV=2;" \
         TAG=_h200 BENCH_TIMEOUT=80 BENCH_ARGS="--modes fp16 --contexts 2048 --prefill 64 --batch 2" bash "$0" envab ;;
  s60) bash "$0" s58
       AB_SPECS=";EXL2_GEMV_BS=16 EXL2_GEMV_WARPS=8;EXL2_MMA_GEMV=2;" TAG=_bs1 BENCH_TIMEOUT=80 \
         BENCH_ARGS="--modes fp16 --contexts 2048 --prefill 64 --batch 2" bash "$0" envab ;;
  s62) gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
       if [[ "$gpu" == *H200* ]]; then
         timeout 150 python3 -m exl2.cli.main bench --batch 2,4,16 > "$OUT/bench_target.txt" 2>&1; echo "bench rc=$?"
         grep -E "^\| (decode|prefill)" "$OUT/bench_target.txt"
         specs=";EXL2_GEMV_NARROW=0;EXL2_GEMV_BS=16 EXL2_GEMV_WARPS=8;;EXL2_GEMV_NARROW=0"
       else
         timeout 230 python3 benchmarks/layout_probe.py --l2 --sweep --shapes o,qkv --warps 4,8 --bs 8,16 \
           --stages 3 --bn 32,64 --json "$OUT/gemv_l2.json" > "$OUT/gemv_l2.txt" 2>&1; echo "L2 sweep rc=$?"
         echo "== L2 sweep"; sort -t'|' -k2,2 -k4,4n "$OUT/gemv_l2.txt" | awk -F'|' '{c[$2]++} c[$2]<=6'
         grep -E "real" "$OUT/gemv_l2.txt"
         specs=";EXL2_GEMV_BN=32 EXL2_GEMV_BS=16;EXL2_GEMV_BS=16 EXL2_GEMV_WARPS=8;"
       fi
       AB_SPECS="$specs" TAG=_bn BENCH_TIMEOUT=80 BENCH_ARGS="--modes fp16 --contexts 2048 --prefill 64 --batch 2" \
         bash "$0" envab ;;
  s66) gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
       if [[ "$gpu" == *H200* ]]; then mode=""; else mode="--l2"; fi
       timeout 200 python3 benchmarks/int8_gemv.py $mode > "$OUT/int8${mode}.txt" 2>&1
       echo "int8 gemv $mode rc=$?"; grep -E "^\||WRONG|input itself" "$OUT/int8${mode}.txt"
       if [[ "$gpu" == *H200* ]]; then bash "$0" s62; fi ;;
  s55) SWEEP_SHAPES=gateup,down LAYOUT_TIMEOUT=500 bash "$0" gemvsweep ;;
  tests) timeout -s INT -k 15 "${TEST_TIMEOUT:-280}" python3 -m pytest -m gpu tests/ -q -n ${TEST_WORKERS:-8} -p no:cacheprovider \
           -rfE --durations=8 > "$OUT/gpu_tests.txt" 2>&1; echo "tests rc=$?"
         grep -vE "PytestBenchmarkWarning|warner\(" "$OUT/gpu_tests.txt" | tail -16 ;;
  esac
done
