"""torch symmetric-memory references (one_shot_all_reduce, two_shot_all_reduce_ and the reduce-scatter
reduce_scatter_out, which needs no multicast either), printed in the RESULT schema of
bench/native/nccl_ref.c, measured the same way.

One process per GPU (torch.multiprocessing), the CUDA symmetric-memory backend with NVLink
multicast off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NCCL_NVLS_ENABLE=0). For each size and kind:
  * correctness: deterministic random data per rank (every rank regenerates every rank's data
    on its GPU from the same seeds), reference summed in f32 in rank order and rounded once to
    the type; error measured against the sum of magnitudes (tolerance max(1e-2, n/256) for bf16,
    1e-5 for f32); the one-shot output is checked again after the graph replays;
  * "pipelined": K calls captured into one CUDA graph, replayed R times between two events,
    time per call = elapsed / (K*R), max over ranks;
  * "single": a graph of one call with external event-record nodes around it, launched right
    after a host barrier (shared memory, spinning), S times; median per rank, max over ranks.
two_shot_all_reduce_ works in place and reduce_scatter_out changes its input too: their timed
buffers hold zeros (repeated sums of data would overflow; the kernels do the same work on any
values). The reduce-scatter (kind reduce_scatter, sum, the whole input of B bytes scattered in N
parts, busbw = B / t x (N - 1) / N) is checked against the rank's part of the same reference.

  python3 bench/scripts/torch_symm_mem.py [--nranks N] [--min-bytes B] [--max-bytes B]
      [--sizes a,b] [--kinds one_shot,two_shot,reduce_scatter] [--dtype bf16|f32]
      [--mode pipelined|single|both]
      [--graph-calls K] [--iters R] [--warmup W] [--single-reps S]
Rank 0 prints `RESULT {json}` and `CHECK {json}` lines and a summary table last.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
if os.environ.get("NCCL_NVLS_ENABLE", "0") != "0":
    print(f"torch_symm_mem.py: NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']}: forcing 0", file=sys.stderr)
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

IMPL = {"one_shot": "torch-symm-mem-one-shot", "two_shot": "torch-symm-mem-two-shot",
        "reduce_scatter": "torch-symm-mem-reduce-scatter"}
BENCH = {"one_shot": "allreduce", "two_shot": "allreduce", "reduce_scatter": "reduce_scatter"}


def parse_size(s):
    s = s.strip()
    mult = 1
    for suf, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if s.endswith(suf):
            s, mult = s[: -len(suf)], m
            break
    v = int(s) * mult
    if v <= 0:
        raise argparse.ArgumentTypeError(f"bad size {s}")
    return v


def args_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nranks", type=int, default=None)
    p.add_argument("--min-bytes", type=parse_size, default=1024)
    p.add_argument("--max-bytes", type=parse_size, default=1 << 30)
    p.add_argument("--sizes", default="")
    p.add_argument("--kinds", default="one_shot,two_shot")
    p.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    p.add_argument("--mode", choices=["pipelined", "single", "both"], default="both")
    p.add_argument("--graph-calls", type=int, default=0)
    p.add_argument("--iters", type=int, default=0)
    p.add_argument("--warmup", type=int, default=-1)
    p.add_argument("--single-reps", type=int, default=0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--port", type=int, default=0)
    return p


def est_us(nbytes):
    return 6.0 + nbytes / 300e3


def plan(a, nbytes):
    """The same choice of K, R, W, S as nccl_ref.c."""
    t = est_us(nbytes)
    k = a.graph_calls or int(min(100, max(2, (64 << 20) // nbytes)))
    r = a.iters or int(min(100, max(3, math.ceil(50e3 / (t * k)))))
    w = a.warmup if a.warmup >= 0 else int(min(5, max(1, r // 4)))
    s = a.single_reps or (50 if t < 1000 else 10)
    return k, r, w, s


class Barrier:
    """Host barrier over shared memory: rank r publishes its epoch, then spins until every rank
    has published it (epochs only grow, so no read-modify-write is needed). Bounded wait."""

    def __init__(self, arr, rank, n, wait_s=120.0):
        self.arr, self.rank, self.n, self.epoch, self.wait_s = arr, rank, n, 0, wait_s

    def __call__(self, what=""):
        self.epoch += 1
        e = self.epoch
        self.arr[self.rank] = e
        t0 = time.monotonic()
        spins = 0
        while True:
            if all(self.arr[q] >= e for q in range(self.n)):
                return
            spins += 1
            if spins > 20000:
                os.sched_yield()
            if spins % 4096 == 0:
                if self.arr[self.n] != 0:
                    raise SystemExit(f"torch_symm_mem.py rank {self.rank}: a peer failed; stopping at barrier {what}")
                if time.monotonic() - t0 > self.wait_s:
                    raise SystemExit(f"torch_symm_mem.py rank {self.rank}: barrier {what} timed out")


def warm(call):
    """Two calls on a side stream (what a capture needs before it), then wait for them."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
        call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()


def time_pipelined(call, k, r, w, barrier):
    """µs per call on this rank: K calls captured into one graph, replayed R times after W."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(k):
            call()
    for _ in range(w):
        g.replay()
    torch.cuda.synchronize()
    barrier("pipelined")
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(r):
        g.replay()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) * 1e3 / (k * r)


def time_single(call, s, barrier, external):
    """Median µs on this rank of a graph of one call (between event-record nodes when the torch
    has external events) launched right after a host barrier, S times."""
    g = torch.cuda.CUDAGraph()
    s0 = torch.cuda.Event(enable_timing=True, external=True) if external else torch.cuda.Event(enable_timing=True)
    s1 = torch.cuda.Event(enable_timing=True, external=True) if external else torch.cuda.Event(enable_timing=True)
    with torch.cuda.graph(g):
        if external:
            s0.record()
        call()
        if external:
            s1.record()
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(s):
        barrier("single")
        if not external:
            s0.record()
        g.replay()
        if not external:
            s1.record()
        s1.synchronize()
        ts.append(s0.elapsed_time(s1) * 1e3)
    return statistics.median(ts)


def external_events():
    """Whether this torch records events as graph nodes (`external=True`)."""
    try:
        torch.cuda.Event(enable_timing=True, external=True)
        return True
    except TypeError:
        return False


def worker(rank, run, n, a, port, shared):
    """One rank: `run(rank, n, a, port, shared)`; a failure raises the shared flag the host
    barriers watch, so the other ranks stop instead of waiting out their bound."""
    try:
        run(rank, n, a, port, shared)
    except BaseException:
        shared[n] = 1 + rank
        raise


def spawn(run, a, name, port_base):
    """Run `run` on every GPU (or `--nranks`), one process each; 0 (and a SKIPPED line) with
    fewer than 2 GPUs."""
    n = a.nranks or torch.cuda.device_count()
    if n < 2:
        print(f"SKIPPED: {name} needs 2 GPUs", file=sys.stderr)
        return 0
    ctx = mp.get_context("spawn")
    shared = ctx.RawArray("q", n + 1)  # epochs, then a failure flag
    port = a.port or port_base + os.getpid() % 1000
    mp.spawn(worker, args=(run, n, a, port, shared), nprocs=n, join=True)
    return 0


def run(rank, n, a, port, shared):
    import torch.distributed._symmetric_memory as symm_mem

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n, device_id=dev)
    group = dist.group.WORLD
    gname = group.group_name
    for fn, arg in (("set_backend", "CUDA"), ("enable_symm_mem_for_group", gname)):
        try:
            getattr(symm_mem, fn)(arg)
        except Exception:  # absent or already set in this torch
            pass
    barrier = Barrier(shared, rank, n)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    esize = 2 if a.dtype == "bf16" else 4
    tol = max(1e-2, n / 256) if a.dtype == "bf16" else max(1e-5, n * 2.0 ** -24)
    kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
    for k in kinds:
        if k not in IMPL:
            raise SystemExit(f"unknown kind {k} (one_shot, two_shot, reduce_scatter)")
    sizes = [parse_size(s) for s in a.sizes.split(",") if s] if a.sizes else []
    if not sizes:
        b = a.min_bytes
        while b <= a.max_bytes:
            sizes.append(b)
            b *= 2
    maxn = max(sizes) // esize
    buf = symm_mem.empty(maxn, dtype=dtype, device=dev)
    symm_mem.rendezvous(buf, gname)
    out_full = torch.empty(maxn, dtype=dtype, device=dev)
    ops = torch.ops.symm_mem
    has_out = hasattr(ops, "one_shot_all_reduce_out")
    modes = ["pipelined", "single"] if a.mode == "both" else [a.mode]
    external = external_events()
    if rank == 0:
        print(f"# torch_symm_mem.py: torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
              f"{n} ranks, {torch.cuda.get_device_name(dev)}, {a.dtype}, one_shot_all_reduce_out: {has_out}, "
              f"event nodes in graphs: {external}", flush=True)
    summary = []

    def mx(v):
        t = torch.tensor([v], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    for nbytes in sizes:
        cnt = nbytes // esize
        x = buf[:cnt]
        out = out_full[:cnt]
        # every rank's data, regenerated on this GPU from the same seeds; reference in f32, rank order
        acc = torch.zeros(cnt, dtype=torch.float32, device=dev)
        mag = torch.zeros(cnt, dtype=torch.float32, device=dev)
        mine = None
        for q in range(n):
            g = torch.Generator(device=dev).manual_seed(a.seed * 1000003 + nbytes * 7 + q)
            d = torch.randn(cnt, generator=g, device=dev, dtype=torch.float32).to(dtype)
            acc += d.float()
            mag += d.float().abs()
            if q == rank:
                mine = d
        ref = acc.to(dtype).float()
        mag.clamp_(min=1e-30)
        del acc

        def err_of(y, ref=ref, mag=mag):
            e = ((y.float() - ref).abs() / mag).nan_to_num(nan=math.inf).max().item()
            return mx(e)

        k_, r_, w_, s_ = plan(a, nbytes)
        row = {"bytes": nbytes}
        part = cnt // n
        for kind in kinds:
            if kind == "reduce_scatter":
                rs_out = out_full[:part]
                lo, hi = rank * part, (rank + 1) * part

                def call():
                    ops.reduce_scatter_out(x, gname, False, rs_out)
                result = rs_out

                def check(y, ref=ref[lo:hi], mag=mag[lo:hi]):
                    return err_of(y, ref, mag)
            elif kind == "one_shot":
                def call():
                    if has_out:
                        ops.one_shot_all_reduce_out(x, "sum", gname, out)
                    else:
                        out.copy_(ops.one_shot_all_reduce(x, "sum", gname))
                result = out
                check = err_of
            else:
                def call():
                    ops.two_shot_all_reduce_(x, "sum", gname)
                result = x
                check = err_of
            x.copy_(mine)
            out.fill_(float("nan"))
            torch.cuda.synchronize()
            barrier("data")
            try:
                call()
                torch.cuda.synchronize()
                failed = 0.0
            except RuntimeError as e:  # e.g. a size the kernel refuses: the same on every rank
                print(f"torch_symm_mem.py rank {rank}: {IMPL[kind]} at {nbytes} bytes failed: {e}", file=sys.stderr)
                failed = 1.0
            if mx(failed) > 0:
                if rank == 0:
                    print(f"# {IMPL[kind]}: {nbytes} bytes failed on some rank; skipped", flush=True)
                row[kind] = ({}, False)
                continue
            err = check(result)
            if kind in ("two_shot", "reduce_scatter"):
                x.zero_()  # changed in place: keep the timed sums finite
            warm(call)
            times = {}
            if "pipelined" in modes:
                if kind == "one_shot":
                    out.fill_(float("nan"))
                times["pipelined"] = mx(time_pipelined(call, k_, r_, w_, barrier))
                if kind == "one_shot":
                    err = max(err, err_of(out))
            correct = err <= tol
            if "single" in modes:
                times["single"] = mx(time_single(call, s_, barrier, external))
            if rank == 0:
                print("CHECK " + json.dumps({"bench": BENCH[kind], "impl": IMPL[kind], "dtype": a.dtype, "ranks": n,
                                             "bytes": nbytes, "max_rel_err": err if math.isfinite(err) else None,
                                             "tolerance": tol, "correct": correct}), flush=True)
                for m in modes:
                    t = times[m]
                    alg = nbytes / (t * 1e-6) / 1e9 if t > 0 else 0.0
                    factor = (2 if BENCH[kind] == "allreduce" else 1) * (n - 1) / n
                    print("RESULT " + json.dumps({
                        "bench": BENCH[kind], "impl": IMPL[kind], "operand": "-", "dtype": a.dtype, "op": "sum",
                        "ranks": n, "bytes": nbytes, "mode": m, "time_us": round(t, 3), "algbw_gbs": round(alg, 3),
                        "busbw_gbs": round(alg * factor, 3), "correct": correct}), flush=True)
            row[kind] = (times, correct)
        summary.append(row)
        del ref, mag
    if rank == 0:
        print(f"\n# torch symm_mem, {n} ranks, {a.dtype}, per-call µs (pipelined / single)")
        print(f"{'bytes':>10} | " + " | ".join(f"{k:>22}" for k in kinds))
        for row in summary:
            cells = []
            for k in kinds:
                t, ok = row[k]
                cells.append(f"{t.get('pipelined', float('nan')):9.2f} {t.get('single', float('nan')):9.2f} {'ok' if ok else 'WRONG':>2}")
            print(f"{row['bytes']:>10} | " + " | ".join(cells))
        sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


def main():
    return spawn(run, args_parser().parse_args(), "torch_symm_mem.py", 29517)


if __name__ == "__main__":
    sys.exit(main())
