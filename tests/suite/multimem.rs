//! The multimem path on the simulator (real GPUs here must never create multicast objects):
//! what a rank whose barrier failed may and may not do to its peers, and what the path promises
//! about the order of a sum.

use std::time::Duration;

use cuda_multimem::{Error, Stream};
use cuda_multimem_collectives::{
    reference, Algorithm, CommConfig, Communicator, MulticastPolicy, Path, ReduceOp,
};
use cuda_multimem_sim::SimConfig;
use cuda_multimem_tests::sim;

/// A team of 3 with the multimem path forced where rank 2 never calls. Rank 0 queues two calls
/// and runs them to the end (timed out) before rank 1, slower, queues its two. The arrival words
/// are additive: if rank 0 kept arriving after its first barrier failed, its arrivals plus rank
/// 1's own would complete rank 1's barriers without rank 2, and rank 1 would reduce without it
/// and report nothing. Every calling rank must time out instead.
#[test]
fn a_rank_whose_multimem_barrier_timed_out_completes_no_later_barrier_of_its_peers() {
    for algorithm in [Algorithm::OneShot, Algorithm::TwoShot] {
        let e = sim(SimConfig::new(3, 13000));
        let devices = e.driver.devices();
        let comm = Communicator::builder(&devices)
            .multicast(MulticastPolicy::Always)
            .config(CommConfig {
                algorithm: Some(algorithm),
                max_blocks: 2,
                threads: 64,
                timeout: Duration::from_millis(200),
                ..Default::default()
            })
            .build()
            .unwrap();
        let s: Vec<Stream> = devices.iter().map(|d| Stream::new(d).unwrap()).collect();
        let count = 4096;
        let mut buf = comm.alloc::<f32>(count).unwrap();
        for r in 0..3 {
            buf.write(r, 0, &vec![1f32; count]).unwrap();
        }
        let (h0, h1) = (comm.rank(0).unwrap(), comm.rank(1).unwrap());
        for _ in 0..2 {
            let c = h0
                .all_reduce_in_place(&mut buf, ReduceOp::Sum, &s[0])
                .unwrap();
            assert_eq!(c.path, Path::Multimem);
        }
        s[0].synchronize().unwrap();
        // Rank 1 calls only now, after rank 0's two calls timed out (nobody has looked yet, so
        // the team still takes calls): its barrier must not be completed by rank 0's arrivals.
        h1.all_reduce_in_place(&mut buf, ReduceOp::Sum, &s[1])
            .unwrap();
        s[1].synchronize().unwrap();
        match h1.check() {
            Err(Error::Timeout { after, .. }) => {
                assert_eq!(after, Duration::from_millis(200), "{algorithm}")
            }
            other => panic!("{algorithm}: rank 1's call completed without rank 2 ({other:?})"),
        }
        match h0.check() {
            Err(Error::Timeout { .. }) => {}
            other => panic!("{algorithm}: rank 0: expected a timeout, got {other:?}"),
        }
        assert!(matches!(
            h1.all_reduce_in_place(&mut buf, ReduceOp::Sum, &s[1]),
            Err(Error::Unusable { .. })
        ));
    }
}

/// What the multimem path guarantees for sums, on a simulated team of 3 whose switch reduces
/// in an order of its own: two-shot results are bit-identical on every rank (each part is
/// reduced once and multicast-stored) and one-shot results are close to the rank-order
/// reference, but neither is the rank-order sum bit for bit.
#[test]
fn multimem_sums_are_not_in_rank_order_and_two_shot_is_the_same_on_every_rank() {
    let e = sim(SimConfig::new(3, 13000));
    let devices = e.driver.devices();
    let count = 20_000;
    // magnitudes over several binades, so that the order of the additions shows in the bits
    let mut rng = cuda_multimem_tests::Rng::new(7);
    let inputs: Vec<Vec<f32>> = (0..3)
        .map(|_| {
            (0..count)
                .map(|_| {
                    let scale = (1u32 << (rng.next_u64() % 12)) as f32;
                    rng.f32() * scale
                })
                .collect()
        })
        .collect();
    let refs: Vec<&[f32]> = inputs.iter().map(|v| v.as_slice()).collect();
    let want = reference(ReduceOp::Sum, &refs);
    let bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    for algorithm in [Algorithm::OneShot, Algorithm::TwoShot] {
        let comm = Communicator::builder(&devices)
            .multicast(MulticastPolicy::Always)
            .config(CommConfig {
                algorithm: Some(algorithm),
                ..Default::default()
            })
            .build()
            .unwrap();
        let s: Vec<Stream> = devices.iter().map(|d| Stream::new(d).unwrap()).collect();
        let mut buf = comm.alloc::<f32>(count).unwrap();
        for (r, x) in inputs.iter().enumerate() {
            buf.write(r, 0, x).unwrap();
        }
        for (r, st) in s.iter().enumerate() {
            let c = comm
                .rank(r)
                .unwrap()
                .all_reduce_in_place(&mut buf, ReduceOp::Sum, st)
                .unwrap();
            assert_eq!(c.path, Path::Multimem);
        }
        for st in &s {
            st.synchronize().unwrap();
        }
        comm.check().unwrap();
        let got: Vec<Vec<f32>> = (0..3).map(|r| buf.to_vec(r).unwrap()).collect();
        for (r, g) in got.iter().enumerate() {
            if let Some(m) = cuda_multimem_tests::first_beyond_sum_tolerance(
                cuda_multimem_collectives::DType::F32,
                3,
                &bytes(g),
                &bytes(&want),
            ) {
                panic!("{algorithm}: rank {r}: {m}");
            }
            assert_ne!(
                g, &want,
                "{algorithm}: rank {r} summed in rank order, bit for bit"
            );
        }
        if algorithm == Algorithm::TwoShot {
            assert!(
                got.iter().all(|g| g == &got[0]),
                "two-shot: every rank gets the same bits"
            );
        }
    }
}

// ---- reduce-scatter, all-gather and broadcast on the multimem path (simulator only) ----

use cuda_multimem::{CaptureMode, DeviceBuffer};
use cuda_multimem_collectives::{
    all_gather_reference, bf16, broadcast_reference, f16, random_input, reduce_scatter_reference,
    Choice, DType, Dst, Element, Src, SymmetricBuffer,
};
use cuda_multimem_tests::{skip, Env};

/// A simulated machine of `n` devices for one multimem test, or a printed skip where the suite
/// runs on a real driver: these tests build multicast teams, which the GPUs this project uses
/// must never create (`cargo xtask test` runs them on the simulator at every driver version).
fn mm_sim(test: &str, n: usize) -> Option<Env> {
    let sel = std::env::var(cuda_multimem::DRIVER_ENV).unwrap_or_default();
    if !sel.is_empty() && !sel.starts_with("sim") {
        skip(
            test,
            format!("{}={sel} selects a real driver; multimem tests build multicast teams and run on the simulator only", cuda_multimem::DRIVER_ENV),
        );
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
    assert!(comm.multimem_active(), "{:?}", comm.multimem_unavailable_reason());
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
        Kind::Rs(op) if !cuda_multimem_collectives::multimem_supports(dtype, op) => {
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
        Kind::Bc(_) => (count, count),
    };
    let inputs: Vec<Vec<T>> = (0..n).map(|_| random_input(il, seed)).collect();
    let filler: Vec<Vec<T>> = (0..n).map(|_| random_input(ol, seed)).collect();
    let refs: Vec<&[T]> = inputs.iter().map(|v| v.as_slice()).collect();
    let mut want: Vec<Vec<T>> = match kind {
        Kind::Rs(op) => reduce_scatter_reference(op, &refs),
        Kind::Ag => vec![all_gather_reference(&refs); n],
        Kind::Bc(root) => vec![broadcast_reference(&refs, root); n],
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
                .map(|i| match kind {
                    Kind::Rs(ReduceOp::Sum) => {
                        let mag: f32 = inputs.iter().map(|x| x[r * count + i].to_f32().abs()).sum();
                        eps * mag.max(1.0) * n as f32
                    }
                    _ => 0.0,
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
    let path = want_path(kind, T::DTYPE);
    for (r, c) in p.choices.iter().enumerate() {
        assert_eq!(c.path, path, "{}: rank {r} ran {c}", p.what);
    }
    p
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
    mm_sync(s);
    comm.check().unwrap_or_else(|e| panic!("{}: {e}", p.what));
    p.check();
    p.choices[0]
}

/// Every collective (every reduce-scatter operator, broadcast from the first and the last
/// rank), every type, every operand kind, in place and not, at counts with and without a
/// scalar tail, on a simulated team of `n` with random delays.
fn mm_sweep(test: &str, n: usize, counts: &[usize], seed: u64) {
    let Some(e) = mm_sim(test, n) else { return };
    e.sim
        .as_ref()
        .unwrap()
        .set_kernel_delays(Duration::from_micros(100), seed);
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

#[test]
fn multimem_collectives_equal_the_host_reference_for_every_dtype_op_and_operand_kind() {
    mm_sweep(
        "multimem_collectives_equal_the_host_reference_for_every_dtype_op_and_operand_kind",
        4,
        &[3, 1001, 4096],
        31,
    );
}

#[test]
fn multimem_collectives_equal_the_host_reference_on_teams_of_2_and_8() {
    let test = "multimem_collectives_equal_the_host_reference_on_teams_of_2_and_8";
    mm_sweep(test, 2, &[13, 2000], 32);
    mm_sweep(test, 8, &[7, 520], 33);
}
