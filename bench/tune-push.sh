#!/usr/bin/env bash
# Tuning sweep of the large-message allreduce on the GPU machine (bundle/ carried): the link's
# ceiling (copy engines and kernels, one way and both ways), then the write-only two-shot at
# several staging-slot sizes and launch shapes, 64 MiB .. 1 GiB, bf16 sum, checked against the
# host reference up to 64 MiB. Logs under $OUT. Extra variants: TUNE_VARIANTS="name:args;...".
set -u
out=${OUT:-hw-logs}; mkdir -p "$out"
b=bundle/bin/bench-allreduce
export CUDA_MULTIMEM_DRIVER=cuda
common="--min-bytes 67108864 --max-bytes 1073741824 --runs ${RUNS:-9} --check-max 67108864"
v() { local name=$1; shift; echo "== $name: $*"; "$b" $common "$@" 2>&1 | grep -v '^RESULT' | tee -a "$out/tune.log" | sed -n '3,$p'; }
{
[ -x bundle/bin/link-ceiling ] && bundle/bin/link-ceiling --runs 5 2>&1 | grep -v '^RESULT'
v push-default
v push-32m          --stage-bytes 33554432
v push-t1024-32m    --threads 1024 --stage-bytes 33554432
v push-t1024-b132-32m --threads 1024 --blocks 132 --stage-bytes 33554432
v push-t1024-b128-32m --threads 1024 --blocks 128 --stage-bytes 33554432
v push-t512-b132-32m --threads 512 --blocks 132 --stage-bytes 33554432
v push-t1024-64m    --threads 1024 --stage-bytes 67108864
IFS=';' read -ra extra <<< "${TUNE_VARIANTS:-}"
for x in "${extra[@]}"; do [ -n "$x" ] && v ${x%%:*} ${x#*:}; done
v push-default-again
} 2>&1 | tee "$out/tune-summary.log"
