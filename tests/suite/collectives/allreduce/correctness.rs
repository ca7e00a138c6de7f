//! Results equal the host reference: every dtype and operator, symmetric offsets, typed and
//! run-time dtype entries, on symmetric buffers and the caller's own memory.

use super::*;

// ---- results equal the host reference ----

fn every_op_on_symmetric_offsets<T: Elem>(comm: &Communicator, s: &[Stream], seed: &mut Rng) {
    // small (low-latency, one-shot), odd, vector-width tails, two-shot sizes; offsets break
    // 16-byte alignment
    let sizes = [1usize, 7, 1000, 4099, 40_000, 300_001];
    for op in ReduceOp::ALL {
        for (i, &count) in sizes.iter().enumerate() {
            let offs = match i % 3 {
                0 => (0, 0),
                1 => (3, 3),
                _ => (0, 5),
            };
            check_sym::<T>(comm, s, seed, offs, count, op, false);
            check_sym::<T>(comm, s, seed, (offs.0, 0), count, op, true);
        }
    }
}

#[test]
fn peer_to_peer_allreduce_equals_the_host_reference_for_every_dtype_and_op() {
    let e = ar_env();
    let Some(comm) = team(&e, "peer_to_peer_allreduce") else {
        return;
    };
    let s = streams(&comm);
    let mut seed = Rng::new(5);
    for dtype in DType::ALL {
        for_dtype!(dtype, every_op_on_symmetric_offsets(&comm, &s, &mut seed));
    }
}

/// The configuration of the typed tests: one-shot up to 32 KiB (low-latency up to 4 KiB), so
/// small sizes run directly and larger ones on the caller's memory go through the scratch.
fn typed_config() -> CommConfig {
    CommConfig {
        one_shot_max_bytes: Some(32 << 10),
        ll_max_bytes: 4 << 10,
        ..Default::default()
    }
}

/// Sizes below the one-shot limit (32 KiB) for every type, and above it; odd counts and counts
/// that are not a multiple of 8.
const TYPED_SIZES: [usize; 6] = [1, 7, 1001, 8191, 20_003, 100_001];

fn typed_symmetric<T: Elem>(comm: &Communicator, s: &[Stream], seed: &mut Rng) {
    for op in ReduceOp::ALL {
        for count in TYPED_SIZES {
            let a = check_sym::<T>(comm, s, seed, (0, 0), count, op, false);
            let b = check_sym::<T>(comm, s, seed, (0, 0), count, op, true);
            let one_shot = count * std::mem::size_of::<T>() <= 32 << 10;
            for c in [a, b] {
                assert_eq!(
                    matches!(c.algorithm, Algorithm::OneShot | Algorithm::OneShotLl),
                    one_shot,
                    "{count} x {}: {c}",
                    T::DTYPE
                );
            }
        }
    }
}

#[test]
fn typed_allreduce_on_symmetric_buffers_equals_the_reference_for_every_dtype_and_op() {
    let e = ar_env();
    let Some(comm) = team_with(&e, "typed_symmetric", typed_config()) else {
        return;
    };
    let s = streams(&comm);
    let mut seed = Rng::new(31);
    for dtype in DType::ALL {
        for_dtype!(dtype, typed_symmetric(&comm, &s, &mut seed));
    }
}

fn typed_own<T: Elem>(comm: &Communicator, s: &[Stream], seed: &mut Rng) {
    for op in ReduceOp::ALL {
        for count in TYPED_SIZES {
            let staged = count * std::mem::size_of::<T>() > 32 << 10;
            for in_place in [false, true] {
                let c = check_own::<T>(comm, s, seed, count, op, in_place, false);
                assert_eq!(
                    c.staged_chunks > 0,
                    staged,
                    "{count} x {} (in place {in_place}): {c}",
                    T::DTYPE
                );
                let planned = comm.choice(T::DTYPE, op, count, Operands::Local).unwrap();
                assert_eq!(planned.staged_chunks, c.staged_chunks);
            }
        }
    }
}

#[test]
fn typed_allreduce_on_the_callers_own_memory_equals_the_reference_for_every_dtype_and_op() {
    let e = ar_env();
    let Some(comm) = team_with(&e, "typed_own", typed_config()) else {
        return;
    };
    let s = streams(&comm);
    let mut seed = Rng::new(32);
    for dtype in DType::ALL {
        for_dtype!(dtype, typed_own(&comm, &s, &mut seed));
    }
}

// ---- the run-time dtype entry ----

#[test]
fn all_reduce_dyn_on_byte_views_equals_the_reference_for_every_dtype() {
    let e = ar_env();
    let Some(comm) = team_with(&e, "all_reduce_dyn", typed_config()) else {
        return;
    };
    let s = streams(&comm);
    let mut seed = 41;
    let mut inp = comm.alloc::<u8>(128 << 10).unwrap();
    let mut out = comm.alloc::<u8>(128 << 10).unwrap();
    for dtype in DType::ALL {
        for op in ReduceOp::ALL {
            for count in [1001usize, 20_003] {
                let len = count * dtype.size();
                let inputs: Vec<Vec<u8>> = (0..2)
                    .map(|_| random_bytes(dtype, count, &mut seed))
                    .collect();
                let want = reference_bytes(dtype, op, &refs(&inputs));
                // symmetric byte views, out of place then in place
                for (r, x) in inputs.iter().enumerate() {
                    inp.write(r, 0, x).unwrap();
                }
                for (r, st) in s.iter().enumerate() {
                    comm.rank(r)
                        .unwrap()
                        .all_reduce_dyn(
                            dtype,
                            inp.slice(..len).unwrap(),
                            out.slice_mut(..len).unwrap(),
                            op,
                            st,
                        )
                        .unwrap();
                }
                sync(&s);
                comm.check().unwrap();
                for r in 0..2 {
                    let mut got = vec![0u8; len];
                    out.read(r, 0, &mut got).unwrap();
                    assert_eq!(
                        first_mismatch_bytes(dtype, &got, &want),
                        None,
                        "{dtype} {op} {count} rank {r}"
                    );
                }
                for (r, st) in s.iter().enumerate() {
                    comm.rank(r)
                        .unwrap()
                        .all_reduce_dyn_in_place(dtype, inp.slice_mut(..len).unwrap(), op, st)
                        .unwrap();
                }
                sync(&s);
                comm.check().unwrap();
                for r in 0..2 {
                    let mut got = vec![0u8; len];
                    inp.read(r, 0, &mut got).unwrap();
                    assert_eq!(
                        first_mismatch_bytes(dtype, &got, &want),
                        None,
                        "{dtype} {op} {count} in place, rank {r}"
                    );
                }
                // the caller's own byte buffers
                let mut keep = Vec::new();
                for (r, st) in s.iter().enumerate() {
                    let d = comm.device(r).unwrap();
                    let i = DeviceBuffer::from_host(d, &inputs[r]).unwrap();
                    let mut o = DeviceBuffer::<u8>::zeroed(d, len).unwrap();
                    comm.rank(r)
                        .unwrap()
                        .all_reduce_dyn(dtype, &i, &mut o, op, st)
                        .unwrap();
                    keep.push((i, o));
                }
                sync(&s);
                comm.check().unwrap();
                for (r, (_, o)) in keep.iter().enumerate() {
                    assert_eq!(
                        first_mismatch_bytes(dtype, &o.to_vec().unwrap(), &want),
                        None,
                        "{dtype} {op} {count} own memory, rank {r}"
                    );
                }
            }
        }
    }
}
