#!/usr/bin/env bash
# The copy-engine two-shot against the default write-only two-shot on the GPU machine (bundle/
# carried), interleaved; 16 MiB .. 1 GiB, bf16 sum in place, checked up to 64 MiB. Logs in $OUT.
set -u
out=${OUT:-hw-logs}; mkdir -p "$out"
b=bundle/bin/bench-allreduce
export CUDA_MULTIMEM_DRIVER=cuda
common="--min-bytes 16777216 --max-bytes 1073741824 --runs ${RUNS:-7} --check-max 67108864"
v() { local name=$1; shift; echo "== $name: $*"; "$b" $common "$@" 2>&1 | grep -v '^RESULT' | tee -a "$out/ab-ce.log" | sed -n '3,$p'; }
v push
v ce            --ce-max 1073741824
v ce-512x256    --ce-max 1073741824 --push-threads 512 --blocks 256
v push-again
v ce-again      --ce-max 1073741824
