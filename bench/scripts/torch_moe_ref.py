"""torch reference for MoE dispatch / combine: what an engine without DeepEP runs, built on
`torch.distributed.all_to_all_single` over NCCL (Megatron's all-to-all token dispatcher in shape),
at the DeepSeek-V3 shape (hidden 7168, top-8, 256 experts spread evenly over the ranks), printed
in the RESULT schema of bench-moe (bench "moe_dispatch" / "moe_combine", impl
"torch-nccl-all-to-all-single"), measured with the helpers of bench/scripts/torch_symm_mem.py.

One process per GPU (torch.multiprocessing), NCCL with NVLink multicast off (NCCL_NVLS_ENABLE=0).
Per token count T (tokens per rank) and payload (bf16 rows, or FP8 e4m3 rows with one f32 scale
per group of 128, as DeepEP's FP8 dispatch carries them), random routing (8 distinct experts per
token, softmax weights; seeded per rank):
  dispatch = counts   per-expert send counts (bincount), exchanged with all_to_all_single, copied
                      to the host (the splits all_to_all_single needs: a host synchronisation)
           + permute  the token rows gathered in expert order, one row per (token, expert) pair
           + a2a      the rows (and the FP8 scales) with all_to_all_single and those splits
           + group    the received rows regrouped by local expert (what a grouped GEMM reads)
  combine  = ungroup  back to the received order
           + a2a      the experts' bf16 outputs back with the reverse splits
           + sum      unpermuted and weighted, summed over the top-k in f32, rounded to bf16.
The experts are the identity (FP8: dequantised to bf16) so that the combined output must equal
x · Σ weights (checked against the local computation, relative tolerance 2e-2).
Timings, median of --reps, max over ranks:
  * mode "eager": each phase between events, the whole dispatch (with its host synchronisation)
    and combine; the per-phase µs are in the RESULT's "phases_us";
  * modes "pipelined" / "single": dispatch without its counts exchange (the splits of this routing
    fixed, as an engine that knows them could capture) and the combine, graph-captured (K calls per
    graph replayed R times; one call between external event nodes after a host barrier). A torch
    that cannot capture them says so in a `#` line and leaves these modes out.
"Logical bandwidth" (DeepEP's low-latency tests' convention): bytes = the number of (token,
expert) selections x the bytes of one token's payload (bf16: 2·hidden; FP8: hidden + 4·hidden/128;
the combine: 2·hidden), divided by the time; RESULT "bytes" is that count, algbw = busbw = it / time.

  python3 bench/scripts/torch_moe_ref.py [--nranks N] [--tokens 1,8,32,128,512,4096]
      [--hidden 7168] [--topk 8] [--experts 256] [--payload bf16,fp8] [--reps 20]
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
    Barrier, external_events, spawn, time_pipelined, time_single, warm)

IMPL = "torch-nccl-all-to-all-single"
GROUP = 128
FP8_MAX = 448.0


def args_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nranks", type=int, default=None)
    p.add_argument("--tokens", default="1,8,32,128,512,4096")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--payload", default="bf16,fp8")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--graph-calls", type=int, default=10)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=2501)
    p.add_argument("--port", type=int, default=0)
    return p


def quantise(x):
    """bf16 rows -> (e4m3 rows, f32 scales per group of 128): scale = amax / 448."""
    t, h = x.shape
    g = x.float().view(t, h // GROUP, GROUP)
    s = (g.abs().amax(-1) / FP8_MAX).clamp(min=1e-12)
    q = (g / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(t, h)
    return q, s


def run(rank, n, a, port, shared):
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n, device_id=dev)
    barrier = Barrier(shared, rank, n)
    h, k, E = a.hidden, a.topk, a.experts
    if E % n or h % GROUP or k > E:
        raise SystemExit(f"torch_moe_ref.py: {E} experts over {n} ranks, hidden {h} (multiple of {GROUP}), top-{k}")
    per = E // n
    payloads = [p.strip() for p in a.payload.split(",") if p.strip()]
    for p in payloads:
        if p not in ("bf16", "fp8"):
            raise SystemExit(f"torch_moe_ref.py: payload {p}: bf16 or fp8")
    tokens = [int(t) for t in a.tokens.split(",") if t.strip()]
    external = external_events()
    if rank == 0:
        print(f"# torch_moe_ref.py: torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
              f"{n} ranks, {torch.cuda.get_device_name(dev)}, hidden {h}, top-{k}, {E} experts ({per} per rank)", flush=True)

    def mx(v):
        t = torch.tensor([v], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    summary = []
    for payload in payloads:
        fp8 = payload == "fp8"
        tok_bytes = h + 4 * (h // GROUP) if fp8 else 2 * h
        for T in tokens:
            gen = torch.Generator(device=dev).manual_seed(a.seed * 1000003 + T * 31 + rank)
            x = torch.randn((T, h), generator=gen, device=dev, dtype=torch.float32).to(torch.bfloat16)
            logits = torch.randn((T, E), generator=gen, device=dev, dtype=torch.float32)
            top = logits.topk(k, dim=-1)
            ids, w = top.indices, torch.softmax(top.values, dim=-1)
            if fp8:
                xq, xs = quantise(x)
                x_used = (xq.float().view(T, h // GROUP, GROUP) * xs[..., None]).view(T, h).to(torch.bfloat16)
            else:
                x_used = x
            st = {}

            def counts():
                flat = ids.flatten()
                st["order"] = torch.argsort(flat, stable=True)
                send_e = torch.bincount(flat, minlength=E)
                recv_e = torch.empty_like(send_e)
                dist.all_to_all_single(recv_e, send_e)  # [src][local expert]
                st["recv_e"] = recv_e
                st["send_splits"] = send_e.view(n, per).sum(1).tolist()  # host synchronisation
                st["recv_splits"] = recv_e.view(n, per).sum(1).tolist()

            def routing_tables():
                # the received rows of (src s, local expert j) in order; grouped: expert-major
                rc = st["recv_e"].view(n, per)
                seg = rc.flatten()  # src-major segments
                starts = torch.cumsum(seg, 0) - seg
                key = torch.arange(n * per, device=dev).view(n, per).t().flatten()  # expert-major order
                lens = seg[key]
                base = starts[key]
                total = int(sum(st["recv_splits"]))
                idx = torch.repeat_interleave(base, lens) + (
                    torch.arange(total, device=dev) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens))
                st["group_idx"] = idx
                st["total"] = total
                st["rows"] = torch.empty((total, h), dtype=torch.uint8 if fp8 else torch.bfloat16, device=dev)
                st["rows_s"] = torch.empty((total, h // GROUP), dtype=torch.float32, device=dev)
                st["back"] = torch.empty((T * k, h), dtype=torch.bfloat16, device=dev)
                st["tok"] = st["order"] // k

            def permute():
                if fp8:
                    st["xs"] = xq.view(torch.uint8)[st["tok"]]
                    st["ss"] = xs[st["tok"]]
                else:
                    st["xs"] = x[st["tok"]]

            def a2a():
                dist.all_to_all_single(st["rows"], st["xs"], st["recv_splits"], st["send_splits"])
                if fp8:
                    dist.all_to_all_single(st["rows_s"], st["ss"], st["recv_splits"], st["send_splits"])

            def group():
                st["grouped"] = st["rows"][st["group_idx"]]
                if fp8:
                    st["grouped_s"] = st["rows_s"][st["group_idx"]]

            def experts():  # identity (FP8: dequantised), not timed
                if fp8:
                    g = st["grouped"].view(torch.float8_e4m3fn).float().view(-1, h // GROUP, GROUP)
                    st["y"] = (g * st["grouped_s"][..., None]).view(-1, h).to(torch.bfloat16)
                else:
                    st["y"] = st["grouped"].clone()

            def ungroup():
                st["y_recv"] = torch.empty_like(st["y"])
                st["y_recv"][st["group_idx"]] = st["y"]

            def a2a_back():
                dist.all_to_all_single(st["back"], st["y_recv"], st["send_splits"], st["recv_splits"])

            def wsum():
                un = torch.empty_like(st["back"])
                un[st["order"]] = st["back"]
                st["out"] = (un.view(T, k, h).float() * w[..., None]).sum(1).to(torch.bfloat16)

            # correctness
            torch.cuda.synchronize()
            barrier("data")
            counts()
            routing_tables()
            permute()
            a2a()
            group()
            experts()
            ungroup()
            a2a_back()
            wsum()
            torch.cuda.synchronize()
            want = x_used.float() * w.sum(-1, keepdim=True)
            err = mx(((st["out"].float() - want).abs() / (want.abs() + 1e-2)).max().item() if T else 0.0)
            correct = err <= 2e-2
            sel = T * k
            # eager, per phase
            dphases = [("counts", counts), ("permute", permute), ("a2a", a2a), ("group", group)]
            cphases = [("ungroup", ungroup), ("a2a", a2a_back), ("sum", wsum)]
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(dphases) + len(cphases) + 2)]
            per_rep = []
            for _ in range(a.reps + 1):
                torch.cuda.synchronize()
                barrier("eager")
                i = 0
                ev[i].record()
                for _, f in dphases:
                    f()
                    i += 1
                    ev[i].record()
                experts()
                i += 1
                ev[i].record()
                for _, f in cphases:
                    f()
                    i += 1
                    ev[i].record()
                ev[-1].synchronize()
                per_rep.append([ev[j].elapsed_time(ev[j + 1]) * 1e3 for j in range(len(ev) - 1)])
            per_rep = per_rep[1:]
            med = [statistics.median(r[j] for r in per_rep) for j in range(len(ev) - 1)]
            nd = len(dphases)
            disp_tot = statistics.median(sum(r[:nd]) for r in per_rep)
            comb_tot = statistics.median(sum(r[nd + 1:]) for r in per_rep)
            times = {("dispatch", "eager"): mx(disp_tot), ("combine", "eager"): mx(comb_tot)}
            phases = {"dispatch": {nm: mx(med[j]) for j, (nm, _) in enumerate(dphases)},
                      "combine": {nm: mx(med[nd + 1 + j]) for j, (nm, _) in enumerate(cphases)}}

            # graph-captured, the splits of this routing fixed
            def dispatch_fixed():
                permute()
                a2a()
                group()

            def combine_fixed():
                ungroup()
                a2a_back()
                wsum()

            captured = True
            for what, f in (("dispatch", dispatch_fixed), ("combine", combine_fixed)):
                try:
                    warm(f)
                    times[(what, "pipelined")] = mx(time_pipelined(f, a.graph_calls, a.iters, 1, barrier))
                    times[(what, "single")] = mx(time_single(f, a.reps, barrier, external))
                except RuntimeError as e:
                    captured = False
                    print(f"torch_moe_ref.py rank {rank}: capture of the {what} failed: {e}", file=sys.stderr)
                    torch.cuda.synchronize()
            if rank == 0:
                if not captured:
                    print(f"# {payload} {T} tokens: graph capture failed; eager timings only", flush=True)
                print("CHECK " + json.dumps({"bench": "moe", "impl": IMPL, "dtype": payload, "ranks": n, "tokens": T,
                                             "max_rel_err": err if math.isfinite(err) else None, "tolerance": 2e-2,
                                             "correct": correct}), flush=True)
                for (what, mode), t in sorted(times.items()):
                    nbytes = sel * (tok_bytes if what == "dispatch" else 2 * h)
                    bw = nbytes / (t * 1e-6) / 1e9 if t > 0 else 0.0
                    line = {"bench": f"moe_{what}", "impl": IMPL, "operand": "-",
                            "dtype": payload if what == "dispatch" else "bf16", "op": "-", "ranks": n,
                            "bytes": nbytes, "tokens": T, "hidden": h, "topk": k, "experts": E, "payload": payload,
                            "mode": mode, "time_us": round(t, 3), "algbw_gbs": round(bw, 3), "busbw_gbs": round(bw, 3),
                            "algorithm": "counts+permute+a2a+group" if what == "dispatch" and mode == "eager"
                            else "permute+a2a+group (fixed splits)" if what == "dispatch"
                            else "ungroup+a2a+sum", "correct": correct}
                    if mode == "eager":
                        line["phases_us"] = {p: round(v, 3) for p, v in phases[what].items()}
                    print("RESULT " + json.dumps(line), flush=True)
            summary.append((payload, T, times, phases, correct))
    if rank == 0:
        print(f"\n# {IMPL} MoE, {n} ranks, hidden {h}, top-{k}, {E} experts; µs (eager with phases | graph pipelined)")
        for payload, T, times, phases, ok in summary:
            d, c = phases["dispatch"], phases["combine"]
            print(f"{payload:>4} {T:>5} tok | dispatch {times[('dispatch', 'eager')]:9.2f} "
                  f"({' '.join(f'{p} {v:.1f}' for p, v in d.items())}) {times.get(('dispatch', 'pipelined'), math.nan):8.2f} | "
                  f"combine {times[('combine', 'eager')]:9.2f} ({' '.join(f'{p} {v:.1f}' for p, v in c.items())}) "
                  f"{times.get(('combine', 'pipelined'), math.nan):8.2f} | {'ok' if ok else 'WRONG'}")
        sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


def main():
    return spawn(run, args_parser().parse_args(), "torch_moe_ref.py", 29843)


if __name__ == "__main__":
    sys.exit(main())
