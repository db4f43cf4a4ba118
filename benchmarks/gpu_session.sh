#!/usr/bin/env bash
# One GPU session: golden tests, then the benchmarks, logs under $OUT (or ./bench-out).
# Builds: MOKGEN_HOME, e.g. a folder unpacked from `stage_builds.py HOME.tar.xz --set golden --set fp8`.
# Usage: bash benchmarks/gpu_session.sh [tests] [bench] [train] [anchor] [twogpu] [exp NAME VARIANT T,T,..] [profile VARIANT T]
#        [ncu VARIANT PATH T] [l2homes] [l2stream] [l2mcast] [dsmem] [paths]
#   train: forward+backward bench (E64 at T=4096,16384) and the training demo's loss curves (bf16, then FP8)
#   twogpu: needs two GPUs of one host: the expert-parallel, multi-node and FP8 golden tests over both, then
#           the expert-parallel forward and forward+backward bench and the FP8 layer beside bf16 over both
#           (builds: python benchmarks/stage_builds.py DEST --set twogpu, MOKGEN_HOME=DEST)
#   ncu: Nsight Compute's counters for one call of PATH (one_launch, multi, apart; train: forward + backward) at T tokens
#        (benchmarks/ncu_call.py: time, DRAM and L2 bytes, the bytes into the SMs, per kernel)
#   l2homes: which L2 partition holds each line, seen from one SM (benchmarks/l2_homes.cu: how fine the
#            partition hash is, and whether it repeats from one 2 MB page to the next)
#   l2stream: whether SMs reading only the lines homed in their own L2 partition stream faster than SMs reading
#             every line (benchmarks/l2_near_stream.cu: maps SMs and 4 KB granules to partitions, then times both,
#             the TMA loads of weight rows in one box a stage or one box a row, from one lane or a warp, and the
#             streams again beside MMAs on every SM, at the clock the power cap leaves)
#   l2mcast: whether a TMA multicast of the token rows over a cluster of 2 or 4 CTAs makes the 160-row gate/up
#            tiles faster (benchmarks/l2_multicast.cu: the tiles' TMA loads and wgmma, no epilogue; the rows not
#            loaded at all, loaded by every CTA, multicast, or gathered half by each CTA of a pair and pushed into the
#            other's shared memory; with and without the MMAs)
#   dsmem: whether the down tiles' h rows cost an SM less from a peer's shared memory in a cluster of 8 (the CTAs
#          that would hold one expert's h) than from L2 (benchmarks/dsmem_rows.cu: the tiles' TMA loads and wgmma)
#   paths: `mokgen tune --paths` for every variant with a paths record in generated/tuning/ but none for this
#          GPU model (each record also lands in $OUT: commit it to generated/tuning/, then `mokgen build` it)
#   anchor: mokgen beside the design's own baseline script under its harness (benchmarks/anchor_compare.py;
#           the script from ../shared/bench, or a copy in .anchors/ where ../shared does not travel)
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
B="timeout 200 python3 -m mokgen.cli bench"
# A probe on benchmarks/tile_probe.cuh (wgmma: compute_90a), built, run for 11 timed launches, removed.
tile_probe() {
  nvcc -gencode arch=compute_90a,code=sm_90a -O3 -std=c++17 -o "$OUT/$1" "benchmarks/$1.cu" \
    && timeout 120 "$OUT/$1" 11 2>&1 | tee "$OUT/$2.log"
  rm -f "$OUT/$1"
}
while [ $# -gt 0 ]; do
  case "$1" in
    # the GPU tests only: CI runs the CPU ones, and the whole suite outlasts a call there (over 360 s)
    tests) T=$(python3 -c "import pytest_timeout" 2>/dev/null && echo --timeout=120)
      timeout 480 python3 -m pytest tests/ -m gpu -q -rfE $T -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -4
      shift ;;
    bench)
      $B --tokens 1024,4096,16384 --json "$OUT/e64.json" 2>&1 | tail -13 | tee "$OUT/bench.log"
      $B --variant e128_k8_h2048_i768_bf16_sm90a --tokens 16384 --baselines torch_grouped_mm --json "$OUT/e128.json" 2>&1 | tail -4 | tee -a "$OUT/bench.log"
      $B --variant e256_k8_h7168_i2048_bf16_sm90a --tokens 8192 --baselines torch_grouped_mm --json "$OUT/e256.json" 2>&1 | tail -4 | tee -a "$OUT/bench.log"
      shift ;;
    train)
      $B --backward --tokens 4096,16384 --json "$OUT/train-e64.json" 2>&1 | tail -8 | tee "$OUT/train.log"
      timeout 240 python3 benchmarks/train_demo.py --steps 300 --out "$OUT/train" 2>&1 | tail -16 | tee -a "$OUT/train.log"
      timeout 240 python3 benchmarks/train_demo.py --dtype fp8 --steps 300 --out "$OUT/train-fp8" 2>&1 | tail -3 | tee -a "$OUT/train.log"
      shift ;;
    twogpu)
      timeout 360 python3 -m pytest -q tests/test_expert_parallel_gpu.py tests/test_multinode_gpu.py \
        tests/test_fp8_gpu.py::test_fp8_over_two_gpus_golden 2>&1 | tee "$OUT/twogpu-tests.log" | tail -4
      R="timeout 150 python3 -m torch.distributed.run --nproc-per-node=2"
      $R benchmarks/ep_bench.py --tokens 4096,8192 --backward --json "$OUT/ep.json" 2>&1 | tail -16 | tee "$OUT/twogpu.log"
      $R benchmarks/multinode_bench.py --fp8 --json "$OUT/multinode.json" 2>&1 | tail -24 | tee -a "$OUT/twogpu.log"
      shift ;;
    paths)
      for v in $(ls generated/tuning/ | sed -n 's/\.paths\..*json$//p' | sort -u); do
        REC=$(python3 -c "import sys, torch; from mokgen.tune import paths_record_path
print(paths_record_path('generated', sys.argv[1], torch.cuda.get_device_name()))" "$v")
        if [ -f "$REC" ]; then echo "== $v: $REC is committed"; continue; fi
        echo "== tune --paths $v" | tee -a "$OUT/paths.log"
        timeout 400 python3 -m mokgen.cli tune "$v" --paths 2>&1 | tee -a "$OUT/paths.log" | tail -3
        cp "${MOKGEN_HOME:-generated}/tuning/$(basename "$REC")" "$OUT/" 2>/dev/null
      done; shift ;;
    anchor) timeout 400 python3 benchmarks/anchor_compare.py --json "$OUT/anchor.json" 2>&1 | tee "$OUT/anchor.log" | tail -16
      shift ;;
    exp) timeout 200 python3 benchmarks/compare_experiment.py "$2" --variant "$3" --tokens "$4" \
           --json "$OUT/exp-$2-$3.json" 2>&1 | tee -a "$OUT/bench.log"; shift 4 ;;
    profile) timeout 90 python3 benchmarks/profile_stages.py "$2" "$3" 2>&1 | grep -E "kernel_|Name" | cut -c1-62,150-200 | tee -a "$OUT/prof.log"; shift 3 ;;
    ncu)
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
      C="$OUT/ncu-$3-$4.csv"
      timeout 240 "$NCU" --profile-from-start off --clock-control none --print-units base --csv \
        --metrics "$(python3 benchmarks/ncu_call.py --metrics)" \
        python3 benchmarks/ncu_call.py --variant "$2" --path "$3" --tokens "$4" > "$C" 2> "${C%.csv}.err"
      echo "== ncu: $2 $3 T=$4" | tee -a "$OUT/ncu.log"
      python3 benchmarks/ncu_call.py --summary "$C" 2>&1 | tee -a "$OUT/ncu.log"; shift 4 ;;
    l2homes)
      nvcc -arch=sm_90a -O2 -o "$OUT/l2_homes" benchmarks/l2_homes.cu \
        && { timeout 60 "$OUT/l2_homes" 256 12; timeout 60 "$OUT/l2_homes" 4096 4; } 2>&1 | tee "$OUT/l2homes.log"
      rm -f "$OUT/l2_homes"; shift ;;
    l2stream)
      nvcc -arch=sm_90a -O2 -std=c++17 -o "$OUT/l2_near_stream" benchmarks/l2_near_stream.cu \
        && timeout 120 "$OUT/l2_near_stream" 1024 2>&1 | tee "$OUT/l2stream.log"
      rm -f "$OUT/l2_near_stream"; shift ;;
    l2mcast) tile_probe l2_multicast l2mcast; shift ;;
    dsmem) tile_probe dsmem_rows dsmem; shift ;;
    *) echo "unknown step $1"; exit 2 ;;
  esac
done
