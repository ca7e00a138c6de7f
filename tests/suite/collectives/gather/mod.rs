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

mod copy_engine;
mod correctness;
mod protocol;

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
