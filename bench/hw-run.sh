#!/usr/bin/env bash
# One consolidated hardware run (device time is scarce): info, the suite on the real driver, the
# PTX check, the examples, and both benchmarks, each logged under $OUT (or ./hw-logs).
# Usage on the GPU machine, from the repository root with bundle/ carried: bash bench/hw-run.sh
set -u
out=${OUT:-hw-logs}; mkdir -p "$out"
b=bundle
export RUST_BACKTRACE=1
step() { local name=$1; shift; echo "===== $name: $*"; local t0=$(date +%s); "$@" >"$out/$name.log" 2>&1; local rc=$?; echo "      rc=$rc ($(( $(date +%s) - t0 )) s)"; tail -n "${TAIL:-25}" "$out/$name.log"; }
nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total --format=csv 2>&1  # stdout only: at most 8 files come back from $OUT
env | grep -E 'NVLS|MULTICAST' | sort
step info        $b/xtask info --json
step test-hw     $b/xtask test-hw
step ptx-check   $b/xtask ptx-check
step ex-allreduce $b/bin/allreduce
TAIL=40 step bench-allreduce $b/xtask bench-hw allreduce
step bench-memory $b/xtask bench-hw memory -- --reps 15
# the two-GPU run's benchmarks (issue 28; on one GPU they run with ranks sharing it and say so)
TAIL=40 step bench-alltoall $b/xtask bench-hw alltoall
TAIL=40 step bench-moe $b/xtask bench-hw moe
TAIL=40 step bench-norm $b/xtask bench-hw norm
step ex-managed  $b/bin/managed
step ex-multicast $b/bin/multicast
[ -x $b/bin/link-ceiling ] && CUDA_MULTIMEM_DRIVER=cuda $b/bin/link-ceiling --runs 5 2>&1 | grep -v "^RESULT"
grep -h -E "passed, " "$out"/*.log | head -20   # the RESULT lines are in the logs
