"""torch reference for the fused allreduce + residual add + RMSNorm: what an engine runs today
without the fusion, NCCL's allreduce (torch.distributed, in place) then `x + residual` and
`torch.nn.functional.rms_norm(...) * weight`, graph-captured; printed in the RESULT schema of
bench-norm (bench "allreduce_rmsnorm", impl "torch-nccl-unfused"), measured the same way as
bench/scripts/torch_symm_mem.py (its host barrier and its choice of K, R, W, S). With --fp8 (the
default: static,token,group,ue8m0,token+bf16) also the same followed by torch's FP8 quantisation of
the normalised rows, as an engine without a fused kernel runs it (impl
"torch-nccl-unfused-fp8-<variant>", beside bench-norm's "cuda-multimem-fp8-<variant>"):
  static       (out / scale).clamp(±448).to(float8_e4m3fn), scale 0.01 as bench-norm's;
  token        scale = amax(row) / 448 (1 where 0), written to an f32 [tokens] buffer;
  group        scale per group of 128 along hidden, f32 [tokens, hidden / 128];
  ue8m0        the group scale rounded up to a power of two, its exponent byte packed four groups
               to a u32 and transposed to [ceil(groups / 4), align(tokens, 4)] (what DeepGEMM reads);
  token+bf16   per token, keeping the bf16 rows (they are kept in every variant here).
Checked: the dequantised rows within e4m3's precision (relative 2^-3, plus the smallest subnormal
times the scale) of the bf16 rows.

One process per GPU (torch.multiprocessing), NCCL with NVLink multicast off (NCCL_NVLS_ENABLE=0).
For each token count (hidden 8192, bf16 by default):
  * correctness: every rank regenerates every rank's x from the same seeds; residual_out is
    compared with the f32 sum in rank order plus the residual, out with the RMSNorm of that in
    f32, relative to the magnitudes (tolerance 2e-2: NCCL's bf16 sum rounds per step);
  * "pipelined": K calls captured into one CUDA graph, replayed R times between two events,
    time per call = elapsed / (K*R), max over ranks; the timed x holds zeros (repeated in-place
    sums of data would overflow; the kernels do the same work on any values);
  * "single": a graph of one call between external event-record nodes, launched right after a
    host barrier, S times; median per rank, max over ranks.

  python3 bench/scripts/torch_norm_ref.py [--nranks N] [--tokens 1,8,16,128,1024] [--hidden H]
      [--eps E] [--mode pipelined|single|both]
Rank 0 prints `RESULT {json}` and `CHECK {json}` lines and a summary table last.
"""
import argparse
import json
import math
import os
import sys

os.environ["NCCL_NVLS_ENABLE"] = "0"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from torch_symm_mem import (  # noqa: E402
    Barrier, external_events, plan, spawn, time_pipelined, time_single, warm)

IMPL = "torch-nccl-unfused"


def args_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nranks", type=int, default=None)
    p.add_argument("--tokens", default="1,8,16,128,1024")
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--eps", type=float, default=1e-6)
    p.add_argument("--mode", choices=["pipelined", "single", "both"], default="both")
    p.add_argument("--graph-calls", type=int, default=0)
    p.add_argument("--iters", type=int, default=0)
    p.add_argument("--warmup", type=int, default=-1)
    p.add_argument("--single-reps", type=int, default=0)
    p.add_argument("--seed", type=int, default=4321)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--fp8", default="static,token,group,ue8m0,token+bf16",
                   help="FP8 variants after the norm (comma list; empty: none)")
    return p


FP8_MAX = 448.0
GROUP = 128
STATIC_SCALE = 0.01


def quantiser(variant, t, h, dev):
    """The FP8 quantisation of bf16 rows `y` [t, h] as a function (into preallocated outputs, so
    that it can be graph-captured), and a function giving the dequantised rows for the check."""
    q = torch.empty((t, h), dtype=torch.float8_e4m3fn, device=dev)
    ng = h // GROUP
    if variant == "static":
        def quant(y):
            q.copy_((y.float() / STATIC_SCALE).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn))

        def deq():
            return q.float() * STATIC_SCALE, torch.full((t, 1), STATIC_SCALE, device=dev)
        return quant, deq
    if variant in ("token", "token+bf16"):
        sc = torch.empty((t, 1), dtype=torch.float32, device=dev)

        def quant(y):
            yf = y.float()
            s = yf.abs().amax(-1, keepdim=True) / FP8_MAX
            sc.copy_(torch.where(s == 0, torch.ones_like(s), s))
            q.copy_((yf / sc).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn))

        def deq():
            return q.float() * sc, sc
        return quant, deq
    if variant in ("group", "ue8m0"):
        if h % GROUP:
            return None
        sc = torch.empty((t, ng, 1), dtype=torch.float32, device=dev)
        packed = torch.zeros(((ng + 3) // 4, (t + 3) // 4 * 4), dtype=torch.int32, device=dev)
        pad = torch.zeros((t, (ng + 3) // 4 * 4), dtype=torch.int32, device=dev)

        def quant(y):
            g = y.float().view(t, ng, GROUP)
            s = g.abs().amax(-1, keepdim=True) / FP8_MAX
            s = torch.where(s == 0, torch.ones_like(s), s)
            if variant == "ue8m0":
                s = torch.exp2(torch.ceil(torch.log2(s)))
            sc.copy_(s)
            q.copy_((g / sc).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(t, h))
            if variant == "ue8m0":
                e = (sc.view(t, ng).view(torch.int32) >> 23) & 255
                pad[:, :ng] = e
                p4 = pad.view(t, -1, 4)
                word = p4[..., 0] | (p4[..., 1] << 8) | (p4[..., 2] << 16) | (p4[..., 3] << 24)
                packed[:, :t] = word.t()

        def deq():
            return (q.float().view(t, ng, GROUP) * sc).view(t, h), sc.view(t, ng).repeat_interleave(GROUP, -1)
        return quant, deq
    raise SystemExit(f"torch_norm_ref.py: unknown FP8 variant {variant}")


def run(rank, n, a, port, shared):
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n, device_id=dev)
    barrier = Barrier(shared, rank, n)
    h = a.hidden
    modes = ["pipelined", "single"] if a.mode == "both" else [a.mode]
    tokens = [int(t) for t in a.tokens.split(",") if t.strip()]
    tol = 2e-2
    external = external_events()
    if rank == 0:
        print(f"# torch_norm_ref.py: torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
              f"{n} ranks, {torch.cuda.get_device_name(dev)}, hidden {h}, bf16", flush=True)

    def mx(v):
        t = torch.tensor([v], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    summary = []
    for t in tokens:
        shape = (t, h)
        gen = lambda s: torch.Generator(device=dev).manual_seed(a.seed * 1000003 + t * 7 + s)  # noqa: E731
        xs = [torch.randn(shape, generator=gen(q), device=dev, dtype=torch.float32).to(torch.bfloat16) for q in range(n)]
        r0 = torch.randn(shape, generator=gen(100), device=dev, dtype=torch.float32).to(torch.bfloat16)
        w = (1 + 0.1 * torch.randn(h, generator=gen(200), device=dev, dtype=torch.float32)).to(torch.bfloat16)
        x = torch.empty(shape, dtype=torch.bfloat16, device=dev)
        res = torch.empty(shape, dtype=torch.bfloat16, device=dev)
        out = torch.empty(shape, dtype=torch.bfloat16, device=dev)

        def call():
            dist.all_reduce(x)
            torch.add(x, r0, out=res)
            out.copy_(F.rms_norm(res, (h,), weight=w, eps=a.eps))

        # correctness, against f32 in rank order
        x.copy_(xs[rank])
        torch.cuda.synchronize()
        barrier("data")
        call()
        torch.cuda.synchronize()
        s = torch.zeros(shape, dtype=torch.float32, device=dev)
        mag = torch.zeros(shape, dtype=torch.float32, device=dev)
        for q in range(n):
            s += xs[q].float()
            mag += xs[q].float().abs()
        s += r0.float()
        mag += r0.float().abs()
        e_res = ((res.float() - s).abs() / mag.clamp(min=1e-30)).max().item()
        rr = res.float()
        ref_out = rr * torch.rsqrt(rr.pow(2).mean(-1, keepdim=True) + a.eps) * w.float()
        e_out = ((out.float() - ref_out).abs() / (ref_out.abs() + 1e-2)).max().item()
        err = mx(max(e_res, e_out))
        correct = err <= tol
        k_, r_, w_, s_ = plan(a, max(1, t * h * 2))
        x.zero_()
        warm(call)
        times = {}
        if "pipelined" in modes:
            times["pipelined"] = mx(time_pipelined(call, k_, r_, w_, barrier))
        if "single" in modes:
            times["single"] = mx(time_single(call, s_, barrier, external))
        nbytes = t * h * 2
        if rank == 0:
            print("CHECK " + json.dumps({"bench": "allreduce_rmsnorm", "impl": IMPL, "dtype": "bf16", "ranks": n,
                                         "bytes": nbytes, "tokens": t, "max_rel_err": err if math.isfinite(err) else None,
                                         "tolerance": tol, "correct": correct}), flush=True)
            for m in modes:
                tm = times[m]
                alg = nbytes / (tm * 1e-6) / 1e9 if tm > 0 else 0.0
                print("RESULT " + json.dumps({
                    "bench": "allreduce_rmsnorm", "impl": IMPL, "operand": "-", "dtype": "bf16", "op": "sum",
                    "ranks": n, "bytes": nbytes, "tokens": t, "hidden": h, "mode": m, "time_us": round(tm, 3),
                    "algbw_gbs": round(alg, 3), "busbw_gbs": round(alg * 2 * (n - 1) / n, 3),
                    "correct": correct}), flush=True)
        summary.append((t, times, correct))
        # the same followed by torch's FP8 quantisation of the normalised rows
        for variant in [v.strip() for v in a.fp8.split(",") if v.strip()]:
            qz = quantiser(variant, t, h, dev)
            if qz is None:
                if rank == 0:
                    print(f"# fp8-{variant}: hidden {h} is not a multiple of {GROUP}; skipped", flush=True)
                continue
            quant, deq = qz

            def call_q(quant=quant):
                call()
                quant(out)

            x.copy_(xs[rank])
            torch.cuda.synchronize()
            barrier("data fp8")
            call_q()
            torch.cuda.synchronize()
            dq, scale = deq()
            ref = out.float()
            bound = ref.abs() * 0.125 + scale * 2.0 ** -9
            ok_q = mx(float(((dq - ref).abs() > bound).sum().item())) == 0
            x.zero_()
            warm(call_q)
            tq = {}
            if "pipelined" in modes:
                tq["pipelined"] = mx(time_pipelined(call_q, k_, r_, w_, barrier))
            if "single" in modes:
                tq["single"] = mx(time_single(call_q, s_, barrier, external))
            impl = f"{IMPL}-fp8-{variant}"
            if rank == 0:
                for m in modes:
                    tm = tq[m]
                    alg = nbytes / (tm * 1e-6) / 1e9 if tm > 0 else 0.0
                    print("RESULT " + json.dumps({
                        "bench": "allreduce_rmsnorm", "impl": impl, "operand": "-", "dtype": "bf16", "op": "sum",
                        "ranks": n, "bytes": nbytes, "tokens": t, "hidden": h, "mode": m, "time_us": round(tm, 3),
                        "algbw_gbs": round(alg, 3), "busbw_gbs": round(alg * 2 * (n - 1) / n, 3),
                        "algorithm": f"all_reduce + add + rms_norm + torch FP8 {variant}",
                        "correct": ok_q and correct}), flush=True)
            summary.append((f"{t} fp8-{variant}", tq, ok_q and correct))
    if rank == 0:
        print(f"\n# {IMPL}, {n} ranks, hidden {h}, bf16, per-call µs (pipelined / single)")
        for t, times, ok in summary:
            print(f"{t:>6} tokens | {times.get('pipelined', float('nan')):9.2f} {times.get('single', float('nan')):9.2f} "
                  f"{'ok' if ok else 'WRONG'}")
        sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


def main():
    return spawn(run, args_parser().parse_args(), "torch_norm_ref.py", 29623)


if __name__ == "__main__":
    sys.exit(main())
