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

/// One checked allreduce of `count` random elements on every rank, on symmetric buffers: the
/// input at element `in_off` of `inp`, the output at `out_off` of `out` (`None`: in place).
#[allow(clippy::too_many_arguments)]
fn check_sym<T: Element + Default>(
    comm: &Communicator,
    s: &[Stream],
    seed: &mut u64,
    inp: &mut SymmetricBuffer<T>,
    mut out: Option<&mut SymmetricBuffer<T>>,
    (in_off, out_off): (usize, usize),
    count: usize,
    op: ReduceOp,
) -> Choice {
    let n = comm.size();
    let inputs: Vec<Vec<T>> = (0..n).map(|_| random_input(count, seed)).collect();
    for (r, x) in inputs.iter().enumerate() {
        inp.write(r, in_off, x).unwrap();
    }
    let mut choice = None;
    for (r, st) in s.iter().enumerate() {
        let h = comm.rank(r).unwrap();
        let c = match &mut out {
            Some(o) => h.all_reduce(
                inp.slice(in_off..in_off + count).unwrap(),
                o.slice_mut(out_off..out_off + count).unwrap(),
                op,
                st,
            ),
            None => h.all_reduce_in_place(inp.slice_mut(in_off..in_off + count).unwrap(), op, st),
        }
        .unwrap();
        assert_eq!(c.staged_chunks, 0, "symmetric operands are never staged");
        choice = Some(c);
    }
    sync(s);
    comm.check().unwrap();
    let want = reference(op, &refs(&inputs));
    let (buf, off): (&SymmetricBuffer<T>, usize) = match &out {
        Some(o) => (o, out_off),
        None => (inp, in_off),
    };
    let choice = choice.unwrap();
    for r in 0..n {
        let mut got = vec![T::default(); count];
        buf.read(r, off, &mut got).unwrap();
        if let Some(m) = first_mismatch(&got, &want) {
            panic!(
                "rank {r}, {count} x {} {op} ({choice}), offsets {in_off}/{out_off}: {m}",
                T::DTYPE
            );
        }
    }
    choice
}

/// One checked allreduce on the caller's own memory (`DeviceBuffer`s): `in_place` or into a
/// second buffer; with `misaligned`, the input is read through `Src::from_raw` one element into
/// its buffer (not 16-byte aligned).
fn check_own<T: Element + Default>(
    comm: &Communicator,
    s: &[Stream],
    seed: &mut u64,
    count: usize,
    op: ReduceOp,
    in_place: bool,
    misaligned: bool,
) -> Choice {
    let n = comm.size();
    let inputs: Vec<Vec<T>> = (0..n).map(|_| random_input(count, seed)).collect();
    let mut choice = None;
    let mut keep = Vec::new();
    for (r, st) in s.iter().enumerate() {
        let h = comm.rank(r).unwrap();
        let d = comm.device(r).unwrap();
        let c = if in_place {
            let mut b = DeviceBuffer::from_host(d, &inputs[r]).unwrap();
            let c = h.all_reduce_in_place(&mut b, op, st).unwrap();
            keep.push((None, b));
            c
        } else if misaligned {
            let mut padded = vec![T::from_f32(9.0)];
            padded.extend_from_slice(&inputs[r]);
            let i = DeviceBuffer::from_host(d, &padded).unwrap();
            let mut o = DeviceBuffer::<T>::zeroed(d, count).unwrap();
            // SAFETY: `count` elements of `i`, one element in, live until the stream is synced.
            let src = unsafe {
                Src::<T>::from_raw(i.device_ptr() + std::mem::size_of::<T>() as u64, count)
            };
            let c = h.all_reduce(src, &mut o, op, st).unwrap();
            keep.push((Some(i), o));
            c
        } else {
            let i = DeviceBuffer::from_host(d, &inputs[r]).unwrap();
            let mut o = DeviceBuffer::<T>::zeroed(d, count).unwrap();
            let c = h.all_reduce(&i, &mut o, op, st).unwrap();
            keep.push((Some(i), o));
            c
        };
        choice = Some(c);
    }
    sync(s);
    comm.check().unwrap();
    let want = reference(op, &refs(&inputs));
    let choice = choice.unwrap();
    for (r, (_, o)) in keep.iter().enumerate() {
        if let Some(m) = first_mismatch(&o.to_vec().unwrap(), &want) {
            panic!(
                "rank {r}, {count} x {} {op} ({choice}), own memory, in place {in_place}, misaligned {misaligned}: {m}",
                T::DTYPE
            );
        }
    }
    choice
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
