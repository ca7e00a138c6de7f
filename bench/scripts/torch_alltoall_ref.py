"""torch reference for the all-to-all: `torch.distributed.all_to_all_single(out, inp)` over NCCL (what
an engine calls), graph-captured, printed in the RESULT schema of bench/native/nccl_ref.c (bench
"alltoall", impl "torch-nccl-all-to-all-single"), measured as bench/scripts/torch_symm_mem.py
measures (its host barrier and its choice of K, R, W, S).

One process per GPU (torch.multiprocessing), NCCL with NVLink multicast off (NCCL_NVLS_ENABLE=0).
bytes = one rank's whole send buffer of N equal parts (as nccl-tests counts alltoall); busbw =
algbw x (N-1)/N. For each size:
  * correctness: every rank regenerates every rank's input from the same seeds; part q of this
    rank's output must equal part `rank` of rank q's input bit for bit (a copy); checked after one
    eager call and again after the graph replays;
  * "pipelined": K calls captured into one CUDA graph, replayed R times between two events, time
    per call = elapsed / (K*R), max over ranks;
  * "single": a graph of one call between external event-record nodes, launched right after a host
    barrier, S times; median per rank, max over ranks.
A torch whose NCCL calls cannot be captured is reported (a `#` line) and timed eagerly instead,
with "algorithm" = "eager" in its RESULT lines.

  python3 bench/scripts/torch_alltoall_ref.py [--nranks N] [--min-bytes B] [--max-bytes B]
      [--sizes a,b] [--dtype bf16|f32] [--mode pipelined|single|both]
Rank 0 prints `RESULT {json}` and `CHECK {json}` lines and a summary table last.
"""
import argparse
import json
import math
import os
import statistics
import sys

os.environ["NCCL_NVLS_ENABLE"] = "0"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from torch_symm_mem import (  # noqa: E402
    Barrier, external_events, parse_size, plan, spawn, time_pipelined, time_single, warm)

IMPL = "torch-nccl-all-to-all-single"


def args_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nranks", type=int, default=None)
    p.add_argument("--min-bytes", type=parse_size, default=1024)
    p.add_argument("--max-bytes", type=parse_size, default=1 << 30)
    p.add_argument("--sizes", default="")
    p.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    p.add_argument("--mode", choices=["pipelined", "single", "both"], default="both")
    p.add_argument("--graph-calls", type=int, default=0)
    p.add_argument("--iters", type=int, default=0)
    p.add_argument("--warmup", type=int, default=-1)
    p.add_argument("--single-reps", type=int, default=0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--port", type=int, default=0)
    return p


def time_eager(call, k, r, barrier):
    """µs per call of R rounds of K eager calls (where capture is refused)."""
    torch.cuda.synchronize()
    barrier("eager")
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(r * k):
        call()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) * 1e3 / (k * r)


def time_eager_single(call, s, barrier):
    ts = []
    for _ in range(s):
        torch.cuda.synchronize()
        barrier("eager single")
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        call()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3)
    return statistics.median(ts)


def run(rank, n, a, port, shared):
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n, device_id=dev)
    barrier = Barrier(shared, rank, n)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    esize = 2 if a.dtype == "bf16" else 4
    modes = ["pipelined", "single"] if a.mode == "both" else [a.mode]
    external = external_events()
    sizes = [parse_size(s) for s in a.sizes.split(",") if s] if a.sizes else []
    if not sizes:
        b = a.min_bytes
        while b <= a.max_bytes:
            sizes.append(b)
            b *= 2
    maxn = max(sizes) // esize
    inp_full = torch.empty(maxn, dtype=dtype, device=dev)
    out_full = torch.empty(maxn, dtype=dtype, device=dev)
    if rank == 0:
        print(f"# torch_alltoall_ref.py: torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
              f"{n} ranks, {torch.cuda.get_device_name(dev)}, {a.dtype}, event nodes in graphs: {external}", flush=True)

    def mx(v):
        t = torch.tensor([v], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    summary = []
    capturable = True
    for nbytes in sizes:
        cnt = nbytes // esize // n * n
        if cnt == 0:
            if rank == 0:
                print(f"# {nbytes} bytes: less than one element per rank; skipped", flush=True)
            continue
        nbytes = cnt * esize
        part = cnt // n
        inp, out = inp_full[:cnt], out_full[:cnt]
        # the expected output: part q = part `rank` of rank q's input (regenerated here)
        want = torch.empty(cnt, dtype=dtype, device=dev)
        for q in range(n):
            g = torch.Generator(device=dev).manual_seed(a.seed * 1000003 + nbytes * 7 + q)
            d = torch.randn(cnt, generator=g, device=dev, dtype=torch.float32).to(dtype)
            want[q * part:(q + 1) * part] = d[rank * part:(rank + 1) * part]
            if q == rank:
                inp.copy_(d)
            del d

        def call():
            dist.all_to_all_single(out, inp)

        def wrong():
            bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
            return mx(float((out.view(bits) != want.view(bits)).sum().item()))

        out.fill_(float("nan"))
        torch.cuda.synchronize()
        barrier("data")
        call()
        torch.cuda.synchronize()
        bad = wrong()
        k_, r_, w_, s_ = plan(a, nbytes)
        warm(call)
        times = {}
        algo = "graph"
        if capturable:
            try:
                out.fill_(float("nan"))
                if "pipelined" in modes:
                    times["pipelined"] = mx(time_pipelined(call, k_, r_, w_, barrier))
                    bad = max(bad, wrong())
                if "single" in modes:
                    times["single"] = mx(time_single(call, s_, barrier, external))
            except RuntimeError as e:  # this torch refuses to capture its NCCL call: eager
                capturable = False
                print(f"torch_alltoall_ref.py rank {rank}: capture failed ({e}); timing eager calls", file=sys.stderr)
                if rank == 0:
                    print("# all_to_all_single could not be graph-captured here: eager timings from now on", flush=True)
                torch.cuda.synchronize()
        if not capturable:
            algo = "eager"
            if "pipelined" in modes:
                times["pipelined"] = mx(time_eager(call, k_, r_, barrier))
            if "single" in modes:
                times["single"] = mx(time_eager_single(call, s_, barrier))
        correct = bad == 0
        if rank == 0:
            print("CHECK " + json.dumps({"bench": "alltoall", "impl": IMPL, "dtype": a.dtype, "ranks": n,
                                         "bytes": nbytes, "wrong_elements": bad, "correct": correct}), flush=True)
            for m in modes:
                t = times[m]
                alg = nbytes / (t * 1e-6) / 1e9 if t > 0 else 0.0
                print("RESULT " + json.dumps({
                    "bench": "alltoall", "impl": IMPL, "operand": "-", "dtype": a.dtype, "op": "-",
                    "ranks": n, "bytes": nbytes, "mode": m, "time_us": round(t, 3), "algbw_gbs": round(alg, 3),
                    "busbw_gbs": round(alg * (n - 1) / n, 3), "algorithm": algo, "correct": correct}), flush=True)
        summary.append((nbytes, times, correct, algo))
        del want
    if rank == 0:
        print(f"\n# {IMPL}, {n} ranks, {a.dtype}, per-call µs (pipelined / single)")
        for nbytes, times, ok, algo in summary:
            print(f"{nbytes:>11} | {times.get('pipelined', math.nan):9.2f} {times.get('single', math.nan):9.2f} "
                  f"{algo:>5} {'ok' if ok else 'WRONG'}")
        sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


def main():
    return spawn(run, args_parser().parse_args(), "torch_alltoall_ref.py", 29731)


if __name__ == "__main__":
    sys.exit(main())
