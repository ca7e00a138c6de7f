//! Reduce-scatter, all-gather and broadcast: results equal the host references for every type
//! and operator, in place and out of place, on symmetric buffers (aligned and at odd offsets)
//! and on the caller's own memory; calls of every collective interleaved with allreduce, back
//! to back with random per-device delays, on teams of 2 to 8 with staging slots small enough
//! for many rounds; graph replays; ranks that disagree (size, collective, root) and a peer that
//! never calls are reported, and bad arguments are refused before any launch.

use std::time::Duration;

use cuda_multimem::{CaptureMode, DeviceBuffer, Error, Stream};
use cuda_multimem_collectives::{
    all_gather_reference, bf16, broadcast_reference, f16, random_input, reduce_scatter_reference,
    reference, Algorithm, Choice, CommConfig, Communicator, Dst, Element, MulticastPolicy,
    ReduceOp, Src, SymmetricBuffer,
};
use cuda_multimem_sim::SimConfig;
use cuda_multimem_tests::{env, sim, sim_delayed, skip, zeroed_per_rank, Env};

/// What a case calls.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    ReduceScatter(ReduceOp),
    AllGather,
    Broadcast(usize),
    AllReduce(ReduceOp),
}

/// Where its operands live.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Mem {
    /// Whole symmetric buffers (16-byte aligned).
    Sym,
    /// Views of symmetric buffers from element 1 (not 16-byte aligned).
    SymOdd,
    /// The caller's own memory (`DeviceBuffer`).
    Own,
}

trait Elem: Element + Default + Copy + Send + Sync + 'static {}
impl<T: Element + Default + Copy + Send + Sync + 'static> Elem for T {}

/// Lengths of (input, output) per rank.
fn lengths(kind: Kind, n: usize, count: usize) -> (usize, usize) {
    match kind {
        Kind::ReduceScatter(_) => (n * count, count),
        Kind::AllGather => (count, n * count),
        Kind::Broadcast(_) | Kind::AllReduce(_) => (count, count),
    }
}

/// A queued case: its buffers (kept alive until checked) and what every rank must hold.
struct Pending<T: Elem> {
    what: String,
    choice: Choice,
    /// Per rank: the output as it must read, after the call.
    want: Vec<Vec<T>>,
    sym_in: Option<SymmetricBuffer<T>>,
    sym_out: Option<SymmetricBuffer<T>>,
    own_in: Vec<DeviceBuffer<T>>,
    own_out: Vec<DeviceBuffer<T>>,
    /// Where the checked range starts in the symmetric output (elements).
    at: usize,
}

trait Check {
    fn check(&self);
}

impl<T: Elem> Check for Pending<T> {
    fn check(&self) {
        for (r, want) in self.want.iter().enumerate() {
            let got = match &self.sym_out {
                Some(b) => {
                    let v = b.to_vec(r).unwrap();
                    v[self.at..self.at + want.len()].to_vec()
                }
                None => self.own_out[r].to_vec().unwrap(),
            };
            if let Some(i) = (0..want.len()).find(|&i| got[i] != want[i]) {
                panic!(
                    "{} ({}): rank {r}, element {i} of {}: got {:?}, want {:?}",
                    self.what,
                    self.choice,
                    want.len(),
                    got[i],
                    want[i]
                );
            }
        }
    }
}

/// Call `kind` on rank `r` with the given operands.
fn call<T: Elem>(
    comm: &Communicator,
    r: usize,
    kind: Kind,
    input: Option<Src<'_, T>>,
    output: Dst<'_, T>,
    s: &Stream,
) -> cuda_multimem::Result<Choice> {
    let h = comm.rank(r)?;
    match (kind, input) {
        (Kind::ReduceScatter(op), Some(i)) => h.reduce_scatter(i, output, op, s),
        (Kind::ReduceScatter(op), None) => h.reduce_scatter_in_place(output, op, s),
        (Kind::AllGather, Some(i)) => h.all_gather(i, output, s),
        (Kind::AllGather, None) => h.all_gather_in_place(output, s),
        (Kind::Broadcast(root), Some(i)) => h.broadcast(i, output, root, s),
        (Kind::Broadcast(root), None) => h.broadcast_in_place(output, root, s),
        (Kind::AllReduce(op), Some(i)) => h.all_reduce(i, output, op, s),
        (Kind::AllReduce(op), None) => h.all_reduce_in_place(output, op, s),
    }
}

/// Queue `kind` of `count` elements per chunk on every rank (random inputs), operands in `mem`.
fn queue<T: Elem>(
    comm: &Communicator,
    s: &[Stream],
    kind: Kind,
    count: usize,
    mem: Mem,
    in_place: bool,
    seed: &mut u64,
) -> Pending<T> {
    let n = comm.size();
    let (il, ol) = lengths(kind, n, count);
    let inputs: Vec<Vec<T>> = (0..n).map(|_| random_input(il, seed)).collect();
    // what the in-place buffer holds before the call, where the input is not the whole of it
    let filler: Vec<Vec<T>> = (0..n).map(|_| random_input(ol, seed)).collect();
    let refs: Vec<&[T]> = inputs.iter().map(|v| v.as_slice()).collect();
    let mut want: Vec<Vec<T>> = match kind {
        Kind::ReduceScatter(op) => reduce_scatter_reference(op, &refs),
        Kind::AllGather => vec![all_gather_reference(&refs); n],
        Kind::Broadcast(root) => vec![broadcast_reference(&refs, root); n],
        Kind::AllReduce(op) => vec![reference(op, &refs); n],
    };
    // in place: the buffer's initial contents per rank (the in-place form's input placement)
    let initial = |r: usize| -> Vec<T> {
        match kind {
            Kind::AllGather => {
                let mut b = filler[r].clone();
                b[r * count..(r + 1) * count].copy_from_slice(&inputs[r]);
                b
            }
            _ => inputs[r].clone(),
        }
    };
    if in_place {
        if let Kind::ReduceScatter(_) = kind {
            // the result lands in chunk r; the other chunks keep the input
            for (r, w) in want.iter_mut().enumerate() {
                let mut b = inputs[r].clone();
                b[r * count..(r + 1) * count].copy_from_slice(w);
                *w = b;
            }
        }
    }
    let what = format!(
        "{kind:?} of {count} x {:?} on {n} ranks, {mem:?}{}",
        T::DTYPE,
        if in_place { ", in place" } else { "" }
    );
    let mut p = Pending {
        what,
        choice: Choice {
            path: cuda_multimem_collectives::Path::PeerToPeer,
            algorithm: Algorithm::PushStaged,
            blocks: 0,
            threads: 0,
            staged_chunks: 0,
        },
        want,
        sym_in: None,
        sym_out: None,
        own_in: Vec::new(),
        own_out: Vec::new(),
        at: 0,
    };
    let at = usize::from(mem == Mem::SymOdd);
    match (mem, in_place) {
        (Mem::Sym | Mem::SymOdd, true) => {
            let len = il.max(ol);
            let mut buf = comm.alloc::<T>(len + at).unwrap();
            for r in 0..n {
                buf.write(r, at, &initial(r)).unwrap();
            }
            for (r, st) in s.iter().enumerate() {
                let v = buf.slice_mut(at..at + len).unwrap();
                p.choice = call(comm, r, kind, None, v.into(), st).unwrap();
            }
            p.sym_out = Some(buf);
        }
        (Mem::Sym | Mem::SymOdd, false) => {
            let ib = comm.alloc::<T>(il + at).unwrap();
            let mut ob = comm.alloc::<T>(ol + at).unwrap();
            for (r, x) in inputs.iter().enumerate() {
                ib.write(r, at, x).unwrap();
            }
            for (r, st) in s.iter().enumerate() {
                let i = ib.slice(at..at + il).unwrap();
                let o = ob.slice_mut(at..at + ol).unwrap();
                p.choice = call(comm, r, kind, Some(i.into()), o.into(), st).unwrap();
            }
            p.sym_in = Some(ib);
            p.sym_out = Some(ob);
        }
        (Mem::Own, true) => {
            for (r, st) in s.iter().enumerate() {
                let mut b = DeviceBuffer::from_host(comm.device(r).unwrap(), &initial(r)).unwrap();
                p.choice = call(comm, r, kind, None, (&mut b).into(), st).unwrap();
                p.own_out.push(b);
            }
        }
        (Mem::Own, false) => {
            for (r, st) in s.iter().enumerate() {
                let d = comm.device(r).unwrap();
                let i = DeviceBuffer::from_host(d, &inputs[r]).unwrap();
                let mut o = DeviceBuffer::<T>::zeroed(d, ol).unwrap();
                p.choice = call(comm, r, kind, Some((&i).into()), (&mut o).into(), st).unwrap();
                p.own_in.push(i);
                p.own_out.push(o);
            }
        }
    }
    p.at = at;
    p
}

fn streams(comm: &Communicator) -> Vec<Stream> {
    (0..comm.size())
        .map(|r| Stream::new(comm.device(r).unwrap()).unwrap())
        .collect()
}

fn sync(s: &[Stream]) {
    for st in s {
        st.synchronize().unwrap();
    }
}

/// Queue, wait, check.
#[allow(clippy::too_many_arguments)]
fn once<T: Elem>(
    comm: &Communicator,
    s: &[Stream],
    kind: Kind,
    count: usize,
    mem: Mem,
    in_place: bool,
    seed: &mut u64,
) -> Choice {
    let p = queue::<T>(comm, s, kind, count, mem, in_place, seed);
    sync(s);
    comm.check().unwrap_or_else(|e| panic!("{}: {e}", p.what));
    p.check();
    p.choice
}

/// A team of the first two devices of the chosen driver (real GPUs or the simulator).
fn team(e: &Env, config: CommConfig) -> Option<Communicator> {
    let devices = e.driver.devices();
    if devices.len() < 2 {
        skip(
            "gather",
            format!("needs 2 devices, the machine has {}", devices.len()),
        );
        return None;
    }
    Some(
        Communicator::builder(&devices[..2])
            .config(config)
            .multicast(MulticastPolicy::Never)
            .build()
            .unwrap(),
    )
}

/// Every case of `kinds` at `sizes`, every type, every operand kind, in place and not; each
/// must run `expect`.
fn sweep(comm: &Communicator, kinds: &[Kind], sizes: &[usize], expect: Algorithm) {
    let s = streams(comm);
    let mut seed = 0x9e37_79b9_7f4a_7c15;
    for &kind in kinds {
        for &count in sizes {
            for mem in [Mem::Sym, Mem::SymOdd, Mem::Own] {
                for in_place in [false, true] {
                    let c = [
                        once::<f32>(comm, &s, kind, count, mem, in_place, &mut seed),
                        once::<f16>(comm, &s, kind, count, mem, in_place, &mut seed),
                        once::<bf16>(comm, &s, kind, count, mem, in_place, &mut seed),
                    ];
                    for c in c {
                        assert_eq!(c.algorithm, expect, "{kind:?} of {count}, {mem:?}");
                    }
                }
            }
        }
    }
}

/// No low-latency forms: every small call runs the staged kernel.
fn staged_only() -> CommConfig {
    CommConfig {
        gather_ll_max_bytes: 0,
        broadcast_ll_max_bytes: 0,
        ..Default::default()
    }
}

/// The same sweep with the low-latency forms (the default at these sizes: at most 32 KiB of
/// whole buffer; odd counts and 2-byte aligned 16-bit operands included) and without them.
fn sweep_both(kinds: &[Kind]) {
    let e = env();
    for (config, expect) in [
        (CommConfig::default(), Algorithm::PushLl),
        (staged_only(), Algorithm::PushStaged),
    ] {
        let Some(comm) = team(&e, config) else {
            return;
        };
        sweep(&comm, kinds, &[1, 7, 1000, 4099], expect);
    }
}

#[test]
fn reduce_scatter_equals_the_host_reference_for_every_dtype_op_and_operand_kind() {
    sweep_both(&ReduceOp::ALL.map(Kind::ReduceScatter));
}

#[test]
fn all_gather_equals_the_host_reference_for_every_dtype_and_operand_kind() {
    sweep_both(&[Kind::AllGather]);
}

#[test]
fn broadcast_from_every_root_equals_the_host_reference_for_every_dtype_and_operand_kind() {
    sweep_both(&[Kind::Broadcast(0), Kind::Broadcast(1)]);
}

/// The direct path (symmetric outputs above the one-shot limit, lowered here) and many staged
/// rounds (slots of 4 KiB shared by the blocks), on both drivers.
#[test]
fn direct_stores_and_staged_rounds_equal_the_host_reference() {
    let e = env();
    let config = CommConfig {
        one_shot_max_bytes: Some(4096),
        stage_bytes: Some(4096),
        max_blocks: 4,
        gather_ll_max_bytes: 0,
        broadcast_ll_max_bytes: 0,
        ..Default::default()
    };
    let Some(comm) = team(&e, config) else {
        return;
    };
    let s = streams(&comm);
    let mut seed = 11;
    for kind in [
        Kind::AllGather,
        Kind::Broadcast(1),
        Kind::ReduceScatter(ReduceOp::Sum),
    ] {
        for mem in [Mem::Sym, Mem::SymOdd, Mem::Own] {
            for in_place in [false, true] {
                let c = once::<bf16>(&comm, &s, kind, 20_000, mem, in_place, &mut seed);
                let direct = mem != Mem::Own && kind != Kind::ReduceScatter(ReduceOp::Sum);
                assert_eq!(
                    c.algorithm,
                    if direct {
                        Algorithm::PushDirect
                    } else {
                        Algorithm::PushStaged
                    },
                    "{kind:?} {mem:?}"
                );
                once::<f32>(&comm, &s, kind, 3001, mem, in_place, &mut seed);
            }
        }
    }
}

#[test]
fn small_messages_run_one_low_latency_launch_with_few_threads() {
    let e = env();
    // low-latency up to 64 KiB of whole buffer (one word per thread), else staged (16-byte
    // units, at least 64 threads)
    for (config, alg, threads) in [
        (CommConfig::default(), Algorithm::PushLl, 128),
        (staged_only(), Algorithm::PushStaged, 64),
    ] {
        let Some(comm) = team(&e, config) else {
            return;
        };
        let s = streams(&comm);
        let mut seed = 3;
        for kind in [
            Kind::ReduceScatter(ReduceOp::Sum),
            Kind::AllGather,
            Kind::Broadcast(0),
        ] {
            // 1 KiB gathered / scattered: 256 f32 in all, 128 per rank
            for mem in [Mem::Sym, Mem::Own] {
                let count = if kind == Kind::Broadcast(0) { 256 } else { 128 };
                let c = once::<f32>(&comm, &s, kind, count, mem, false, &mut seed);
                let t = if kind == Kind::Broadcast(0) && alg == Algorithm::PushLl {
                    256
                } else {
                    threads
                };
                assert_eq!(c.algorithm, alg, "{kind:?} {mem:?}");
                assert_eq!((c.blocks, c.threads, c.staged_chunks), (1, t, 0));
            }
        }
    }
}

/// The low-latency forms take whole buffers (reduce-scatter's input, all-gather's output) up to
/// `gather_ll_max_bytes` and broadcast messages up to `broadcast_ll_max_bytes` (a smaller
/// limit here, so a broadcast just above it is still within the other), whatever the operands'
/// alignment; one element more runs the staged kernel.
#[test]
fn the_low_latency_forms_take_whole_buffers_up_to_gather_ll_max_bytes() {
    let e = env();
    let Some(comm) = team(
        &e,
        CommConfig {
            gather_ll_max_bytes: 8192,
            broadcast_ll_max_bytes: 4096,
            ..Default::default()
        },
    ) else {
        return;
    };
    let s = streams(&comm);
    let mut seed = 21;
    for kind in [
        Kind::ReduceScatter(ReduceOp::Max),
        Kind::AllGather,
        Kind::Broadcast(1),
    ] {
        // whole buffer of 8192 bytes: 4096 bf16, 2048 per rank; broadcast, its own limit:
        // 4096 bytes, 2048 bf16 (one more is within the others' limit, not within its own)
        let at = 2048;
        for mem in [Mem::Sym, Mem::SymOdd, Mem::Own] {
            for in_place in [false, true] {
                let c = once::<bf16>(&comm, &s, kind, at, mem, in_place, &mut seed);
                assert_eq!(
                    c.algorithm,
                    Algorithm::PushLl,
                    "{kind:?} {mem:?} at the limit"
                );
                let c = once::<bf16>(&comm, &s, kind, at + 1, mem, in_place, &mut seed);
                assert_eq!(c.algorithm, Algorithm::PushStaged, "{kind:?} {mem:?} above");
            }
        }
    }
}

/// A simulated team of `n` with random delays (up to 300 µs, from `seed`) before every launch
/// and phase: low-latency up to 2 KiB (allreduce and the others), direct above 4 KiB, slots of
/// 4 KiB shared by 3 blocks: multi-round staged calls.
fn delayed_team(n: usize, seed: u64) -> (Env, Communicator) {
    delayed_team_ce(n, seed, usize::MAX)
}

/// [`delayed_team`] whose reduce-scatters and all-gathers of at least `ce_min` bytes go through
/// the copy engines where their operands allow.
fn delayed_team_ce(n: usize, seed: u64, ce_min: usize) -> (Env, Communicator) {
    let e = sim_delayed(SimConfig::new(n, 13000), Duration::from_micros(300), seed);
    let devices = e.driver.devices();
    let comm = Communicator::builder(&devices)
        .config(CommConfig {
            ll_max_bytes: 2048,
            gather_ll_max_bytes: 2048,
            broadcast_ll_max_bytes: 2048,
            one_shot_max_bytes: Some(4096),
            stage_bytes: Some(4096),
            max_blocks: 3,
            timeout: Duration::from_secs(20),
            gather_ce_min_bytes: ce_min,
            broadcast_ce_min_bytes: ce_min,
            ..Default::default()
        })
        .multicast(MulticastPolicy::Never)
        .build()
        .unwrap();
    (e, comm)
}

/// Queue `calls` calls of every collective and allreduce, of random kinds, sizes (`counts`),
/// types and operand kinds on `comm`, then wait and check them all against the host
/// references: what each call ran, in order.
fn back_to_back(comm: &Communicator, seed: u64, calls: usize, counts: &[usize]) -> Vec<Algorithm> {
    let n = comm.size();
    let s = streams(comm);
    let mut state = seed * 7919;
    let mut rnd = |m: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % m
    };
    let mut pending: Vec<Box<dyn Check>> = Vec::new();
    let mut ran = Vec::new();
    let mut data = seed + 100;
    for _ in 0..calls {
        let op = ReduceOp::ALL[rnd(3) as usize];
        let kind = match rnd(4) {
            0 => Kind::ReduceScatter(op),
            1 => Kind::AllGather,
            2 => Kind::Broadcast(rnd(n as u64) as usize),
            _ => Kind::AllReduce(op),
        };
        let count = counts[rnd(counts.len() as u64) as usize];
        let mem = [Mem::Sym, Mem::SymOdd, Mem::Own][rnd(3) as usize];
        let in_place = rnd(2) == 0;
        let (p, a): (Box<dyn Check>, Algorithm) = match rnd(3) {
            0 => {
                let p = queue::<f32>(comm, &s, kind, count, mem, in_place, &mut data);
                let a = p.choice.algorithm;
                (Box::new(p), a)
            }
            1 => {
                let p = queue::<f16>(comm, &s, kind, count, mem, in_place, &mut data);
                let a = p.choice.algorithm;
                (Box::new(p), a)
            }
            _ => {
                let p = queue::<bf16>(comm, &s, kind, count, mem, in_place, &mut data);
                let a = p.choice.algorithm;
                (Box::new(p), a)
            }
        };
        pending.push(p);
        ran.push(a);
    }
    sync(&s);
    comm.check().unwrap();
    for p in &pending {
        p.check();
    }
    ran
}

/// Back-to-back calls of every collective, interleaved with allreduce, of random sizes, types
/// and operand kinds, with random per-device delays, checked only once all have run: the
/// counters, slot parities and header parities of one call must not disturb the next.
#[test]
fn back_to_back_collectives_interleaved_with_allreduce_stay_correct_on_teams_of_2_to_8() {
    for (n, seed) in [(2usize, 1u64), (3, 2), (5, 3), (8, 4)] {
        let (_e, comm) = delayed_team(n, seed);
        back_to_back(&comm, seed, 16, &[1, 5, 64, 333, 1500, 2048]);
    }
}

/// The copy-engine all-gather and broadcast at every size (their thresholds 0, no low-latency
/// forms; 4 KiB staging slots for the calls that keep their kernels: many rounds).
fn ce_config() -> CommConfig {
    CommConfig {
        gather_ce_min_bytes: 0,
        broadcast_ce_min_bytes: 0,
        gather_ll_max_bytes: 0,
        broadcast_ll_max_bytes: 0,
        stage_bytes: Some(4096),
        max_blocks: 4,
        ..Default::default()
    }
}

/// All-gather and broadcast through the copy engines equal the host references for every type,
/// in place and out of place, at any offset of the symmetric output; into the caller's own
/// memory they, and reduce-scatter, keep their kernels, also correct; an empty all-gather
/// queues nothing. Both drivers.
#[test]
fn copy_engine_all_gather_and_broadcast_equal_the_host_reference_for_every_dtype_and_operand_kind()
{
    let e = env();
    let Some(comm) = team(&e, ce_config()) else {
        return;
    };
    let s = streams(&comm);
    // an empty all-gather queues nothing, even with the threshold at 0 bytes: rank 0 alone
    // calls it, and no barrier waits for rank 1
    let mut empty = comm.alloc::<f32>(4).unwrap();
    let c = comm
        .rank(0)
        .unwrap()
        .all_gather_in_place(empty.slice_mut(0..0).unwrap(), &s[0])
        .unwrap();
    assert_ne!(c.algorithm, Algorithm::CopyEngine);
    sync(&s);
    comm.check().unwrap();
    let mut seed = 23;
    let mut kinds = ReduceOp::ALL.map(Kind::ReduceScatter).to_vec();
    kinds.extend([Kind::AllGather, Kind::Broadcast(1)]);
    for kind in kinds {
        for count in [3, 1000, 20_000] {
            for mem in [Mem::Sym, Mem::SymOdd, Mem::Own] {
                for in_place in [false, true] {
                    for c in [
                        once::<f32>(&comm, &s, kind, count, mem, in_place, &mut seed),
                        once::<f16>(&comm, &s, kind, count, mem, in_place, &mut seed),
                        once::<bf16>(&comm, &s, kind, count, mem, in_place, &mut seed),
                    ] {
                        let ce =
                            matches!(kind, Kind::AllGather | Kind::Broadcast(_)) && mem != Mem::Own;
                        assert_eq!(
                            c.algorithm == Algorithm::CopyEngine,
                            ce,
                            "{kind:?} of {count}, {mem:?}, in place {in_place}: {c}"
                        );
                    }
                }
            }
        }
    }
}

/// The copy engines take an all-gather or a broadcast from `gather_ce_min_bytes` /
/// `broadcast_ce_min_bytes` of whole buffer, in place or not (one rule, so ranks that differ in
/// that choose alike); below, the kernels.
#[test]
fn copy_engine_forms_start_at_their_threshold_in_place_or_not() {
    let e = env();
    let Some(comm) = team(
        &e,
        CommConfig {
            gather_ce_min_bytes: 64 << 10,
            broadcast_ce_min_bytes: 64 << 10,
            ..ce_config()
        },
    ) else {
        return;
    };
    let s = streams(&comm);
    let mut seed = 5;
    // f32: an all-gather of 2 x 8191 x 4 bytes is just under 64 KiB, of 2 x 8192 x 4 64 KiB;
    // a broadcast of 16383 or 16384
    for (kind, count, ce) in [
        (Kind::AllGather, 8191, false),
        (Kind::AllGather, 8192, true),
        (Kind::Broadcast(1), 16_383, false),
        (Kind::Broadcast(1), 16_384, true),
    ] {
        for in_place in [false, true] {
            let c = once::<f32>(&comm, &s, kind, count, Mem::Sym, in_place, &mut seed);
            assert_eq!(
                c.algorithm == Algorithm::CopyEngine,
                ce,
                "{kind:?} of {count}, in place {in_place}: {c}"
            );
        }
    }
    // rank 0 in place, rank 1 out of place: the same form, correct results
    let count = 8192;
    let input = comm.alloc::<f32>(count).unwrap();
    let mut output = comm.alloc::<f32>(2 * count).unwrap();
    let ins: Vec<Vec<f32>> = (0..2).map(|_| random_input(count, &mut seed)).collect();
    output.write(0, 0, &ins[0]).unwrap();
    input.write(1, 0, &ins[1]).unwrap();
    let c0 = comm
        .rank(0)
        .unwrap()
        .all_gather_in_place(&mut output, &s[0])
        .unwrap();
    let c1 = comm
        .rank(1)
        .unwrap()
        .all_gather(&input, &mut output, &s[1])
        .unwrap();
    assert_eq!(
        (c0.algorithm, c1.algorithm),
        (Algorithm::CopyEngine, Algorithm::CopyEngine)
    );
    sync(&s);
    comm.check().unwrap();
    let refs: Vec<&[f32]> = ins.iter().map(|v| v.as_slice()).collect();
    for r in 0..2 {
        assert_eq!(
            output.to_vec(r).unwrap(),
            all_gather_reference(&refs),
            "rank {r}"
        );
    }
}

/// Copy-engine all-gathers back to back with every kernel form (low-latency, staged, direct,
/// the allreduce), random sizes, types and operand kinds, random per-device delays, checked
/// once all have run, on teams of 2 to 8: the copies of one call (on the caller's stream and
/// the rank's second one) must not run into the previous call's or the next one's work.
#[test]
fn copy_engine_calls_back_to_back_with_the_kernel_forms_stay_correct_on_teams_of_2_to_8() {
    for (n, seed) in [(2usize, 11u64), (3, 12), (5, 13), (8, 14)] {
        let (_e, comm) = delayed_team_ce(n, seed, 8192);
        let ran = back_to_back(&comm, seed, 48, &[64, 1500, 3000, 6000]);
        let ce = ran.iter().filter(|&&a| a == Algorithm::CopyEngine).count();
        assert!(ce >= 2, "team of {n}: only {ce} copy-engine calls");
    }
}

/// The gathered output is complete in the caller's stream order when the call returns to it:
/// a copy of it queued next on the same stream sees every rank's chunk, though the peers'
/// copies into it start late (random delays before every simulated copy and launch). Without
/// the final barrier the snapshot misses chunks.
#[test]
fn a_copy_engine_all_gather_is_complete_for_the_next_work_on_the_stream() {
    for (n, seed) in [(2usize, 21u64), (3, 22), (5, 23)] {
        let (_e, comm) = delayed_team_ce(n, seed, 0);
        let s = streams(&comm);
        let count = 3000;
        let mut data = seed;
        let input = comm.alloc::<f32>(count).unwrap();
        let mut output = comm.alloc::<f32>(n * count).unwrap();
        for round in 0..4 {
            let ins: Vec<Vec<f32>> = (0..n).map(|_| random_input(count, &mut data)).collect();
            for (r, x) in ins.iter().enumerate() {
                input.write(r, 0, x).unwrap();
            }
            let mut snaps = Vec::new();
            for (r, st) in s.iter().enumerate() {
                let c = comm
                    .rank(r)
                    .unwrap()
                    .all_gather(&input, &mut output, st)
                    .unwrap();
                assert_eq!(c.algorithm, Algorithm::CopyEngine);
                let snap = DeviceBuffer::<f32>::zeroed(comm.device(r).unwrap(), n * count).unwrap();
                // SAFETY: both ranges are n * count f32 of this rank's device memory (its part
                // of the symmetric output, the snapshot), queued on a live stream of it.
                unsafe {
                    st.as_stream_ref()
                        .copy_dtod_async(
                            snap.device_ptr(),
                            output.device_ptr(r).unwrap(),
                            n * count * 4,
                        )
                        .unwrap()
                };
                snaps.push(snap);
            }
            sync(&s);
            comm.check().unwrap();
            let refs: Vec<&[f32]> = ins.iter().map(|v| v.as_slice()).collect();
            let want = all_gather_reference(&refs);
            for (r, snap) in snaps.iter().enumerate() {
                assert_eq!(
                    snap.to_vec().unwrap(),
                    want,
                    "team of {n}, round {round}, rank {r}"
                );
            }
        }
    }
}

/// Copy-engine all-gathers and a broadcast captured in a graph (out of place: the fork onto the rank's second
/// stream and the join inside the capture) replay correctly with new inputs, between staged
/// reduce-scatters.
#[test]
fn captured_copy_engine_calls_replay_with_new_inputs() {
    let e = sim(SimConfig::new(3, 13000));
    let comm = Communicator::builder(&e.driver.devices())
        .config(ce_config())
        .multicast(MulticastPolicy::Never)
        .build()
        .unwrap();
    captured_copy_engine_calls(&comm);
}

/// The same on the chosen driver's first two devices (real GPUs under `test-hw`).
#[test]
fn captured_copy_engine_calls_replay_with_new_inputs_on_two_devices() {
    let e = env();
    if let Some(comm) = team(&e, ce_config()) {
        captured_copy_engine_calls(&comm);
    }
}

fn captured_copy_engine_calls(comm: &Communicator) {
    let n = comm.size();
    let s = streams(comm);
    let count = 5000;
    let rs_in = comm.alloc::<f32>(n * count).unwrap();
    let mut rs_out = comm.alloc::<f32>(count).unwrap();
    let mut ag_out = comm.alloc::<bf16>(n * count).unwrap();
    let mut ag_in_place = comm.alloc::<f32>(n * count).unwrap();
    let mut bc = comm.alloc::<f16>(count).unwrap();
    let mut ag_ins: Vec<DeviceBuffer<bf16>> = zeroed_per_rank(comm, count);
    let mut execs = Vec::new();
    for (r, st) in s.iter().enumerate() {
        let h = comm.rank(r).unwrap();
        let sr = st.as_stream_ref();
        sr.begin_capture(CaptureMode::Relaxed).unwrap();
        let c = h
            .reduce_scatter(&rs_in, &mut rs_out, ReduceOp::Sum, st)
            .unwrap();
        assert_eq!(c.algorithm, Algorithm::PushStaged);
        for c in [
            h.all_gather(&ag_ins[r], &mut ag_out, st).unwrap(),
            h.all_gather_in_place(&mut ag_in_place, st).unwrap(),
            h.broadcast_in_place(&mut bc, 1, st).unwrap(),
        ] {
            assert_eq!(c.algorithm, Algorithm::CopyEngine);
        }
        // SAFETY: the team, buffers and streams the capture used outlive `execs` (dropped first).
        execs.push(unsafe { sr.end_capture().unwrap().instantiate() }.unwrap());
    }
    let mut seed = 91;
    for replay in 0..3 {
        let ins: Vec<Vec<f32>> = (0..n).map(|_| random_input(n * count, &mut seed)).collect();
        let ags: Vec<Vec<bf16>> = (0..n).map(|_| random_input(count, &mut seed)).collect();
        let aps: Vec<Vec<f32>> = (0..n).map(|_| random_input(count, &mut seed)).collect();
        let bcs: Vec<Vec<f16>> = (0..n).map(|_| random_input(count, &mut seed)).collect();
        for r in 0..n {
            bc.write(r, 0, &bcs[r]).unwrap();
            rs_in.write(r, 0, &ins[r]).unwrap();
            ag_ins[r].copy_from_host(0, &ags[r]).unwrap();
            ag_in_place.write(r, r * count, &aps[r]).unwrap();
        }
        for (x, st) in execs.iter().zip(&s) {
            x.launch(st).unwrap();
        }
        sync(&s);
        comm.check().unwrap();
        let refs: Vec<&[f32]> = ins.iter().map(|v| v.as_slice()).collect();
        let agr: Vec<&[bf16]> = ags.iter().map(|v| v.as_slice()).collect();
        let apr: Vec<&[f32]> = aps.iter().map(|v| v.as_slice()).collect();
        for (r, want) in reduce_scatter_reference(ReduceOp::Sum, &refs)
            .iter()
            .enumerate()
        {
            assert_eq!(&rs_out.to_vec(r).unwrap(), want, "replay {replay} rank {r}");
            assert_eq!(ag_out.to_vec(r).unwrap(), all_gather_reference(&agr));
            assert_eq!(ag_in_place.to_vec(r).unwrap(), all_gather_reference(&apr));
            assert_eq!(bc.to_vec(r).unwrap(), bcs[1], "replay {replay} rank {r}");
        }
    }
}

/// A copy-engine call whose peer calls something else (another size; another broadcast root;
/// the staged kernel, its output being its own memory) is reported by `check()` as a
/// disagreement (a peer that never calls: `a_peer_that_never_calls_is_reported_as_a_timeout`).
#[test]
fn copy_engine_calls_whose_peer_calls_something_else_are_reported() {
    let team_of = |n: usize| cuda_multimem_tests::sim_team(n, ce_config());
    // sizes 2000 / 4000 per rank
    {
        let (_e, comm, s) = team_of(2);
        let input = comm.alloc::<f32>(4000).unwrap();
        let mut output = comm.alloc::<f32>(8000).unwrap();
        for (r, count) in [(0usize, 2000usize), (1, 4000)] {
            let c = comm
                .rank(r)
                .unwrap()
                .all_gather(
                    input.slice(..count).unwrap(),
                    output.slice_mut(..2 * count).unwrap(),
                    &s[r],
                )
                .unwrap();
            assert_eq!(c.algorithm, Algorithm::CopyEngine);
        }
        expect_reported_disagreement(&comm, &s, "all-gather sizes 2000 / 4000");
    }
    // broadcasts through the copy engines from roots 0 / 1
    {
        let (_e, comm, s) = team_of(2);
        let mut buf = comm.alloc::<f32>(8000).unwrap();
        for (r, root) in [(0usize, 0usize), (1, 1)] {
            let c = comm
                .rank(r)
                .unwrap()
                .broadcast_in_place(&mut buf, root, &s[r])
                .unwrap();
            assert_eq!(c.algorithm, Algorithm::CopyEngine);
        }
        expect_reported_disagreement(&comm, &s, "broadcast roots 0 / 1");
    }
    // rank 0's all-gather through the copy engines, rank 1's staged (own output)
    {
        let (_e, comm, s) = team_of(2);
        let input = comm.alloc::<f32>(4000).unwrap();
        let mut output = comm.alloc::<f32>(8000).unwrap();
        let mut own = DeviceBuffer::<f32>::zeroed(comm.device(1).unwrap(), 8000).unwrap();
        let c0 = comm
            .rank(0)
            .unwrap()
            .all_gather(&input, &mut output, &s[0])
            .unwrap();
        let c1 = comm
            .rank(1)
            .unwrap()
            .all_gather(&input, &mut own, &s[1])
            .unwrap();
        assert_eq!(c0.algorithm, Algorithm::CopyEngine);
        assert_eq!(c1.algorithm, Algorithm::PushStaged);
        expect_reported_disagreement(&comm, &s, "copy engines / staged");
    }
}

/// Wait for the team's calls, then expect `check()` to report ranks that disagree.
fn expect_reported_disagreement(comm: &Communicator, s: &[Stream], what: &str) {
    sync(s);
    match comm.check() {
        Err(Error::RanksDisagree { .. }) => {}
        other => panic!("{what}: got {other:?}"),
    }
}

/// A staged reduce-scatter or all-gather of several rounds, then at once a one-shot allreduce
/// (it pushes into the staging before its first barrier), on teams of 2 and 3 with random
/// delays before every phase B: a peer still reading my last round's sub-slot must not find
/// the allreduce's data there. The ring's sub-slots map onto the staging parities so that a
/// call's first parity is never the one of the previous call's last round; the mapping that
/// puts two consecutive rounds into one parity fails here.
#[test]
fn a_one_shot_allreduce_right_after_a_staged_call_leaves_its_last_round_alone() {
    for (n, seed) in [(2usize, 5u64), (3, 6)] {
        let (_e, comm) = delayed_team(n, seed);
        let s = streams(&comm);
        let mut data = seed + 200;
        let mut pending: Vec<Box<dyn Check>> = Vec::new();
        for i in 0..24 {
            let kind = if i % 2 == 0 {
                Kind::ReduceScatter(ReduceOp::Sum)
            } else {
                Kind::AllGather
            };
            let count = [1500, 1100, 900][i % 3];
            let p = queue::<f32>(&comm, &s, kind, count, Mem::Own, false, &mut data);
            assert_eq!(p.choice.algorithm, Algorithm::PushStaged);
            pending.push(Box::new(p));
            let p = queue::<f32>(
                &comm,
                &s,
                Kind::AllReduce(ReduceOp::Sum),
                700,
                Mem::Sym,
                false,
                &mut data,
            );
            assert_eq!(p.choice.algorithm, Algorithm::OneShot);
            pending.push(Box::new(p));
        }
        sync(&s);
        comm.check().unwrap();
        for p in &pending {
            p.check();
        }
    }
}

/// Low-latency broadcasts from one root, back to back: the root hears nothing from the
/// others in a broadcast, yet it must not overwrite a slot a slow receiver still polls two
/// calls later. The non-roots' presence words (every rank hears from every peer in every call)
/// hold it back; without them a receiver finds a newer call's flags and times out, or a rank
/// reads data of another call. Teams of 2, 3 and 5 with random delays; interleaved all-gathers
/// change nothing of the rule.
#[test]
fn back_to_back_low_latency_broadcasts_from_one_root_wait_for_every_receiver() {
    for (n, seed) in [(2usize, 5u64), (3, 6), (5, 7)] {
        let e = sim(SimConfig::new(n, 13000));
        let devices = e.driver.devices();
        let comm = Communicator::builder(&devices)
            .config(CommConfig {
                timeout: Duration::from_secs(5),
                ..Default::default()
            })
            .multicast(MulticastPolicy::Never)
            .build()
            .unwrap();
        let s = streams(&comm);
        let mut data = seed;
        // every buffer allocated and written first: nothing between the calls synchronises
        let calls = 40;
        let count = |i: usize| 40 + i;
        let mut ins = Vec::new();
        let mut outs = Vec::new();
        let mut want = Vec::new();
        for i in 0..calls {
            let ag = i % 8 == 7;
            let (il, ol) = if ag {
                (count(i), n * count(i))
            } else {
                (count(i), count(i))
            };
            let b_in = comm.alloc::<f32>(il).unwrap();
            let x: Vec<Vec<f32>> = (0..n).map(|_| random_input(il, &mut data)).collect();
            for (r, x) in x.iter().enumerate() {
                b_in.write(r, 0, x).unwrap();
            }
            let refs: Vec<&[f32]> = x.iter().map(|v| v.as_slice()).collect();
            want.push(if ag {
                all_gather_reference(&refs)
            } else {
                broadcast_reference(&refs, 0)
            });
            ins.push(b_in);
            outs.push(comm.alloc::<f32>(ol).unwrap());
        }
        e.sim
            .as_ref()
            .unwrap()
            .set_kernel_delays(Duration::from_micros(400), seed);
        for (i, (b_in, b_out)) in ins.iter().zip(outs.iter_mut()).enumerate() {
            for (r, st) in s.iter().enumerate() {
                let h = comm.rank(r).unwrap();
                let c = if i % 8 == 7 {
                    h.all_gather(b_in, &mut *b_out, st).unwrap()
                } else {
                    h.broadcast(b_in, &mut *b_out, 0, st).unwrap()
                };
                assert_eq!(c.algorithm, Algorithm::PushLl);
            }
        }
        sync(&s);
        comm.check().unwrap_or_else(|e| panic!("{n} ranks: {e}"));
        for (i, (b, w)) in outs.iter().zip(&want).enumerate() {
            for r in 0..n {
                assert_eq!(&b.to_vec(r).unwrap(), w, "{n} ranks, call {i}, rank {r}");
            }
        }
    }
}

/// A captured sequence (reduce-scatter, all-gather, broadcast, staged and direct) replays
/// correctly with new inputs each time: nothing is reset from the host.
#[test]
fn captured_collectives_replay_with_new_inputs() {
    let e = sim(SimConfig::new(3, 13000));
    let devices = e.driver.devices();
    let n = 3;
    let comm = Communicator::builder(&devices)
        .config(CommConfig {
            ll_max_bytes: 1024,
            gather_ll_max_bytes: 1024,
            broadcast_ll_max_bytes: 1024,
            one_shot_max_bytes: Some(4096),
            stage_bytes: Some(4096),
            max_blocks: 2,
            ..Default::default()
        })
        .multicast(MulticastPolicy::Never)
        .build()
        .unwrap();
    let s = streams(&comm);
    let count = 700;
    // low-latency: 3 x 80 f32 scattered, 3 x 64 gathered, 200 broadcast (at most 1 KiB)
    let rs_ll_in = comm.alloc::<f32>(n * 80).unwrap();
    let mut rs_ll_out = comm.alloc::<f32>(80).unwrap();
    let mut ag_ll = comm.alloc::<f32>(n * 64).unwrap();
    let mut bc_ll = comm.alloc::<f32>(200).unwrap();
    let rs_in = comm.alloc::<f32>(n * count).unwrap();
    let mut rs_out = comm.alloc::<f32>(count).unwrap();
    let ag_in = comm.alloc::<f32>(count).unwrap();
    let mut ag_out = comm.alloc::<f32>(n * count).unwrap();
    let mut ag_small = comm.alloc::<f32>(n * 100).unwrap();
    let mut bc = comm.alloc::<f32>(count).unwrap();
    let mut execs = Vec::new();
    for (r, st) in s.iter().enumerate() {
        let h = comm.rank(r).unwrap();
        let sr = st.as_stream_ref();
        sr.begin_capture(CaptureMode::Relaxed).unwrap();
        h.reduce_scatter(&rs_in, &mut rs_out, ReduceOp::Max, st)
            .unwrap();
        let c = h.all_gather(&ag_in, &mut ag_out, st).unwrap();
        assert_eq!(c.algorithm, Algorithm::PushDirect);
        let c = h.all_gather_in_place(&mut ag_small, st).unwrap();
        assert_eq!(c.algorithm, Algorithm::PushStaged);
        h.broadcast_in_place(&mut bc, 2, st).unwrap();
        for c in [
            h.reduce_scatter(&rs_ll_in, &mut rs_ll_out, ReduceOp::Sum, st)
                .unwrap(),
            h.all_gather_in_place(&mut ag_ll, st).unwrap(),
            h.broadcast_in_place(&mut bc_ll, 1, st).unwrap(),
        ] {
            assert_eq!(c.algorithm, Algorithm::PushLl);
        }
        // SAFETY: the team, buffers and streams the capture used outlive `execs` (dropped first).
        execs.push(unsafe { sr.end_capture().unwrap().instantiate() }.unwrap());
    }
    let mut seed = 77;
    for replay in 0..3 {
        let ins: Vec<Vec<f32>> = (0..n).map(|_| random_input(n * count, &mut seed)).collect();
        let ags: Vec<Vec<f32>> = (0..n).map(|_| random_input(count, &mut seed)).collect();
        let smalls: Vec<Vec<f32>> = (0..n).map(|_| random_input(100, &mut seed)).collect();
        let bcs: Vec<Vec<f32>> = (0..n).map(|_| random_input(count, &mut seed)).collect();
        let rs_lls: Vec<Vec<f32>> = (0..n).map(|_| random_input(n * 80, &mut seed)).collect();
        let ag_lls: Vec<Vec<f32>> = (0..n).map(|_| random_input(64, &mut seed)).collect();
        let bc_lls: Vec<Vec<f32>> = (0..n).map(|_| random_input(200, &mut seed)).collect();
        for r in 0..n {
            rs_in.write(r, 0, &ins[r]).unwrap();
            ag_in.write(r, 0, &ags[r]).unwrap();
            ag_small.write(r, r * 100, &smalls[r]).unwrap();
            bc.write(r, 0, &bcs[r]).unwrap();
            rs_ll_in.write(r, 0, &rs_lls[r]).unwrap();
            ag_ll.write(r, r * 64, &ag_lls[r]).unwrap();
            bc_ll.write(r, 0, &bc_lls[r]).unwrap();
        }
        for (x, st) in execs.iter().zip(&s) {
            x.launch(st).unwrap();
        }
        sync(&s);
        comm.check().unwrap();
        let refs: Vec<&[f32]> = ins.iter().map(|v| v.as_slice()).collect();
        let rs = reduce_scatter_reference(ReduceOp::Max, &refs);
        let agr: Vec<&[f32]> = ags.iter().map(|v| v.as_slice()).collect();
        let smr: Vec<&[f32]> = smalls.iter().map(|v| v.as_slice()).collect();
        for (r, want) in rs.iter().enumerate() {
            assert_eq!(&rs_out.to_vec(r).unwrap(), want, "replay {replay} rank {r}");
            assert_eq!(ag_out.to_vec(r).unwrap(), all_gather_reference(&agr));
            assert_eq!(ag_small.to_vec(r).unwrap(), all_gather_reference(&smr));
            assert_eq!(bc.to_vec(r).unwrap(), bcs[2], "replay {replay} rank {r}");
        }
        let rsl: Vec<&[f32]> = rs_lls.iter().map(|v| v.as_slice()).collect();
        let agl: Vec<&[f32]> = ag_lls.iter().map(|v| v.as_slice()).collect();
        for (r, want) in reduce_scatter_reference(ReduceOp::Sum, &rsl)
            .iter()
            .enumerate()
        {
            assert_eq!(
                &rs_ll_out.to_vec(r).unwrap(),
                want,
                "replay {replay} rank {r}"
            );
            assert_eq!(ag_ll.to_vec(r).unwrap(), all_gather_reference(&agl));
            assert_eq!(
                bc_ll.to_vec(r).unwrap(),
                bc_lls[1],
                "replay {replay} rank {r}"
            );
        }
    }
}

/// A simulated team of `n` with a 300 ms timeout, with or without the low-latency forms.
fn small_team(n: usize, ll: bool) -> (Env, Communicator, Vec<Stream>) {
    cuda_multimem_tests::sim_team(
        n,
        CommConfig {
            gather_ll_max_bytes: if ll { 64 << 10 } else { 0 },
            broadcast_ll_max_bytes: if ll { 64 << 10 } else { 0 },
            ..Default::default()
        },
    )
}

/// Rank 0 and rank 1 call different things; `check()` must say the ranks disagree (the
/// staged kernel compares call headers at its barrier), or, with the low-latency forms (flags
/// in the data, no header exchange), that a peer did not arrive.
fn expect_disagreement(
    what: &str,
    ll: bool,
    a: impl Fn(&Communicator, &Stream, &mut SymmetricBuffer<f32>),
    b: impl Fn(&Communicator, &Stream, &mut SymmetricBuffer<f32>),
) {
    let (_e, comm, s) = small_team(2, ll);
    let mut buf = comm.alloc::<f32>(30_000).unwrap();
    a(&comm, &s[0], &mut buf);
    b(&comm, &s[1], &mut buf);
    sync(&s);
    match (ll, comm.check()) {
        (false, Err(Error::RanksDisagree { .. })) | (true, Err(Error::Timeout { .. })) => {}
        (_, other) => panic!("{what} (low-latency: {ll}): got {other:?}"),
    }
}

fn rank_of(c: &Communicator, s: &Stream) -> usize {
    c.local_ranks()
        .into_iter()
        .find(|&r| c.device(r).unwrap() == s.device())
        .unwrap()
}

#[test]
fn ranks_that_disagree_on_size_collective_or_root_are_reported_by_check() {
    disagreements(false);
}

/// The same disagreements on the low-latency forms: the flags fold the call header (size,
/// collective, root, operator), so nobody takes a disagreeing peer's words; the polls time out.
#[test]
fn ranks_that_disagree_on_a_low_latency_call_time_out() {
    disagreements(true);
    // a low-latency all-gather against a low-latency allreduce of the same bytes
    expect_disagreement(
        "all-gather / low-latency allreduce",
        true,
        |c, s, b| {
            c.rank(rank_of(c, s))
                .unwrap()
                .all_gather_in_place(b.slice_mut(..256).unwrap(), s)
                .unwrap();
        },
        |c, s, b| {
            let ch = c
                .rank(rank_of(c, s))
                .unwrap()
                .all_reduce_in_place(b.slice_mut(..256).unwrap(), ReduceOp::Sum, s)
                .unwrap();
            assert_eq!(ch.algorithm, Algorithm::OneShotLl);
        },
    );
}

fn disagreements(ll: bool) {
    let ag = |count: usize| {
        move |c: &Communicator, s: &Stream, b: &mut SymmetricBuffer<f32>| {
            c.rank(rank_of(c, s))
                .unwrap()
                .all_gather_in_place(b.slice_mut(..2 * count).unwrap(), s)
                .unwrap();
        }
    };
    expect_disagreement("all-gather sizes 64 / 128", ll, ag(64), ag(128));
    expect_disagreement(
        "reduce-scatter / all-gather",
        ll,
        |c, s, b| {
            c.rank(rank_of(c, s))
                .unwrap()
                .reduce_scatter_in_place(b.slice_mut(..256).unwrap(), ReduceOp::Sum, s)
                .unwrap();
        },
        ag(128),
    );
    expect_disagreement(
        "broadcast roots 0 / 1",
        ll,
        |c, s, b| {
            c.rank(rank_of(c, s))
                .unwrap()
                .broadcast_in_place(b.slice_mut(..256).unwrap(), 0, s)
                .unwrap();
        },
        |c, s, b| {
            c.rank(rank_of(c, s))
                .unwrap()
                .broadcast_in_place(b.slice_mut(..256).unwrap(), 1, s)
                .unwrap();
        },
    );
    expect_disagreement(
        "reduce-scatter sum / max",
        ll,
        |c, s, b| {
            c.rank(rank_of(c, s))
                .unwrap()
                .reduce_scatter_in_place(b.slice_mut(..256).unwrap(), ReduceOp::Sum, s)
                .unwrap();
        },
        |c, s, b| {
            c.rank(rank_of(c, s))
                .unwrap()
                .reduce_scatter_in_place(b.slice_mut(..256).unwrap(), ReduceOp::Max, s)
                .unwrap();
        },
    );
    // an allreduce above the low-latency limit (the low-latency protocol has no barrier and no
    // header: a peer that calls something else only makes it time out)
    expect_disagreement("all-gather / allreduce", ll, ag(128), |c, s, b| {
        c.rank(rank_of(c, s))
            .unwrap()
            .all_reduce_in_place(b.slice_mut(..30_000).unwrap(), ReduceOp::Sum, s)
            .unwrap();
    });
}

/// Dropping the buffers and the communicator while their calls are still queued (an error path
/// that returns before synchronising) must not unmap memory under the running kernels and
/// copies: the streams finish without an error and a new team on the same devices computes
/// correctly (on a GPU a kernel touching unmapped memory poisons the context for good).
#[test]
fn dropping_buffers_and_the_team_with_calls_in_flight_leaves_the_devices_healthy() {
    let e = env();
    let big = if e.driver.is_simulated() {
        1 << 14
    } else {
        8 << 20
    };
    {
        let Some(comm) = team(&e, CommConfig::default()) else {
            return;
        };
        let s = streams(&comm);
        let mut seed = 77;
        let mut pending = Vec::new();
        for kind in [
            Kind::AllGather,
            Kind::ReduceScatter(ReduceOp::Sum),
            Kind::Broadcast(1),
            Kind::AllReduce(ReduceOp::Sum),
        ] {
            for mem in [Mem::Sym, Mem::Own] {
                pending.push(queue::<bf16>(&comm, &s, kind, big, mem, false, &mut seed));
            }
        }
        drop(pending);
        drop(comm);
        for st in &s {
            st.synchronize()
                .expect("the queued calls ran to the end on mapped memory");
        }
    }
    let Some(comm) = team(&e, CommConfig::default()) else {
        return;
    };
    let s = streams(&comm);
    let mut seed = 78;
    once::<f32>(&comm, &s, Kind::AllGather, 4096, Mem::Sym, false, &mut seed);
    once::<bf16>(
        &comm,
        &s,
        Kind::ReduceScatter(ReduceOp::Sum),
        1 << 20,
        Mem::Sym,
        false,
        &mut seed,
    );
}

#[test]
fn a_peer_that_never_calls_is_reported_as_a_timeout() {
    let ll = |on: bool| CommConfig {
        gather_ll_max_bytes: if on { 64 << 10 } else { 0 },
        broadcast_ll_max_bytes: if on { 64 << 10 } else { 0 },
        ..Default::default()
    };
    let mut cases = Vec::new();
    for kind in [
        Kind::ReduceScatter(ReduceOp::Sum),
        Kind::AllGather,
        Kind::Broadcast(0),
        Kind::Broadcast(2),
    ] {
        cases.push((kind, ll(true), Algorithm::PushLl));
        cases.push((kind, ll(false), Algorithm::PushStaged));
    }
    // the copy-engine forms: their barrier launches time out (the missing rank as a
    // broadcast's root, too)
    for kind in [Kind::AllGather, Kind::Broadcast(0), Kind::Broadcast(2)] {
        cases.push((kind, ce_config(), Algorithm::CopyEngine));
    }
    for (kind, config, want) in cases {
        let (_e, comm, s) = cuda_multimem_tests::sim_team(3, config);
        let (il, ol) = lengths(kind, 3, 100);
        let input = comm.alloc::<f32>(il).unwrap();
        let mut output = comm.alloc::<f32>(ol).unwrap();
        // ranks 0 and 1 call; rank 2 never does (as the root of a broadcast, too)
        for (r, st) in s.iter().enumerate().take(2) {
            let c = call(
                &comm,
                r,
                kind,
                Some((&input).into()),
                (&mut output).into(),
                st,
            )
            .unwrap();
            assert_eq!(c.algorithm, want, "{kind:?}");
        }
        sync(&s);
        match comm.check() {
            Err(Error::Timeout { after, .. }) => {
                assert_eq!(after, Duration::from_millis(300), "{kind:?}")
            }
            other => panic!("{kind:?} ({want}): expected a timeout, got {other:?}"),
        }
    }
}

fn arg_of(r: cuda_multimem::Result<Choice>) -> &'static str {
    match r {
        Err(Error::InvalidArgument { arg, .. }) => arg,
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

#[test]
fn bad_lengths_roots_and_overlaps_are_refused_before_any_launch() {
    let (_e, comm, s) = small_team(2, true);
    let h = comm.rank(0).unwrap();
    let st = &s[0];
    let a = comm.alloc::<f32>(1000).unwrap();
    let mut b = comm.alloc::<f32>(1000).unwrap();
    // reduce-scatter: the input holds N chunks of the output's length
    assert_eq!(
        arg_of(h.reduce_scatter(
            a.slice(..300).unwrap(),
            b.slice_mut(..100).unwrap(),
            ReduceOp::Sum,
            st
        )),
        "input"
    );
    // all-gather: the output holds N chunks of the input's length
    assert_eq!(
        arg_of(h.all_gather(a.slice(..100).unwrap(), b.slice_mut(..300).unwrap(), st)),
        "output"
    );
    // broadcast: equal lengths, a root of the team
    assert_eq!(
        arg_of(h.broadcast(a.slice(..100).unwrap(), b.slice_mut(..99).unwrap(), 0, st)),
        "output"
    );
    assert_eq!(
        arg_of(h.broadcast(a.slice(..100).unwrap(), b.slice_mut(..100).unwrap(), 2, st)),
        "root"
    );
    assert_eq!(arg_of(h.broadcast_in_place(&mut b, 9, st)), "root");
    // in place: a whole number of chunks
    assert_eq!(
        arg_of(h.all_gather_in_place(b.slice_mut(..101).unwrap(), st)),
        "buf"
    );
    assert_eq!(
        arg_of(h.reduce_scatter_in_place(b.slice_mut(..101).unwrap(), ReduceOp::Min, st)),
        "buf"
    );
    // overlaps other than the in-place forms: the caller's own memory, shifted by one element
    let d = comm.device(0).unwrap();
    let mut own = DeviceBuffer::<f32>::zeroed(d, 1000).unwrap();
    let p = own.device_ptr();
    // SAFETY: ranges inside `own`; refused before any launch.
    let (i, o) = unsafe {
        (
            Src::<f32>::from_raw(p, 100),
            Dst::<f32>::from_raw(p + 4, 200),
        )
    };
    assert_eq!(arg_of(h.all_gather(i, o, st)), "output");
    let (i, o) = unsafe {
        (
            Src::<f32>::from_raw(p, 200),
            Dst::<f32>::from_raw(p + 4, 100),
        )
    };
    assert_eq!(arg_of(h.reduce_scatter(i, o, ReduceOp::Sum, st)), "output");
    // lengths whose byte size overflows
    let (i, o) = unsafe {
        (
            Src::<f32>::from_raw(p, usize::MAX / 2),
            Dst::<f32>::from_raw(p, 100),
        )
    };
    assert_eq!(arg_of(h.broadcast(i, o, 0, st)), "input");
    let (i, o) = unsafe {
        (
            Src::<f32>::from_raw(p, usize::MAX / 8),
            Dst::<f32>::from_raw(p, usize::MAX / 8 + 1),
        )
    };
    assert_eq!(arg_of(h.all_gather(i, o, st)), "output");
    let _ = &mut own;
    // nothing was launched: a correct call on both ranks still works
    let mut seed = 5;
    once::<f32>(&comm, &s, Kind::AllGather, 10, Mem::Sym, false, &mut seed);
}
