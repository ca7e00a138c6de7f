#!/usr/bin/env bash
# Tuning sweep of the large-message allreduce on the GPU machine (bundle/ carried): the reading
# two-shot against the write-only two-shot at several staging-slot sizes and launch shapes, each
# 16 MiB .. 1 GiB, bf16 sum, checked against the host reference up to 64 MiB. Logs under $OUT.
set -u
out=${OUT:-hw-logs}; mkdir -p "$out"
b=bundle/bin/bench_allreduce
export CUDA_MULTIMEM_DRIVER=cuda
common="--min-bytes 16777216 --max-bytes 1073741824 --runs 5 --check-max 67108864"
v() { local name=$1; shift; echo "== $name: $*"; "$b" $common "$@" 2>&1 | grep -v '^RESULT' | tee -a "$out/tune.log" | sed -n '3,$p'; }
{
v two-shot          --algorithm two-shot
v push-stage-1g     --stage-bytes 1073741824
v push-stage-2m     --stage-bytes 2097152
v push-stage-8m
v push-stage-32m    --stage-bytes 33554432
v push-stage-128m   --stage-bytes 134217728
v push-8m-t1024     --threads 1024
v push-32m-t1024    --stage-bytes 33554432 --threads 1024
v push-8m-b128-t1024 --blocks 128 --threads 1024
v push-32m-t256     --stage-bytes 33554432 --threads 256
} 2>&1 | tee "$out/tune-summary.log"
