//! MoE dispatch / combine benchmark (`cargo xtask bench-hw moe` runs it beside
//! bench/scripts/torch_moe_ref.py): the DeepSeek-V3 shape (hidden 7168, top-8, 256 experts spread
//! evenly over the ranks) at 1, 8, 32, 128, 512 and 4096 tokens per rank, bf16 and FP8 payloads
//! (FP8: e4m3 rows with one f32 scale per group of 128, as DeepEP's FP8 dispatch carries them).
//!
//! **Our side today** is what `examples/moe.rs` does, through `RankHandle::all_to_all_v_dev`
//! (send counts in device memory, receive counts and offsets written there by the kernel), on
//! symmetric buffers:
//! - **dispatch**: one call; each token travels once per destination rank (not once per expert),
//!   its row = payload (+ FP8 scales) + its routing (k expert ids or −1 where the expert is not on
//!   that rank, k f32 weights), packed in destination order;
//! - **combine**: one call; every rank returns one bf16 row per received token (its experts'
//!   weighted partial sum) to the token's rank.
//!
//! Not in these times, because the library has no kernel for them yet (the MoE plan being built
//! beside this bench will have them): the permutation of a rank's tokens into destination order
//! (done once on the host here: the routing is fixed per shape), the grouping of received rows
//! by local expert, and the final sum of the ranks' partials on the token's rank. The combine's
//! send counts come from the host (the dispatch's receive counts are in other units). So our
//! numbers are the communication of dispatch and combine; the torch reference's are whole
//! dispatch / combine phases (its RESULT lines carry per-phase µs, `a2a` being the comparable
//! part). **When the MoE plan lands, switch [`Ours`]** (its `dispatch` / `combine`, and the same
//! two calls in `single_phase`, are the only calls timed) to the plan's dispatch / combine; the
//! routing, the checks and the timing stay.
//!
//! Every shape is first checked bit for bit: the rows each rank receives against the host's
//! packing, and the combine's returned rows likewise. Timed as bench-allreduce does:
//! **pipelined** (a graph of many calls per rank, replayed; rank 0's time per call, median of
//! `--runs`) and **single** (a thread per rank, one call captured into a graph, launched after a
//! spinning host barrier; the slowest rank, median). "Logical bandwidth" (DeepEP's low-latency
//! tests' convention): `bytes` = the (token, expert) selections × the bytes of one token's payload
//! (bf16: 2·hidden; FP8: hidden + 4·hidden/128; combine: 2·hidden); algbw = busbw = bytes / time.
//! One `RESULT {json}` line per measurement (`bench` = "moe_dispatch" | "moe_combine", with
//! `tokens`, `hidden`, `topk`, `experts`, `payload`, `wire_bytes` = what our call actually moves).
//! With fewer GPUs than `--ranks`, ranks share a GPU (said on the first line: not a link
//! benchmark). On the simulated driver the times mean nothing (`--hidden 256 --tokens 1,8` keeps
//! a simulated run short).

// Ranks index their buffers: `for r in 0..n` reads as the protocol does.
#![allow(clippy::needless_range_loop)]

use std::process::ExitCode;

use clap::Parser;
use cuda_multimem::{CaptureMode, DeviceBuffer, Stream};
use cuda_multimem_collectives::{
    bf16, next_random, CommConfig, Communicator, MulticastPolicy, SymmetricBuffer,
};
use serde_json::json;

mod common;

use common::{pipelined_by_graph, result_line, single_by_graph, sync, team_devices, RankCall, Res};

const GROUP: usize = 128;

/// MoE dispatch / combine benchmark.
#[derive(Parser, Debug)]
#[command(name = "bench-moe")]
struct Args {
    /// Ranks (the first N devices; with fewer devices, ranks share them).
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Tokens per rank (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,128,512,4096")]
    tokens: Vec<usize>,
    /// Hidden size (a multiple of 128).
    #[arg(long, default_value_t = 7168)]
    hidden: usize,
    /// Experts per token.
    #[arg(long, default_value_t = 8)]
    topk: usize,
    /// Experts (spread evenly over the ranks).
    #[arg(long, default_value_t = 256)]
    experts: usize,
    /// Payloads (comma-separated: bf16, fp8).
    #[arg(long, value_delimiter = ',', default_value = "bf16,fp8")]
    payload: Vec<String>,
    /// Timed repetitions (the median is reported).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Calls per graph (pipelined).
    #[arg(long, default_value_t = 20)]
    iters: usize,
}

/// One shape's routing on every rank, fixed: `picks[r][t]` = token t's experts and weights.
struct Routing {
    n: usize,
    tokens: usize,
    per: usize,
    picks: Vec<Vec<Vec<(usize, f32)>>>,
}

impl Routing {
    fn new(n: usize, tokens: usize, experts: usize, k: usize, seed: &mut u64) -> Routing {
        let picks = (0..n)
            .map(|_| {
                (0..tokens)
                    .map(|_| {
                        // k distinct experts: the top k of random logits, softmax weights
                        let logits: Vec<f32> = (0..experts).map(|_| next_random(seed)).collect();
                        let mut ids: Vec<usize> = (0..experts).collect();
                        ids.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
                        ids.truncate(k);
                        let m = logits[ids[0]];
                        let e: Vec<f32> = ids.iter().map(|&i| (logits[i] - m).exp()).collect();
                        let z: f32 = e.iter().sum();
                        ids.into_iter().zip(e).map(|(i, v)| (i, v / z)).collect()
                    })
                    .collect()
            })
            .collect();
        Routing {
            n,
            tokens,
            per: experts / n,
            picks,
        }
    }

    /// The tokens rank `r` sends to rank `d`, in order.
    fn sent(&self, r: usize, d: usize) -> Vec<usize> {
        (0..self.tokens)
            .filter(|&t| self.picks[r][t].iter().any(|(e, _)| e / self.per == d))
            .collect()
    }
}

/// Our dispatch and combine for one shape: the only calls the bench times. Today through
/// `all_to_all_v_dev`; the MoE plan's dispatch / combine replace these two methods' bodies
/// (and `new`'s buffers) when it lands.
struct Ours {
    /// u32 words of one dispatched row (payload, scales, routing), of one combined row (bf16).
    row_words: usize,
    /// Per rank: the packed rows to send, their counts per destination (u32 words).
    send: SymmetricBuffer<u32>,
    send_counts: Vec<DeviceBuffer<u64>>,
    /// Per rank: the received rows, their counts and offsets per source (written by the kernel).
    recv: SymmetricBuffer<u32>,
    recv_counts: Vec<DeviceBuffer<u64>>,
    recv_offsets: Vec<DeviceBuffer<u64>>,
    /// The combine: the replies (bf16 rows, one per received token), their counts, the rows back.
    reply: SymmetricBuffer<bf16>,
    reply_counts: Vec<DeviceBuffer<u64>>,
    back: SymmetricBuffer<bf16>,
    back_counts: Vec<DeviceBuffer<u64>>,
    back_offsets: Vec<DeviceBuffer<u64>>,
}

impl Ours {
    /// Rank `r`'s dispatch on `s`.
    fn dispatch(&mut self, comm: &Communicator, r: usize, s: &Stream) -> Res<()> {
        comm.rank(r)?.all_to_all_v_dev(
            self.send.slice(..)?,
            self.recv.slice_mut(..)?,
            &self.send_counts[r],
            &mut self.recv_counts[r],
            &mut self.recv_offsets[r],
            s,
        )?;
        Ok(())
    }

    /// Rank `r`'s combine on `s`.
    fn combine(&mut self, comm: &Communicator, r: usize, s: &Stream) -> Res<()> {
        comm.rank(r)?.all_to_all_v_dev(
            self.reply.slice(..)?,
            self.back.slice_mut(..)?,
            &self.reply_counts[r],
            &mut self.back_counts[r],
            &mut self.back_offsets[r],
            s,
        )?;
        Ok(())
    }
}

/// One rank's packed dispatch rows (destination order) as u32 words: payload (bf16 pairs, or
/// e4m3 bytes then f32 scales), then k expert ids (u32::MAX: not on that rank), k f32 weights.
fn pack(
    rt: &Routing,
    r: usize,
    h: usize,
    fp8: bool,
    seed: &mut u64,
) -> (Vec<u32>, Vec<u64>, usize) {
    let k = rt.picks[r].first().map_or(0, |p| p.len());
    let payload_words = if fp8 {
        (h + 4 * (h / GROUP)) / 4
    } else {
        h / 2
    };
    let row = payload_words + 2 * k;
    let mut words = Vec::new();
    let mut counts = vec![0u64; rt.n];
    // the token rows themselves (random bits, the same row to every destination)
    let tok: Vec<Vec<u32>> = (0..rt.tokens)
        .map(|_| {
            (0..payload_words)
                .map(|_| (next_random(seed).to_bits() ^ 0x9e37_79b9).rotate_left(7))
                .collect()
        })
        .collect();
    for d in 0..rt.n {
        let sent = rt.sent(r, d);
        counts[d] = (sent.len() * row) as u64;
        for t in sent {
            words.extend_from_slice(&tok[t]);
            for &(e, _) in &rt.picks[r][t] {
                words.push(if e / rt.per == d { e as u32 } else { u32::MAX });
            }
            for &(_, g) in &rt.picks[r][t] {
                words.push(g.to_bits());
            }
        }
    }
    (words, counts, row)
}

fn main() -> ExitCode {
    match run(&Args::parse()) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("bench-moe: a result differed from the host reference");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("bench-moe: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Res<bool> {
    let (h, k, experts) = (args.hidden, args.topk, args.experts);
    if h == 0 || h % GROUP != 0 || k == 0 || k > experts {
        return Err(format!(
            "--hidden {h} (a positive multiple of {GROUP}), --topk {k} (1 to --experts {experts})"
        )
        .into());
    }
    for p in &args.payload {
        if p != "bf16" && p != "fp8" {
            return Err(format!("--payload {p}: bf16 or fp8").into());
        }
    }
    cuda_multimem_collectives::sim::install();
    let driver = cuda_multimem_sim::driver_from_env()?;
    let (devices, shared) = team_devices(&driver, args.ranks, "bench-moe")?;
    let n = devices.len();
    if experts % n != 0 {
        return Err(format!("--experts {experts} do not spread evenly over {n} ranks").into());
    }
    let comm = Communicator::builder(&devices)
        .config(CommConfig::default())
        .multicast(MulticastPolicy::Never)
        .allow_shared_devices(shared)
        .build()?;
    let streams: Vec<Stream> = devices.iter().map(Stream::new).collect::<Result<_, _>>()?;
    let sim = driver.is_simulated();
    println!(
        "# MoE dispatch/combine through all_to_all_v_dev (symmetric buffers), hidden {h}, top-{k}, {experts} experts ({} per rank), {n} ranks on {} x {}{}, driver {}{}; median of {} runs",
        experts / n,
        driver.device_count(),
        devices[0].name()?,
        if shared { " (ranks SHARE GPUs)" } else { "" },
        driver.version(),
        if sim { " (SIMULATED: times mean nothing)" } else { "" },
        args.runs
    );
    println!("# not timed (no kernel yet; the MoE plan will have them): the permutation into destination order, the grouping by local expert, the final sum over ranks");
    println!(
        "{:>7} {:>6} {:>9} {:>11} {:>11} {:>12} {:>13}  {:<40} {:>7}",
        "payload",
        "tokens",
        "phase",
        "pipe(us)",
        "single(us)",
        "logical GB/s",
        "wire bytes",
        "form",
        "correct"
    );
    let mut all_ok = true;
    let mut seed = 0x5eed_e0e0_u64;
    for payload in &args.payload {
        let fp8 = payload == "fp8";
        let tok_bytes = if fp8 { h + 4 * (h / GROUP) } else { 2 * h };
        for &t in &args.tokens {
            let rt = Routing::new(n, t, experts, k, &mut seed);
            // the rows every rank sends, and what each receives (host reference)
            let packed: Vec<(Vec<u32>, Vec<u64>, usize)> =
                (0..n).map(|r| pack(&rt, r, h, fp8, &mut seed)).collect();
            let row = packed[0].2;
            let cap = n * t.max(1); // rows a rank may send or receive
            let dev = |r: usize| comm.device(r);
            let send = comm.alloc::<u32>(cap * row)?;
            let recv = comm.alloc::<u32>(cap * row)?;
            let reply = comm.alloc::<bf16>(cap * h)?;
            let back = comm.alloc::<bf16>(cap * h)?;
            let zeros = |r: usize| DeviceBuffer::<u64>::zeroed(dev(r)?, n);
            let mut ours = Ours {
                row_words: row,
                send,
                send_counts: (0..n)
                    .map(|r| DeviceBuffer::from_host(dev(r)?, &packed[r].1))
                    .collect::<Result<_, _>>()?,
                recv,
                recv_counts: (0..n).map(zeros).collect::<Result<_, _>>()?,
                recv_offsets: (0..n).map(zeros).collect::<Result<_, _>>()?,
                reply,
                reply_counts: Vec::new(),
                back,
                back_counts: (0..n).map(zeros).collect::<Result<_, _>>()?,
                back_offsets: (0..n).map(zeros).collect::<Result<_, _>>()?,
            };
            let mut replies = Vec::new();
            for r in 0..n {
                let mut w = packed[r].0.clone();
                w.resize(cap * row, 0);
                ours.send.write(r, 0, &w)?;
                // rank r returns one bf16 row per token it received from each source
                let c: Vec<u64> = (0..n).map(|s| (rt.sent(s, r).len() * h) as u64).collect();
                ours.reply_counts
                    .push(DeviceBuffer::from_host(dev(r)?, &c)?);
                let rows = c.iter().sum::<u64>() as usize;
                let mut rep: Vec<bf16> = (0..rows)
                    .map(|_| bf16::from_f32(next_random(&mut seed)))
                    .collect();
                rep.resize(cap * h, bf16::ZERO);
                ours.reply.write(r, 0, &rep)?;
                replies.push(rep);
            }
            // check: one dispatch and one combine, against the host's packing
            for r in 0..n {
                ours.dispatch(&comm, r, &streams[r])?;
                ours.combine(&comm, r, &streams[r])?;
            }
            sync(&streams)?;
            comm.check()?;
            let mut ok = true;
            for d in 0..n {
                // dispatch: from each source s in order, its rows for d
                let mut want: Vec<u32> = Vec::new();
                for s in 0..n {
                    let before: u64 = packed[s].1[..d].iter().sum();
                    let len = packed[s].1[d];
                    want.extend_from_slice(&packed[s].0[before as usize..(before + len) as usize]);
                }
                let mut got = vec![0u32; want.len()];
                ours.recv.read(d, 0, &mut got)?;
                ok &= got == want;
                // combine: from each rank q in order, q's replies for d's tokens
                let mut want_back: Vec<u16> = Vec::new();
                for q in 0..n {
                    let before: usize = (0..d).map(|s| rt.sent(s, q).len() * h).sum();
                    let len = rt.sent(d, q).len() * h;
                    want_back.extend(replies[q][before..before + len].iter().map(|v| v.to_bits()));
                }
                let mut got_back = vec![bf16::ZERO; want_back.len()];
                ours.back.read(d, 0, &mut got_back)?;
                ok &= got_back
                    .iter()
                    .map(|v| v.to_bits())
                    .eq(want_back.iter().copied());
            }
            all_ok &= ok;
            let iters = if sim { 2 } else { args.iters };
            let runs = if sim { 1 } else { args.runs };
            let selections = n * t * k; // every token has k experts: logical bytes of all ranks / n
            let selections_per_rank = selections / n;
            for phase in ["dispatch", "combine"] {
                let is_d = phase == "dispatch";
                let pipe =
                    pipelined_by_graph(&streams, (iters, runs), CaptureMode::Global, &mut |r| {
                        if is_d {
                            ours.dispatch(&comm, r, &streams[r])
                        } else {
                            ours.combine(&comm, r, &streams[r])
                        }
                    })?;
                comm.check()?;
                let single = single_phase(&comm, &streams, &mut ours, is_d, runs)?;
                comm.check()?;
                let logical = selections_per_rank * if is_d { tok_bytes } else { 2 * h };
                // what rank 0's call moves (its input)
                let wire: u64 = if is_d {
                    packed[0].1.iter().sum::<u64>() * 4
                } else {
                    (0..n).map(|s| rt.sent(s, 0).len() * h * 2).sum::<usize>() as u64
                };
                let form = comm
                    .all_to_all_choice(
                        if is_d { cap * row * 4 } else { cap * h * 2 },
                        if is_d { cap * row * 4 } else { cap * h * 2 },
                        true,
                        cuda_multimem_collectives::Operands::Symmetric,
                        false,
                    )?
                    .to_string();
                println!(
                    "{:>7} {:>6} {:>9} {:>11.2} {:>11.2} {:>12.2} {:>13}  {:<40} {:>7}",
                    payload,
                    t,
                    phase,
                    pipe * 1e6,
                    single * 1e6,
                    logical as f64 / pipe / 1e9,
                    wire,
                    form,
                    if ok { "yes" } else { "NO" }
                );
                for (mode, secs) in [("pipelined", pipe), ("single", single)] {
                    let bw = logical as f64 / secs / 1e9;
                    result_line(json!({
                        "bench": format!("moe_{phase}"),
                        "impl": "cuda-multimem",
                        "operand": "symmetric",
                        "dtype": if is_d { payload.as_str() } else { "bf16" },
                        "op": "-",
                        "ranks": n,
                        "bytes": logical.max(1),
                        "tokens": t,
                        "hidden": h,
                        "topk": k,
                        "experts": experts,
                        "payload": payload,
                        "mode": mode,
                        "time_us": secs * 1e6,
                        "algbw_gbs": bw,
                        "busbw_gbs": bw,
                        "wire_bytes": wire,
                        "row_bytes": if is_d { ours.row_words * 4 } else { 2 * h },
                        "algorithm": format!("all_to_all_v_dev: {form}"),
                        "shared_gpus": shared,
                        "correct": ok,
                    }))?;
                }
            }
        }
    }
    Ok(all_ok)
}

/// One dispatch or combine between host barriers, by the graph method of
/// [`common::single_by_graph`]: each rank's call runs on its own thread, so it is built from the
/// symmetric output's per-rank part (`parts_mut`) and the rank's own tables — the same calls as
/// [`Ours::dispatch`] / [`Ours::combine`] (switch both when the MoE plan lands).
fn single_phase(
    comm: &Communicator,
    streams: &[Stream],
    ours: &mut Ours,
    dispatch: bool,
    runs: usize,
) -> Res<f64> {
    let Ours {
        send,
        send_counts,
        recv,
        recv_counts,
        recv_offsets,
        reply,
        reply_counts,
        back,
        back_counts,
        back_offsets,
        ..
    } = ours;
    let calls: Vec<RankCall<'_>> = if dispatch {
        let send = &*send;
        recv.parts_mut()
            .into_iter()
            .zip(send_counts.iter())
            .zip(recv_counts.iter_mut().zip(recv_offsets.iter_mut()))
            .map(|((mut p, sc), (rc, ro))| -> RankCall<'_> {
                let r = p.rank();
                let f = move |s: &Stream| -> Res<()> {
                    comm.rank(r)?.all_to_all_v_dev(
                        send.slice(..)?,
                        p.slice_mut(..)?,
                        sc,
                        rc,
                        ro,
                        s,
                    )?;
                    Ok(())
                };
                (r, Box::new(f))
            })
            .collect()
    } else {
        let reply = &*reply;
        back.parts_mut()
            .into_iter()
            .zip(reply_counts.iter())
            .zip(back_counts.iter_mut().zip(back_offsets.iter_mut()))
            .map(|((mut p, sc), (rc, ro))| -> RankCall<'_> {
                let r = p.rank();
                let f = move |s: &Stream| -> Res<()> {
                    comm.rank(r)?.all_to_all_v_dev(
                        reply.slice(..)?,
                        p.slice_mut(..)?,
                        sc,
                        rc,
                        ro,
                        s,
                    )?;
                    Ok(())
                };
                (r, Box::new(f))
            })
            .collect()
    };
    single_by_graph(streams, runs, calls)
}
