#!/bin/bash
# One GPU call (issue 31): the JIT build with each translation unit's compile time (ninja's log), then the
# steps of STEPS (default "host latency"):
#   host     the host time to issue a call, part by part (host_time.py; P = 2 at 64 KiB, 64 MiB and 1 GiB, P = 4
#            at 64 KiB);
#   params   one launch's host time against its parameters' size (launch_params.cu: 16 B to 4 KiB; the
#            one launch passes its 1176-byte plan by value);
#   parts    the runtime call's C++ side, part by part (runtime_parts.py: y's allocation, the stream, the launch,
#            the pybind conversions; it builds its own small extension first, about a minute);
#   latency  the small messages' graph replay beside an empty launch and a flag round trip (bench_p2p.py,
#            64 KiB at P = 2 and 4, the one launch, a 16 MiB workspace);
#   shot     one-shot against two-shot at 64 KiB to 1 MiB, P = 2 and 4, graph replay (bench_p2p.py --one-shot
#            1048576,off: one-shot up to 1 MiB beside every call two-shot);
#   suite    the quick p2p suite at P = 2 (SUITE_K, a pytest -k expression: "test_gpu_suite" for P = 2, 4
#            and 8; tests/test_p2p_gpu.py), bounded by SUITE_TIMEOUT seconds (default 290);
#   kernels  the stage kernels against the reference (tests/test_kernels_gpu.py);
#   phases   where the one launch's time goes: the shipped build beside three builds that skip one phase's work
#            each (ECHO_P2P_TIMING_SKIP=1 the entry, 2 the owner reduce, 4 the tail; their flags and waits kept,
#            their results wrong), built side by side in directories of their own, then one bench_p2p run each
#            at PHASES_P (default "2,4"), 64 and 256 MiB, eager and graph replay, uncompensated and compensated;
#   large    the one launch beside the staged pipeline, 4 MiB to 256 MiB at P = 2 and 4 (64 MiB at P = 8),
#            eager and graph replay (bench_p2p.py --stages fused,kernels: the table kept before the staged
#            pipeline may go), pow2_rescale "auto" (the forward sites' setting: a call without rescaling never
#            takes the staged pipeline, and the reference path it takes instead cannot be captured in a graph);
#   grid     the one launch at P = 2, 64 and 256 MiB, with each rank's grid at GRID_BLOCKS (default "33 66
#            132": a quarter, the half the buffer takes, and the full even share of the resident blocks;
#            ECHO_P2P_MAX_BLOCKS): what the co-residency cap of ranks sharing a GPU costs. At the full share
#            a call can hang until the timeout (RESULTS.md, 2026-12-04 15:33): each run is bounded.
#
#   OUT=/some/dir bash benchmarks/gpu_one_transport.sh
#
# Writes to $OUT: build_units.txt, <step>.log, misc.tgz (env.txt, build.log, p2p_log.txt).
set -u
OUT=${OUT:-/tmp/one_transport_out}
STEPS=${STEPS:-host latency}
source benchmarks/gpu_env.sh
session_begin "$OUT"
# ninja's log: start and end (ms since the build started) per output; the slowest unit bounds the build.
log=$(find "$TORCH_EXTENSIONS_DIR" -name .ninja_log | head -1)
[ -n "$log" ] && awk 'NR > 1 { printf "%8.1f s  %s\n", ($2 - $1) / 1000, $4 }' "$log" | sort -rn > "$OUT/build_units.txt"
head -6 "$OUT/build_units.txt" 2>/dev/null
for s in $STEPS; do
  case $s in
    host)
      { python3 benchmarks/host_time.py --world-size 2 --sizes 65536,67108864,1073741824 &&
        python3 benchmarks/host_time.py --world-size 4 --sizes 65536; } \
        > "$OUT/host.log" 2>&1
      grep -E "^\||host time|pybind" "$OUT/host.log" ;;
    params)
      nvcc -O2 -arch=sm_90 -o /tmp/launch_params benchmarks/launch_params.cu && /tmp/launch_params > "$OUT/params.log" 2>&1
      cat "$OUT/params.log" ;;
    parts)
      timeout 240 python3 benchmarks/runtime_parts.py > "$OUT/parts.log" 2>&1
      grep -E "^\||built|host time" "$OUT/parts.log" ;;
    latency)
      python3 benchmarks/bench_p2p.py --world-sizes 2,4 --min-bytes 65536 --max-bytes 65536 --workspace-bytes 16777216 --stages fused --bits 4 \
        --warmup 3 --iters 10 --graph-reps 10 --pingpong 200 --tile-sweep-bytes 0 --copy-bytes 268435456 \
        > "$OUT/latency.log" 2>&1
      grep -E "^\|" "$OUT/latency.log" | grep -v "^|---" | head -30 ;;
    shot)
      python3 benchmarks/bench_p2p.py --world-sizes 2,4 --min-bytes 65536 --max-bytes 1048576 --workspace-bytes 16777216 \
        --stages fused --one-shot 1048576,off --bits 4 --warmup 3 --iters 10 --graph-reps 10 --pingpong 0 \
        --tile-sweep-bytes 0 --copy-bytes 268435456 > "$OUT/shot.log" 2>&1
      grep -E "^\|" "$OUT/shot.log" | grep -E "one launch|size \| path" | head -30 ;;
    suite)
      ECHO_P2P_QUICK=1 timeout ${SUITE_TIMEOUT:-290} $PYTEST -m gpu tests/test_p2p_gpu.py -k "${SUITE_K:-test_gpu_suite and 2}" \
        --timeout $(( ${SUITE_TIMEOUT:-290} - 10 )) > "$OUT/suite.log" 2>&1
      grep -E "passed|failed|Error" "$OUT/suite.log" | tail -5 ;;
    large)
      timeout 300 python3 benchmarks/bench_p2p.py --world-sizes 2,4,8 --max-bytes-at 8:67108864 --min-bytes ${LARGE_MIN:-4194304} \
        --max-bytes 268435456 --factor 4 --stages fused,kernels --bits 4 --pow2 auto --warmup 2 --iters 5 \
        --graph-reps 5 --pingpong 0 --tile-sweep-bytes 0 --copy-bytes 268435456 --check-max-bytes 16777216 > "$OUT/large.log" 2>&1
      grep -E "^\|" "$OUT/large.log" | grep -v "^|---" | head -60 ;;
    grid)
      for b in ${GRID_BLOCKS:-33 66 132}; do
        ECHO_P2P_MAX_BLOCKS=$b timeout 120 python3 benchmarks/bench_p2p.py --world-sizes 2 --min-bytes 67108864 \
          --max-bytes 268435456 --factor 4 --stages fused --bits 4 --warmup 2 --iters 5 --graph-reps 5 --pingpong 0 \
          --tile-sweep-bytes 0 --copy-bytes 268435456 --check-max-bytes 0 > "$OUT/grid_$b.log" 2>&1
        echo "rc $? blocks $b"; grep -E "^\|" "$OUT/grid_$b.log" | grep -v "^|---" | head -12
      done ;;
    phases)
      for m in 1 2 4; do
        ( export TORCH_EXTENSIONS_DIR=/tmp/ext_skip$m ECHO_DS_NVCC_EXTRA=-DECHO_P2P_TIMING_SKIP=$m
          build_ops "$OUT/build_skip$m.log" 300 ) &
      done
      wait; tail -qn 2 "$OUT"/build_skip*.log
      for m in 0 1 2 4; do
        x=""; [ "$m" != 0 ] && x="TORCH_EXTENSIONS_DIR=/tmp/ext_skip$m ECHO_DS_NVCC_EXTRA=-DECHO_P2P_TIMING_SKIP=$m"
        env $x timeout 150 python3 benchmarks/bench_p2p.py --world-sizes ${PHASES_P:-2,4} --min-bytes 67108864 \
          --max-bytes 268435456 --factor 4 --stages fused --bits 4 --warmup 2 --iters 5 --graph-reps 5 --pingpong 0 \
          --tile-sweep-bytes 0 --copy-bytes 268435456 --check-max-bytes 0 > "$OUT/phases_skip$m.log" 2>&1
        echo "== skip mask $m (rc $?)"; grep -E "^\| [0-9]+ MiB \| one launch" "$OUT/phases_skip$m.log"
      done ;;
    kernels)
      timeout 250 $PYTEST -m gpu tests/test_kernels_gpu.py --timeout 240 > "$OUT/kernels.log" 2>&1
      grep -E "passed|failed|Error" "$OUT/kernels.log" | tail -5 ;;
  esac
  stamp "$s done"
done
stop_mps
(cd "$OUT" && tar czf misc.tgz env.txt build.log p2p_log.txt 2>/dev/null; rm -f env.txt build.log p2p_log.txt)
stamp "end"
