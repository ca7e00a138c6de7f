#!/usr/bin/env bash
# A/B of the write-only two-shot on the GPU machine (bundle/ carried): the committed kernels
# against the PTX in bundle/oldptx (loaded through CUDA_MULTIMEM_PTX_DIR), interleaved, same
# process settings; 16 MiB .. 1 GiB, bf16 sum in place, checked up to 64 MiB. Logs under $OUT.
# CUDA_MULTIMEM_PTX_DIR is read only by binaries built with cuda-multimem-collectives' feature
# `ptx-override`: `cargo xtask bundle` builds the examples and benchmarks with it.
set -u
out=${OUT:-hw-logs}; mkdir -p "$out"
b=bundle/bin/bench-allreduce
export CUDA_MULTIMEM_DRIVER=cuda
common="--min-bytes 16777216 --max-bytes 1073741824 --runs ${RUNS:-9} --check-max 67108864"
v() { local name=$1; shift; echo "== $name: $*"; "$b" $common "$@" 2>&1 | grep -v '^RESULT' | tee -a "$out/ab.log" | sed -n '3,$p'; }
for i in 1 2; do
  v new-$i
  CUDA_MULTIMEM_PTX_DIR=bundle/oldptx v old-$i
done
v new-64m --stage-bytes 67108864
