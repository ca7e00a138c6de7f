//! Allreduce through the typed `Communicator`: results equal a host reference (reduced in rank
//! order) for every type and operator, on symmetric buffers and on the caller's own memory,
//! sizes with odd counts and misaligned offsets, back-to-back calls with random per-device delays
//! on teams of 2 to 8, graph replays; bad input is refused before any launch, and a peer that
//! disagrees or never arrives is reported, not waited for forever. The multimem path runs on
//! simulated teams only (real GPUs here must never create a multicast object).

use super::*;

mod arguments;
mod correctness;
mod forms;
mod graphs;
mod leaks;
mod processes;
mod protocol;
mod staging;

/// One checked allreduce of `count` random elements on every rank, on symmetric buffers (the
/// table's runner): the input at element `at.0` of its buffer, the output at `at.1` of its own
/// (in place: the one buffer's view at `at.0`). Symmetric operands are never staged. What the
/// last rank's call chose.
fn check_sym<T: Elem>(
    comm: &Communicator,
    s: &[Stream],
    rng: &mut Rng,
    at: (usize, usize),
    count: usize,
    op: ReduceOp,
    in_place: bool,
) -> Choice {
    let mem = if in_place {
        Mem::sym_at(at.0, at.0)
    } else {
        Mem::sym_at(at.0, at.1)
    };
    let q = cuda_multimem_tests::collectives::once::<T>(
        comm,
        s,
        Call::all_reduce(op),
        count,
        mem,
        in_place,
        rng,
    );
    for c in &q.choices {
        assert_eq!(c.staged_chunks, 0, "symmetric operands are never staged");
    }
    *q.choices.last().unwrap()
}

/// One checked allreduce on the caller's own memory (`DeviceBuffer`s): `in_place` or into a
/// second buffer; with `misaligned`, the input is read through a raw view one element into its
/// buffer (not 16-byte aligned). What the last rank's call chose.
fn check_own<T: Elem>(
    comm: &Communicator,
    s: &[Stream],
    rng: &mut Rng,
    count: usize,
    op: ReduceOp,
    in_place: bool,
    misaligned: bool,
) -> Choice {
    let mem = Mem::own_at(usize::from(misaligned), 0);
    let q = cuda_multimem_tests::collectives::once::<T>(
        comm,
        s,
        Call::all_reduce(op),
        count,
        mem,
        in_place,
        rng,
    );
    *q.choices.last().unwrap()
}

/// Driver calls of `symbol` so far (the simulator's counter; `None` on the real driver).
fn sim_calls(e: &Env, symbol: &str) -> Option<u64> {
    e.sim.as_ref().map(|s| s.calls(symbol))
}

/// Launches so far (the simulator's counter; `None` on the real driver).
fn launches(e: &Env) -> Option<u64> {
    e.sim.as_ref().map(|s| s.calls("cuLaunchKernel"))
}

/// A team whose staging slots are one 4 KiB page: the write-only two-shot then needs many
/// rounds (with G blocks each block owns 256 / G vectors of a slot).
fn small_stage_team(e: &Env, max_blocks: u32) -> Option<Communicator> {
    team_with(
        e,
        "two_shot_push",
        CommConfig {
            one_shot_max_bytes: Some(4 << 10),
            ll_max_bytes: 1 << 10,
            stage_bytes: Some(4 << 10),
            max_blocks,
            ..Default::default()
        },
    )
}
