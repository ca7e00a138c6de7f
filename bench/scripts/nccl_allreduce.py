"""NCCL allreduce reference for `cargo xtask bench-hw allreduce`.

One process per GPU (torch.multiprocessing), NCCL through torch.distributed, bf16 sum, NVLink
multicast off (NCCL_NVLS_ENABLE=0). For each size: ITERS allreduces captured in one CUDA graph,
replayed REPS times, each replay timed with CUDA events; the median replay / ITERS is the time per
allreduce. Correctness is checked once per size against the host-side expectation on random data.
Prints one `RESULT {json}` line per size (rank 0), the format the xtask merges with ours.
"""
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = [int(s) for s in os.environ.get("BENCH_SIZES", "").split(",") if s] or [
    1 << 10, 1 << 16, 1 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30]
ITERS = int(os.environ.get("BENCH_ITERS", "20"))
REPS = int(os.environ.get("BENCH_REPS", "7"))


def iters_for(nbytes):
    # Fewer captured calls for big messages, enough for small ones to leave launch gaps out.
    return max(2, min(ITERS, (1 << 30) // max(nbytes, 1) * 2))


def worker(rank, world, port):
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
    for nbytes in SIZES:
        n = nbytes // 2
        x = torch.randn(n, device="cuda", dtype=torch.float32, generator=gen).to(torch.bfloat16)
        # Correctness: reference sum of every rank's data in float32, compared in bf16 tolerance.
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x)
        ref = torch.stack([p.float() for p in parts]).sum(0)
        y = x.clone()
        dist.all_reduce(y)
        torch.cuda.synchronize()
        err = ((y.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        correct = err < 1e-2
        # Timing: graph-captured loop.
        it = iters_for(nbytes)
        buf = x.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                dist.all_reduce(buf)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(it):
                dist.all_reduce(buf)
        g.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(REPS):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            dist.barrier()
            torch.cuda.synchronize()
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / it)
        del g
        t = statistics.median(times)
        if rank == 0:
            algbw = nbytes / (t * 1e-6) / 1e9
            busbw = algbw * 2 * (world - 1) / world
            print("RESULT " + json.dumps({"impl": "nccl", "bytes": nbytes, "time_us": round(t, 3),
                                          "algbw": round(algbw, 2), "busbw": round(busbw, 2),
                                          "path": f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))} graph",
                                          "correct": correct, "rel_err": err}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    world = int(os.environ.get("BENCH_WORLD", torch.cuda.device_count()))
    if world < 2:
        print("SKIPPED: nccl reference: needs 2 GPUs", file=sys.stderr)
        sys.exit(0)
    mp.spawn(worker, args=(world, 29500 + os.getpid() % 1000), nprocs=world, join=True)
