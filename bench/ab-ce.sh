#!/usr/bin/env bash
# The copy-engine two-shot (one chunk, and pipelined in chunks) against the default write-only
# two-shot on the GPU machine (bundle/ carried), interleaved; 64 MiB .. 1 GiB, bf16 sum in place,
# checked up to 64 MiB. Logs in $OUT.
set -u
out=${OUT:-hw-logs}; mkdir -p "$out"
b=bundle/bin/bench_allreduce
export CUDA_MULTIMEM_DRIVER=cuda
common="--min-bytes ${MIN:-67108864} --max-bytes 1073741824 --runs ${RUNS:-5} --check-max 67108864"
v() { local name=$1; shift; echo "== $name: $*"; "$b" $common "$@" 2>&1 | grep -v '^RESULT' | tee -a "$out/ab-ce.log" | sed -n '3,$p'; }
v push
v ce-1chunk     --ce-max 1073741824 --ce-min 0 --ce-chunk 0
v ce-64m        --ce-max 1073741824 --ce-min 0 --ce-chunk 67108864
v ce-32m        --ce-max 1073741824 --ce-min 0 --ce-chunk 33554432
v ce-128m       --ce-max 1073741824 --ce-min 0 --ce-chunk 134217728
