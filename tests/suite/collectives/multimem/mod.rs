//! The multimem path on the simulator (real GPUs here must never create multicast objects):
//! what a rank whose barrier failed may and may not do to its peers, and what the path promises
//! about the order of a sum; and the multimem reduce-scatter, all-gather and broadcast.
//!
//! Real GPUs here must never create multicast objects: every test builds its own simulator.

// Ranks index their streams and buffers: `for r in 0..n` reads as the protocol does.
#![allow(clippy::needless_range_loop)]

use std::time::Duration;

use cuda_multimem::{CaptureMode, DeviceBuffer, Error, Stream};
use cuda_multimem_collectives::testing::{all_gather_reference, random_input, reference};
use cuda_multimem_collectives::{
    bf16, f16, Algorithm, Choice, CommConfig, Communicator, DType, Dst, Element, MulticastPolicy,
    Path, ReduceOp, Src,
};
use cuda_multimem_sim::SimConfig;
use cuda_multimem_tests::collectives::{self as table, Call, Mem, Params, Queued};
use cuda_multimem_tests::{sim, skip, Env, Rng};

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

/// A simulated machine of `n` devices for one multimem test at the driver version under test
/// ([`cuda_multimem_tests::sim_version`]: multicast objects, from 13.3 logical endpoints), or a
/// printed skip where the suite runs on a real driver ([`skipped_on_real_driver`]) or the
/// version has no multicast ([`mm_machine`]).
fn mm_sim(test: &str, n: usize) -> Option<Env> {
    if skipped_on_real_driver(test) {
        return None;
    }
    mm_machine(test, n)
}

/// A simulated machine of `n` devices at the driver version under test, or — below CUDA 12.1,
/// which has no multicast (`before_cuda_12_1_a_multimem_team_is_refused_and_the_default_policy_says_why`
/// checks what the library does there) — a printed skip.
fn mm_machine(test: &str, n: usize) -> Option<Env> {
    let v = cuda_multimem_tests::sim_version();
    if v < cuda_multimem::multicast::MULTICAST_MIN_DRIVER {
        skip(
            test,
            format!(
                "the simulated driver {v} has no multicast (CUDA {} or newer): no multimem path",
                cuda_multimem::multicast::MULTICAST_MIN_DRIVER
            ),
        );
        return None;
    }
    Some(sim(SimConfig::new(n, v)))
}

/// A multimem communicator over every device of `e` (policy `Always`) with `config`.
fn mm_comm(e: &Env, config: CommConfig) -> Communicator {
    let comm = cuda_multimem_tests::team_on(&e.driver.devices(), config, MulticastPolicy::Always).0;
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

trait Elem: table::Elem {}
impl<T: table::Elem> Elem for T {}

/// The path a case must take: reduce-scatter (and allreduce) where `multimem.ld_reduce` has the
/// type and operator (f32 only adds), the others always.
fn want_path(kind: Call, dtype: DType) -> Path {
    match kind.name {
        "reduce_scatter" | "all_reduce"
            if !cuda_multimem_collectives::multimem_supports(dtype, kind.params.op) =>
        {
            Path::PeerToPeer
        }
        _ => Path::Multimem,
    }
}

/// Every rank's call of `p` ran `path`.
fn assert_path<T: Elem>(p: &Queued<T>, path: Path) {
    for (r, c) in p.choices.iter().enumerate() {
        assert_eq!(c.path, path, "{}: rank {r} ran {c}", p.what());
    }
}

/// Queue `kind` of `count` elements per chunk on every rank (random inputs from `rng`),
/// operands in `mem` (the table's runner); sums are compared within the rounding of a
/// reduction in the switch's order (the allreduce multimem tests' tolerance), everything else
/// bit for bit.
fn mm_queue<T: Elem>(
    comm: &Communicator,
    s: &[Stream],
    kind: Call,
    count: usize,
    mem: Mem,
    in_place: bool,
    rng: &mut Rng,
) -> Queued<T> {
    let mut q = table::queue(comm, s, kind, count, mem, in_place, rng);
    q.switch_order = true;
    q
}

/// Queue, wait, check (every rank ran `want_path`); returns rank 0's choice.
fn mm_once<T: Elem>(
    comm: &Communicator,
    s: &[Stream],
    kind: Call,
    count: usize,
    mem: Mem,
    in_place: bool,
    rng: &mut Rng,
) -> Choice {
    let p = mm_queue::<T>(comm, s, kind, count, mem, in_place, rng);
    assert_path(&p, want_path(kind, T::DTYPE));
    mm_sync(s);
    comm.check().unwrap_or_else(|e| panic!("{}: {e}", p.what()));
    p.check();
    p.choices[0]
}

/// Every collective (every reduce-scatter operator, broadcast from the first and the last
/// rank), every type, every operand kind, in place and not, at counts with and without a
/// scalar tail, on a simulated team of `n` with random delays.
/// The caller checked [`skipped_on_real_driver`].
fn mm_sweep(n: usize, counts: &[usize], seed: u64) {
    let Some(e) = mm_machine(&format!("mm_sweep (a team of {n})"), n) else {
        return;
    };
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
    let mut seed = Rng::new(seed);
    let mut kinds: Vec<Call> = ReduceOp::ALL.map(Call::reduce_scatter).to_vec();
    kinds.extend([
        Call::all_gather(),
        Call::broadcast(0),
        Call::broadcast(n - 1),
    ]);
    for &kind in &kinds {
        for &count in counts {
            for mem in [Mem::SYM, Mem::SYM_ODD, Mem::OWN] {
                for in_place in [false, true] {
                    mm_once::<f32>(&comm, &s, kind, count, mem, in_place, &mut seed);
                    mm_once::<f16>(&comm, &s, kind, count, mem, in_place, &mut seed);
                    mm_once::<bf16>(&comm, &s, kind, count, mem, in_place, &mut seed);
                }
            }
        }
    }
}
