//! The multimem path on the simulator (real GPUs here must never create multicast objects):
//! what a rank whose barrier failed may and may not do to its peers, and what the path promises
//! about the order of a sum; and the multimem reduce-scatter, all-gather and broadcast.
//!
//! Real GPUs here must never create multicast objects: every test builds its own simulator.

// Ranks index their streams and buffers: `for r in 0..n` reads as the protocol does.
#![allow(clippy::needless_range_loop)]

use std::time::Duration;

use cuda_multimem::{CaptureMode, DeviceBuffer, Error, Stream};
use cuda_multimem_collectives::{
    all_gather_reference, bf16, broadcast_reference, f16, random_input, reduce_scatter_reference,
    reference, Algorithm, Choice, CommConfig, Communicator, DType, Dst, Element, MulticastPolicy,
    Path, ReduceOp, Src, SymmetricBuffer,
};
use cuda_multimem_sim::SimConfig;
use cuda_multimem_tests::{sim, sim_delayed, skip, zeroed_per_rank, Env};

use super::*;

mod allreduce;
mod gather;

// ---- reduce-scatter, all-gather and broadcast on the multimem path (simulator only) ----

/// Whether the suite runs on a real driver, in which case `test` prints its skip line: these
/// tests build multicast teams, which the GPUs this project uses must never create (`cargo
/// xtask test` runs them on the simulator at every driver version).
fn skipped_on_real_driver(test: &str) -> bool {
    let sel = std::env::var(cuda_multimem::DRIVER_ENV).unwrap_or_default();
    let real = !sel.is_empty() && !sel.starts_with("sim");
    if real {
        skip(
            test,
            format!(
                "{}={sel} selects a real driver; multimem tests build multicast teams and run on the simulator only",
                cuda_multimem::DRIVER_ENV
            ),
        );
    }
    real
}

/// A simulated machine of `n` devices for one multimem test, or a printed skip where the suite
/// runs on a real driver ([`skipped_on_real_driver`]).
fn mm_sim(test: &str, n: usize) -> Option<Env> {
    if skipped_on_real_driver(test) {
        return None;
    }
    Some(sim(SimConfig::new(n, 13000)))
}

/// A multimem communicator over every device of `e` (policy `Always`) with `config`.
fn mm_comm(e: &Env, config: CommConfig) -> Communicator {
    let comm = Communicator::builder(&e.driver.devices())
        .multicast(MulticastPolicy::Always)
        .config(config)
        .build()
        .unwrap();
    assert!(
        comm.multimem_active(),
        "{:?}",
        comm.multimem_unavailable_reason()
    );
    comm
}

fn mm_streams(comm: &Communicator) -> Vec<Stream> {
    (0..comm.size())
        .map(|r| Stream::new(comm.device(r).unwrap()).unwrap())
        .collect()
}

fn mm_sync(s: &[Stream]) {
    for st in s {
        st.synchronize().unwrap();
    }
}

/// What a case calls.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Rs(ReduceOp),
    Ag,
    Bc(usize),
    /// Allreduce, to interleave with the others.
    Ar(ReduceOp),
}

/// Where its operands live.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Mem {
    /// Whole symmetric buffers.
    Sym,
    /// Views of symmetric buffers from element 1 (not 16-byte aligned).
    SymOdd,
    /// The caller's own memory (`DeviceBuffer`).
    Own,
}

trait Elem: Element + Default + Copy + Send + Sync + 'static {}
impl<T: Element + Default + Copy + Send + Sync + 'static> Elem for T {}

/// The path a case must take: reduce-scatter where `multimem.ld_reduce` has the type and
/// operator (f32 only adds), the others always.
fn want_path(kind: Kind, dtype: DType) -> Path {
    match kind {
        Kind::Rs(op) | Kind::Ar(op) if !cuda_multimem_collectives::multimem_supports(dtype, op) => {
            Path::PeerToPeer
        }
        _ => Path::Multimem,
    }
}

/// A queued case: its buffers (alive until checked), what every rank must hold, and per
/// element the tolerance of a sum reduced in the switch's order (0: the bits must match).
struct Pending<T: Elem> {
    what: String,
    choices: Vec<Choice>,
    want: Vec<Vec<T>>,
    tol: Vec<Vec<f32>>,
    sym: Vec<SymmetricBuffer<T>>,
    own_in: Vec<DeviceBuffer<T>>,
    own_out: Vec<DeviceBuffer<T>>,
    at: usize,
}

impl<T: Elem> Pending<T> {
    fn check(&self) {
        for (r, want) in self.want.iter().enumerate() {
            let got = match self.own_out.get(r) {
                Some(b) => b.to_vec().unwrap(),
                None => {
                    let v = self.sym.last().unwrap().to_vec(r).unwrap();
                    v[self.at..self.at + want.len()].to_vec()
                }
            };
            let bad = (0..want.len()).find(|&i| {
                let (g, w) = (got[i].to_f32(), want[i].to_f32());
                match self.tol[r][i] {
                    0.0 => g.to_bits() != w.to_bits(),
                    t => (g - w).abs() > t,
                }
            });
            if let Some(i) = bad {
                panic!(
                    "{} ({}): rank {r}, element {i} of {}: got {:?}, want {:?} (tolerance {})",
                    self.what,
                    self.choices[r],
                    want.len(),
                    got[i],
                    want[i],
                    self.tol[r][i]
                );
            }
        }
    }
}

fn mm_call<T: Elem>(
    comm: &Communicator,
    r: usize,
    kind: Kind,
    input: Option<Src<'_, T>>,
    output: Dst<'_, T>,
    s: &Stream,
) -> cuda_multimem::Result<Choice> {
    let h = comm.rank(r)?;
    match (kind, input) {
        (Kind::Rs(op), Some(i)) => h.reduce_scatter(i, output, op, s),
        (Kind::Rs(op), None) => h.reduce_scatter_in_place(output, op, s),
        (Kind::Ag, Some(i)) => h.all_gather(i, output, s),
        (Kind::Ag, None) => h.all_gather_in_place(output, s),
        (Kind::Bc(root), Some(i)) => h.broadcast(i, output, root, s),
        (Kind::Bc(root), None) => h.broadcast_in_place(output, root, s),
        (Kind::Ar(op), Some(i)) => h.all_reduce(i, output, op, s),
        (Kind::Ar(op), None) => h.all_reduce_in_place(output, op, s),
    }
}

/// Queue `kind` of `count` elements per chunk on every rank (random inputs), operands in `mem`;
/// every rank's call must report `want_path`.
fn mm_queue<T: Elem>(
    comm: &Communicator,
    s: &[Stream],
    kind: Kind,
    count: usize,
    mem: Mem,
    in_place: bool,
    seed: &mut u64,
) -> Pending<T> {
    let n = comm.size();
    let (il, ol) = match kind {
        Kind::Rs(_) => (n * count, count),
        Kind::Ag => (count, n * count),
        Kind::Bc(_) | Kind::Ar(_) => (count, count),
    };
    let inputs: Vec<Vec<T>> = (0..n).map(|_| random_input(il, seed)).collect();
    let filler: Vec<Vec<T>> = (0..n).map(|_| random_input(ol, seed)).collect();
    let refs: Vec<&[T]> = inputs.iter().map(|v| v.as_slice()).collect();
    let mut want: Vec<Vec<T>> = match kind {
        Kind::Rs(op) => reduce_scatter_reference(op, &refs),
        Kind::Ag => vec![all_gather_reference(&refs); n],
        Kind::Bc(root) => vec![broadcast_reference(&refs, root); n],
        Kind::Ar(op) => vec![reference(op, &refs); n],
    };
    // sums: within the rounding of n additions of the inputs' magnitudes (the allreduce
    // multimem tests' tolerance), everything else bit for bit
    let eps = match T::DTYPE {
        DType::F32 => f32::EPSILON,
        DType::F16 => 1.0 / 1024.0,
        DType::Bf16 => 1.0 / 128.0,
    };
    let mut tol: Vec<Vec<f32>> = (0..n)
        .map(|r| {
            (0..count)
                .map(|i| {
                    // where rank r's element i comes from in every input
                    let at = match kind {
                        Kind::Rs(_) => r * count + i,
                        _ => i,
                    };
                    match kind {
                        Kind::Rs(ReduceOp::Sum) | Kind::Ar(ReduceOp::Sum) => {
                            let mag: f32 = inputs.iter().map(|x| x[at].to_f32().abs()).sum();
                            eps * mag.max(1.0) * n as f32
                        }
                        _ => 0.0,
                    }
                })
                .collect()
        })
        .collect();
    let initial = |r: usize| -> Vec<T> {
        match kind {
            Kind::Ag => {
                let mut b = filler[r].clone();
                b[r * count..(r + 1) * count].copy_from_slice(&inputs[r]);
                b
            }
            _ => inputs[r].clone(),
        }
    };
    if in_place {
        if let Kind::Rs(_) = kind {
            // the result lands in chunk r; the other chunks keep the input
            for r in 0..n {
                let mut b = inputs[r].clone();
                b[r * count..(r + 1) * count].copy_from_slice(&want[r]);
                want[r] = b;
                let mut t = vec![0.0; n * count];
                t[r * count..(r + 1) * count].copy_from_slice(&tol[r]);
                tol[r] = t;
            }
        }
    }
    if let Kind::Ag | Kind::Bc(_) = kind {
        tol = want.iter().map(|w| vec![0.0; w.len()]).collect();
    }
    let what = format!(
        "{kind:?} of {count} x {:?} on {n} ranks, {mem:?}{}",
        T::DTYPE,
        if in_place { ", in place" } else { "" }
    );
    let at = usize::from(mem == Mem::SymOdd);
    let mut p = Pending {
        what,
        choices: Vec::new(),
        want,
        tol,
        sym: Vec::new(),
        own_in: Vec::new(),
        own_out: Vec::new(),
        at,
    };
    match (mem, in_place) {
        (Mem::Sym | Mem::SymOdd, true) => {
            let len = il.max(ol);
            let mut buf = comm.alloc::<T>(len + at).unwrap();
            for r in 0..n {
                buf.write(r, at, &initial(r)).unwrap();
            }
            for (r, st) in s.iter().enumerate() {
                let v = buf.slice_mut(at..at + len).unwrap();
                p.choices
                    .push(mm_call(comm, r, kind, None, v.into(), st).unwrap());
            }
            p.sym.push(buf);
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
                p.choices
                    .push(mm_call(comm, r, kind, Some(i.into()), o.into(), st).unwrap());
            }
            p.sym.push(ib);
            p.sym.push(ob);
        }
        (Mem::Own, true) => {
            for (r, st) in s.iter().enumerate() {
                let mut b = DeviceBuffer::from_host(comm.device(r).unwrap(), &initial(r)).unwrap();
                p.choices
                    .push(mm_call(comm, r, kind, None, (&mut b).into(), st).unwrap());
                p.own_out.push(b);
            }
        }
        (Mem::Own, false) => {
            for (r, st) in s.iter().enumerate() {
                let d = comm.device(r).unwrap();
                let i = DeviceBuffer::from_host(d, &inputs[r]).unwrap();
                let mut o = DeviceBuffer::<T>::zeroed(d, ol).unwrap();
                p.choices
                    .push(mm_call(comm, r, kind, Some((&i).into()), (&mut o).into(), st).unwrap());
                p.own_in.push(i);
                p.own_out.push(o);
            }
        }
    }
    p
}

impl<T: Elem> Pending<T> {
    /// Every rank's call ran `path`.
    fn assert_path(&self, path: Path) {
        for (r, c) in self.choices.iter().enumerate() {
            assert_eq!(c.path, path, "{}: rank {r} ran {c}", self.what);
        }
    }
}

/// Queue, wait, check; returns rank 0's choice.
fn mm_once<T: Elem>(
    comm: &Communicator,
    s: &[Stream],
    kind: Kind,
    count: usize,
    mem: Mem,
    in_place: bool,
    seed: &mut u64,
) -> Choice {
    let p = mm_queue::<T>(comm, s, kind, count, mem, in_place, seed);
    p.assert_path(want_path(kind, T::DTYPE));
    mm_sync(s);
    comm.check().unwrap_or_else(|e| panic!("{}: {e}", p.what));
    p.check();
    p.choices[0]
}

/// Every collective (every reduce-scatter operator, broadcast from the first and the last
/// rank), every type, every operand kind, in place and not, at counts with and without a
/// scalar tail, on a simulated team of `n` with random delays.
/// The caller checked [`skipped_on_real_driver`].
fn mm_sweep(n: usize, counts: &[usize], seed: u64) {
    let e = sim_delayed(SimConfig::new(n, 13000), Duration::from_micros(100), seed);
    let comm = mm_comm(
        &e,
        CommConfig {
            max_blocks: 3,
            threads: 64,
            ..Default::default()
        },
    );
    let s = mm_streams(&comm);
    let mut seed = seed;
    let mut kinds: Vec<Kind> = ReduceOp::ALL.iter().map(|&op| Kind::Rs(op)).collect();
    kinds.extend([Kind::Ag, Kind::Bc(0), Kind::Bc(n - 1)]);
    for &kind in &kinds {
        for &count in counts {
            for mem in [Mem::Sym, Mem::SymOdd, Mem::Own] {
                for in_place in [false, true] {
                    mm_once::<f32>(&comm, &s, kind, count, mem, in_place, &mut seed);
                    mm_once::<f16>(&comm, &s, kind, count, mem, in_place, &mut seed);
                    mm_once::<bf16>(&comm, &s, kind, count, mem, in_place, &mut seed);
                }
            }
        }
    }
}
