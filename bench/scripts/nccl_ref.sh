#!/usr/bin/env bash
# NCCL reference in its best configuration, one process per GPU: builds bench/native/nccl_ref.c
# with gcc (nvcc as a fallback) against the NCCL of torch's Python environment and the CUDA
# toolkit, launches one rank per GPU, waits for them (bounded), exits non-zero if any failed.
#
#   bash bench/scripts/nccl_ref.sh [launcher options] [nccl_ref options]
#
# launcher options (everything else goes to nccl_ref; see `nccl_ref --help`):
#   --nranks N       ranks (default: every visible GPU)
#   --cvd            give each rank its GPU through CUDA_VISIBLE_DEVICES instead of --device R
#   --timeout S      stop every rank after S seconds (default 900; exit 124)
#   --build-only     build, print the binary's path, exit
#   --self-test      build, run the host-only self-test (no GPU needed)
#   --dry-run        build, print the plan (no GPU needed)
#   --keep-logs      keep the per-rank logs (always kept when a rank fails)
# environment: NCCL_HOME (folder with include/nccl.h, lib/libnccl.so*), CUDA_HOME, PYTHON,
#   NCCL_REF_SRC (the C source), NCCL_REF_BUILD (build folder, default /tmp/nccl_ref_build.$UID).
#
# Rank 0 prints to stdout: `RESULT {json}` per measurement, `CHECK {json}` per correctness check,
# `#` comments, and a summary table last. The other ranks' output goes to per-rank logs, shown
# when they fail. NVLink multicast stays off: NCCL_NVLS_ENABLE=0 is forced.
set -u -o pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
say() { echo "nccl_ref.sh: $*" >&2; }
fail() { say "$*"; exit 2; }

nranks='' use_cvd=0 timeout=900 build_only=0 host_mode='' keep=0
pass=()
while (($#)); do
    case $1 in
    --nranks) nranks=${2:?--nranks needs a value}; shift 2 ;;
    --nranks=*) nranks=${1#*=}; shift ;;
    --cvd) use_cvd=1; shift ;;
    --timeout) timeout=${2:?--timeout needs a value}; shift 2 ;;
    --timeout=*) timeout=${1#*=}; shift ;;
    --build-only) build_only=1; shift ;;
    --self-test | --dry-run) host_mode=$1; shift ;;
    --keep-logs) keep=1; shift ;;
    --rank | --rank=* | --id-file | --id-file=* | --token | --token=* | --device | --device=*)
        fail "$1 is set by the launcher" ;;
    *) pass+=("$1"); shift ;;
    esac
done
if ! [[ $timeout =~ ^[0-9]+$ ]] || ((timeout == 0)); then fail "--timeout must be a positive number of seconds"; fi
[[ -z $nranks || $nranks =~ ^[0-9]+$ ]] || fail "--nranks must be a number"

# ---- NVLink multicast off (never create multicast objects on these machines) ----
if [[ -n ${NCCL_NVLS_ENABLE:-} && $NCCL_NVLS_ENABLE != 0 ]]; then
    say "NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE in the environment; forcing 0"
fi
export NCCL_NVLS_ENABLE=0
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# ---- the source ----
src=${NCCL_REF_SRC:-}
if [[ -z $src ]]; then
    for c in "$here/../native/nccl_ref.c" "$here/nccl_ref.c" "$here/../../bench/native/nccl_ref.c"; do
        if [[ -f $c ]]; then src=$c; break; fi
    done
fi
[[ -n $src && -f $src ]] || fail "cannot find nccl_ref.c (looked beside $here and in ../native; set NCCL_REF_SRC)"

# ---- NCCL (torch's Python environment) ----
py=${PYTHON:-python3}
nccl=${NCCL_HOME:-}
if [[ -z $nccl ]]; then
    nccl=$("$py" -c 'import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null) ||
        fail "NCCL not found: no NCCL_HOME and \`$py -c 'import nvidia.nccl'\` failed"
fi
[[ -f $nccl/include/nccl.h ]] || fail "no $nccl/include/nccl.h"
nccl_lib=
for c in "$nccl"/lib/libnccl.so "$nccl"/lib/libnccl.so.2 "$nccl"/lib/libnccl.so.*; do
    if [[ -f $c ]]; then nccl_lib=$c; break; fi
done
[[ -n $nccl_lib ]] || fail "no libnccl.so* in $nccl/lib"

# ---- CUDA headers and runtime ----
cuda=${CUDA_HOME:-${CUDA_PATH:-}}
if [[ -z $cuda ]]; then
    if command -v nvcc >/dev/null 2>&1; then
        cuda=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
    else
        cuda=/usr/local/cuda
    fi
fi
pyroots=()
if pyr=$("$py" -c 'import nvidia, os; print("\n".join(list(nvidia.__path__)))' 2>/dev/null); then
    while IFS= read -r l; do [[ -n $l ]] && pyroots+=("$l"); done <<<"$pyr"
fi
incs=(-I"$nccl/include")
for d in "$cuda/include" "$cuda/include/cccl" "$cuda/targets/x86_64-linux/include" "$cuda/targets/x86_64-linux/include/cccl"; do
    [[ -d $d ]] && incs+=(-I"$d")
done
if [[ ! -f $cuda/include/cuda_runtime.h && ! -f $cuda/targets/x86_64-linux/include/cuda_runtime.h ]]; then
    # no toolkit: headers of the pip packages, if they are complete
    for r in "${pyroots[@]}"; do
        for d in "$r/cu13/include" "$r/cu13/include/cccl" "$r/cuda_runtime/include"; do [[ -d $d ]] && incs+=(-I"$d"); done
    done
fi
cudart=
for d in "$cuda/lib64" "$cuda/targets/x86_64-linux/lib" "$cuda/lib"; do
    for c in "$d"/libcudart.so "$d"/libcudart.so.[0-9]*; do
        if [[ -f $c ]]; then cudart=$c; break 2; fi
    done
done
if [[ -z $cudart ]]; then
    for r in "${pyroots[@]}"; do
        for c in "$r"/cu13/lib/libcudart.so* "$r"/cuda_runtime/lib/libcudart.so*; do
            if [[ -f $c ]]; then cudart=$c; break 2; fi
        done
    done
fi
[[ -n $cudart ]] || fail "no libcudart.so* under $cuda (set CUDA_HOME)"

# ---- build ----
build=${NCCL_REF_BUILD:-/tmp/nccl_ref_build.$(id -u)}
mkdir -p "$build" || fail "cannot create $build"
bin=$build/nccl_ref
rpath="$(dirname "$nccl_lib"):$(dirname "$cudart")"
libs=("$nccl_lib" "$cudart" "-Wl,-rpath,$rpath" -lpthread -ldl -lm)
if ! gcc -std=c11 -O2 -Wall -Wextra "${incs[@]}" "$src" -o "$bin.tmp" "${libs[@]}" 2>"$build/gcc.log"; then
    say "gcc failed ($(head -c 600 "$build/gcc.log")); trying nvcc"
    command -v nvcc >/dev/null 2>&1 || { cat "$build/gcc.log" >&2; fail "build failed and there is no nvcc"; }
    nvcc -O2 -x c "${incs[@]}" "$src" -o "$bin.tmp" "$nccl_lib" "$cudart" -Xlinker -rpath -Xlinker "$rpath" -lpthread -ldl -lm ||
        fail "build failed (gcc: $build/gcc.log; nvcc above)"
elif [[ -s $build/gcc.log ]]; then
    say "gcc warnings:"; cat "$build/gcc.log" >&2
fi
mv -f "$bin.tmp" "$bin"
say "built $bin (NCCL: $nccl_lib; CUDA runtime: $cudart)"
export LD_LIBRARY_PATH="$rpath${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if ((build_only)); then echo "$bin"; exit 0; fi
if [[ -n $host_mode ]]; then
    exec "$bin" "$host_mode" ${nranks:+--nranks "$nranks"} "${pass[@]}"
fi

# ---- ranks ----
devs=()
if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
    IFS=, read -r -a devs <<<"$CUDA_VISIBLE_DEVICES"
else
    ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
    for ((i = 0; i < ${ngpu:-0}; i++)); do devs+=("$i"); done
fi
[[ -n $nranks ]] || nranks=${#devs[@]}
((nranks >= 1)) || fail "no GPU found (nvidia-smi -L, CUDA_VISIBLE_DEVICES); give --nranks"
((nranks <= ${#devs[@]} || ${#devs[@]} == 0)) || fail "--nranks $nranks, but only ${#devs[@]} GPUs are visible"
((use_cvd == 0 || ${#devs[@]} >= nranks)) || fail "--cvd needs the GPU list (nvidia-smi or CUDA_VISIBLE_DEVICES)"

run=$(mktemp -d /tmp/nccl_ref_run.XXXXXX) || fail "mktemp failed"
token="$$-$(date +%s%N)-$RANDOM"
pids=()
# shellcheck disable=SC2317  # called from the trap
stop_all() {
    local sig=$1 p
    for p in "${pids[@]}"; do kill "-$sig" "$p" 2>/dev/null; done
}
# shellcheck disable=SC2317  # called from the trap
on_signal() {
    say "interrupted; stopping the ranks"
    stop_all TERM; sleep 2; stop_all KILL
    exit 130
}
trap on_signal INT TERM

t0=$SECONDS
say "$nranks ranks, NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE, logs in $run, timeout ${timeout}s"
for ((r = 0; r < nranks; r++)); do
    args=(--rank "$r" --nranks "$nranks" --id-file "$run/id" --token "$token")
    if ((use_cvd)); then
        envs=(CUDA_VISIBLE_DEVICES="${devs[r]}")
        args+=(--device 0)
    else
        envs=()
        args+=(--device "$r")
    fi
    if ((r == 0)); then
        env "${envs[@]}" "$bin" "${args[@]}" "${pass[@]}" &
    else
        env "${envs[@]}" "$bin" "${args[@]}" "${pass[@]}" >"$run/rank$r.log" 2>&1 &
    fi
    pids+=($!)
done

# Sleeps that end at once when this subshell is told to stop, and hold none of our output open
# (a caller reading our stdout must not wait for a leftover sleep).
nap() {
    local sp=''
    trap '[[ -n $sp ]] && kill "$sp" 2>/dev/null && wait "$sp" 2>/dev/null; exit 0' TERM
    sleep "$1" >/dev/null 2>&1 &
    sp=$!
    wait "$sp"
}

# watchdog: past the timeout, stop every rank (its output goes nowhere: the helpers must hold
# none of ours open; the wait below reports the timeout)
(
    nap "$timeout"
    : >"$run/timed_out"
    for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
    nap 5
    for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null; done
) >/dev/null 2>&1 &
watchdog=$!
grace=''
# shellcheck disable=SC2317  # called from the trap
stop_helpers() {
    kill "$watchdog" 2>/dev/null
    [[ -n $grace ]] && kill "$grace" 2>/dev/null
    return 0
}
trap stop_helpers EXIT

rcs=()
for ((r = 0; r < nranks; r++)); do rcs+=(""); done
rank_of() { local i; for i in "${!pids[@]}"; do [[ ${pids[i]} == "$1" ]] && echo "$i" && return; done; }
live=("${pids[@]}")
if ((BASH_VERSINFO[0] > 5 || (BASH_VERSINFO[0] == 5 && BASH_VERSINFO[1] >= 1))); then
    while ((${#live[@]})); do
        fin=''
        wait -n -p fin "${live[@]}" 2>/dev/null
        st=$?
        [[ -n ${fin:-} ]] || break # already reaped: the loop below gets the status
        r=$(rank_of "$fin")
        rcs[r]=$st
        nl=()
        for p in "${live[@]}"; do [[ $p != "$fin" ]] && nl+=("$p"); done
        live=("${nl[@]+"${nl[@]}"}")
        if ((st != 0)) && [[ -z $grace ]] && ((${#live[@]})); then
            say "rank $r exited with $st; giving the others 30 s to stop on their own"
            (
                nap 30
                for p in "${live[@]}"; do kill -TERM "$p" 2>/dev/null; done
                nap 5
                for p in "${live[@]}"; do kill -KILL "$p" 2>/dev/null; done
            ) >/dev/null 2>&1 &
            grace=$!
        fi
    done
fi
for ((r = 0; r < nranks; r++)); do  # older bash, or anything left
    if [[ -z ${rcs[r]} ]]; then wait "${pids[r]}"; rcs[r]=$?; fi
done
stop_helpers
wait 2>/dev/null

bad=0
for ((r = 0; r < nranks; r++)); do
    if [[ ${rcs[r]} != 0 ]]; then
        bad=1
        say "rank $r exited with ${rcs[r]}"
        if ((r > 0)) && [[ -f $run/rank$r.log ]]; then
            echo "----- rank $r (last 40 lines of $run/rank$r.log)" >&2
            tail -n 40 "$run/rank$r.log" >&2
        fi
    fi
done
if [[ -f $run/timed_out ]]; then
    say "timed out after ${timeout}s: the ranks were stopped (logs in $run)"
    exit 124
fi
if ((bad)); then
    say "failed after $((SECONDS - t0)) s (logs in $run)"
    exit 1
fi
say "$nranks ranks finished in $((SECONDS - t0)) s"
if ((keep)); then say "logs in $run"; else rm -rf "$run"; fi
exit 0
