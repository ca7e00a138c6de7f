//! The caller's own memory above the one-shot limit: chunks through the scratch, copies folded
//! into the next chunk's kernel, inputs not 16-byte aligned, no scratch at all.

use super::*;

#[test]
fn calls_on_the_callers_own_memory_go_through_a_small_scratch_in_several_chunks() {
    let e = ar_env();
    let Some(comm) = team_with(
        &e,
        "small_scratch",
        CommConfig {
            one_shot_max_bytes: Some(16 << 10),
            ll_max_bytes: 4 << 10,
            // three regions of 32 KiB (an input region, two output regions): a chunk is 32 KiB
            scratch_bytes: 96 << 10,
            ..Default::default()
        },
    ) else {
        return;
    };
    let s = streams(&comm);
    let mut seed = Rng::new(33);
    for op in ReduceOp::ALL {
        for in_place in [false, true] {
            // 200 004 bytes: 6 chunks of 32 KiB and a last one of 3 396 bytes
            let c = check_own::<f32>(&comm, &s, &mut seed, 50_001, op, in_place, false);
            assert_eq!(c.staged_chunks, 7, "{c}");
            let c = check_own::<bf16>(&comm, &s, &mut seed, 50_001, op, in_place, false);
            assert_eq!(c.staged_chunks, 4, "{c}");
        }
    }
    assert_eq!(
        comm.choice(DType::F32, ReduceOp::Sum, 50_001, Operands::Local)
            .unwrap()
            .staged_chunks,
        7
    );
}

/// Staged calls of `T` on the caller's memory through 32 KiB chunks, each checked against the
/// reference; on the simulator also the kernels (one per chunk and rank) and the device-to-device
/// copies per rank: `copies` of them, whatever the chunk count — each chunk's copy out of the
/// scratch goes with the next chunk's kernel.
fn folded_copies<T: Elem>(e: &Env, comm: &Communicator, s: &[Stream], seed: &mut Rng) {
    let n = comm.size() as u64;
    let es = std::mem::size_of::<T>();
    let whole = (32 << 10) / es;
    // (count, chunks, copies per rank): whole chunks (the last copy out only); a last chunk with
    // a scalar tail (copied into the input region first, its kernel still takes the copy out of
    // the chunk before); a last chunk one-shot serves (the copy out of the chunk before goes as
    // a plain copy before it, and nothing is left after it)
    let cases = [
        (4 * whole, 4, 1),
        (3 * whole + (20 << 10) / es + 1, 4, 2),
        (5 * whole + 100, 6, 1),
    ];
    // the operators of the write-only two-shot (product and average stage through the reading
    // two-shot, every chunk's input copied in: other counts of copies)
    for op in [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max] {
        for in_place in [false, true] {
            for (count, chunks, copies) in cases {
                let before = (
                    launches(e),
                    sim_calls(e, "cuMemcpyDtoDAsync"),
                    sim_calls(e, "cuMemcpyBatchAsync"),
                );
                let c = check_own::<T>(comm, s, seed, count, op, in_place, false);
                let what = format!("{count} x {} {op} in place {in_place}: {c}", T::DTYPE);
                assert_eq!(c.staged_chunks, chunks, "{what}");
                if let (Some(l), Some(d), Some(b)) = before {
                    assert_eq!(launches(e).unwrap() - l, n * chunks as u64, "{what}");
                    assert_eq!(
                        sim_calls(e, "cuMemcpyDtoDAsync").unwrap() - d,
                        n * copies,
                        "{what}: device-to-device copies"
                    );
                    assert_eq!(sim_calls(e, "cuMemcpyBatchAsync"), Some(b), "{what}");
                }
            }
        }
    }
}

#[test]
fn staged_calls_copy_each_chunk_out_in_the_next_chunks_kernel_and_only_the_last_one_apart() {
    let e = ar_env();
    // three grids: the default one, 3 blocks (not a power of two) and 1; 4 KiB staging slots,
    // so a chunk's kernel runs several rounds and the copy out comes in several slices
    for max_blocks in [0u32, 3, 1] {
        let Some(comm) = team_with(
            &e,
            "folded_copies",
            CommConfig {
                one_shot_max_bytes: Some(4 << 10),
                ll_max_bytes: 1 << 10,
                stage_bytes: Some(4 << 10),
                // three regions of 32 KiB: an input region, two output regions
                scratch_bytes: 96 << 10,
                max_blocks,
                ..Default::default()
            },
        ) else {
            return;
        };
        let s = streams(&comm);
        let mut seed = Rng::new(36 + max_blocks as u64);
        for dtype in DType::ALL {
            for_dtype!(dtype, folded_copies(&e, &comm, &s, &mut seed));
        }
    }
}

fn misaligned_input<T: Elem>(comm: &Communicator, s: &[Stream], seed: &mut Rng) {
    for op in ReduceOp::ALL {
        // below the one-shot limit (run directly, or on a copy in the scratch) and above it
        // (staged), counts not a multiple of 8
        for count in [1001usize, 30_001] {
            let c = check_own::<T>(comm, s, seed, count, op, false, true);
            let es = std::mem::size_of::<T>();
            if count * es > 16 << 10 {
                assert!(c.staged_chunks > 1, "{c}");
            } else {
                // the team's form runs on a copy of this rank's input, one element off, in its
                // scratch where the form needs more alignment than that (a rank's own alignment
                // never changes what the team runs): the low-latency form 4-byte words, the
                // one-shot 16-byte vectors
                let need = if c.algorithm == Algorithm::OneShotLl {
                    4
                } else {
                    16
                };
                assert_eq!(c.staged_chunks, u32::from(!es.is_multiple_of(need)), "{c}");
            }
        }
    }
}

#[test]
fn an_input_that_is_not_16_byte_aligned_gives_the_reference_directly_and_staged() {
    let e = ar_env();
    let Some(comm) = team_with(
        &e,
        "misaligned_input",
        CommConfig {
            one_shot_max_bytes: Some(16 << 10),
            ll_max_bytes: 4 << 10,
            scratch_bytes: 64 << 10,
            ..Default::default()
        },
    ) else {
        return;
    };
    let s = streams(&comm);
    let mut seed = Rng::new(34);
    for dtype in DType::ALL {
        for_dtype!(dtype, misaligned_input(&comm, &s, &mut seed));
    }
}

#[test]
fn without_a_scratch_calls_on_the_callers_own_memory_above_one_shot_are_refused() {
    let e = ar_env();
    let Some(comm) = team_with(
        &e,
        "no_scratch",
        CommConfig {
            one_shot_max_bytes: Some(16 << 10),
            scratch_bytes: 0,
            ll_max_bytes: 4 << 10,
            ..Default::default()
        },
    ) else {
        return;
    };
    let s = streams(&comm);
    let d = comm.device(0).unwrap();
    let i = DeviceBuffer::<f32>::zeroed(d, 8192).unwrap();
    let mut o = DeviceBuffer::<f32>::zeroed(d, 8192).unwrap();
    let err = comm
        .rank(0)
        .unwrap()
        .all_reduce(&i, &mut o, ReduceOp::Sum, &s[0])
        .unwrap_err();
    assert_eq!(invalid_arg(err), "count");
    // below the limit they run directly
    let mut seed = Rng::new(35);
    check_own::<f32>(&comm, &s, &mut seed, 1000, ReduceOp::Sum, false, false);
}
