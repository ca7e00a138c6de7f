//! The forms: every forced algorithm gives the reference bits; the write-only two-shot alone,
//! in rounds and sharing the staging with one-shot; the copy-engine two-shot and its limits.

use super::*;

#[test]
fn every_forced_algorithm_gives_the_reference_bits() {
    let e = ar_env();
    let Some(devices) = two_devices(&e, "forced_algorithms") else {
        return;
    };
    let mut seed = Rng::new(11);
    for algorithm in [
        Algorithm::OneShotLl,
        Algorithm::OneShot,
        Algorithm::TwoShot,
        Algorithm::TwoShotPush,
        Algorithm::TwoShotCe,
    ] {
        let comm = cuda_multimem_tests::team_on(
            &devices,
            CommConfig {
                algorithm: Some(algorithm),
                ce_max_bytes: 1 << 20,
                ..Default::default()
            },
            MulticastPolicy::Never,
        )
        .0;
        let s = streams(&comm);
        for count in [6usize, 12_346, 32_768] {
            let planned = comm
                .choice(DType::Bf16, ReduceOp::Sum, count, Operands::Symmetric)
                .unwrap();
            assert_eq!(planned.algorithm, algorithm);
            let ran = check_sym::<bf16>(&comm, &s, &mut seed, (0, 0), count, ReduceOp::Sum, true);
            assert_eq!(ran.algorithm, algorithm);
        }
    }
}

/// A write-only two-shot call on symmetric buffers (no prologue copy): the reference in the
/// output, every other byte of both buffers as it was, no copy beside the kernels.
fn push_alone<T: Elem>(e: &Env, comm: &Communicator, s: &[Stream], seed: &mut Rng) {
    let n = comm.size();
    let count = 40_000;
    let guard = 64;
    let total = count + 2 * guard;
    let inp = comm.alloc::<T>(total).unwrap();
    let mut out = comm.alloc::<T>(total).unwrap();
    let fill: Vec<Vec<T>> = (0..n).map(|_| seed.input(total)).collect();
    let filled: Vec<Vec<T>> = (0..n).map(|_| seed.input(total)).collect();
    for r in 0..n {
        inp.write(r, 0, &fill[r]).unwrap();
        out.write(r, 0, &filled[r]).unwrap();
    }
    let before = (launches(e), sim_calls(e, "cuMemcpyDtoDAsync"));
    for (r, st) in s.iter().enumerate() {
        let c = comm
            .rank(r)
            .unwrap()
            .all_reduce(
                inp.slice(guard..guard + count).unwrap(),
                out.slice_mut(guard..guard + count).unwrap(),
                ReduceOp::Sum,
                st,
            )
            .unwrap();
        assert_eq!(c.algorithm, Algorithm::TwoShotPush, "{c}");
    }
    sync(s);
    comm.check().unwrap();
    if let (Some(l), Some(d)) = before {
        assert_eq!(launches(e).unwrap() - l, n as u64);
        assert_eq!(sim_calls(e, "cuMemcpyDtoDAsync"), Some(d));
    }
    let inputs: Vec<Vec<T>> = fill
        .iter()
        .map(|x| x[guard..guard + count].to_vec())
        .collect();
    let want = reference(ReduceOp::Sum, &refs(&inputs));
    for r in 0..n {
        let mut got = vec![T::default(); total];
        out.read(r, 0, &mut got).unwrap();
        assert_eq!(
            first_mismatch(&got[guard..guard + count], &want),
            None,
            "rank {r}"
        );
        assert_eq!(
            first_mismatch(&got[..guard], &filled[r][..guard]),
            None,
            "rank {r}"
        );
        assert_eq!(
            first_mismatch(&got[guard + count..], &filled[r][guard + count..]),
            None,
            "rank {r}"
        );
        let mut got = vec![T::default(); total];
        inp.read(r, 0, &mut got).unwrap();
        assert_eq!(
            first_mismatch(&got, &fill[r]),
            None,
            "rank {r}: the input changed"
        );
    }
}

#[test]
fn a_write_only_two_shot_call_without_a_prologue_copy_writes_only_its_output() {
    let e = ar_env();
    let Some(comm) = small_stage_team(&e, 0) else {
        return;
    };
    let s = streams(&comm);
    let mut seed = Rng::new(37);
    for dtype in DType::ALL {
        for_dtype!(dtype, push_alone(&e, &comm, &s, &mut seed));
    }
}

// ---- the write-only two-shot in rounds, and the copy-engine two-shot ----

fn push_rounds<T: Elem>(
    comm: &Communicator,
    s: &[Stream],
    seed: &mut Rng,
    count: usize,
    op: ReduceOp,
) {
    let c = check_sym::<T>(comm, s, seed, (0, 0), count, op, true);
    assert_eq!(c.algorithm, Algorithm::TwoShotPush, "{c}");
    let es = std::mem::size_of::<T>();
    // output 16 elements in: still 16-byte aligned for every type
    let c = check_sym::<T>(comm, s, seed, (16 / es * 2, 16), count, op, false);
    assert_eq!(c.algorithm, Algorithm::TwoShotPush, "{c}");
}

#[test]
fn the_write_only_two_shot_is_the_default_above_one_shot_and_runs_in_rounds() {
    let e = ar_env();
    for max_blocks in [0u32, 3] {
        let Some(comm) = small_stage_team(&e, max_blocks) else {
            return;
        };
        let s = streams(&comm);
        let mut seed = Rng::new(99 + max_blocks as u64);
        assert_eq!(
            comm.choice(DType::F32, ReduceOp::Sum, 100_000, Operands::Symmetric)
                .unwrap()
                .algorithm,
            Algorithm::TwoShotPush
        );
        assert_eq!(
            comm.choice(DType::F32, ReduceOp::Sum, 1000, Operands::Symmetric)
                .unwrap()
                .algorithm,
            Algorithm::OneShot
        );
        // counts that leave vector tails, in place and out of place, every dtype
        push_rounds::<f32>(&comm, &s, &mut seed, 100_003, ReduceOp::Sum);
        push_rounds::<bf16>(&comm, &s, &mut seed, 300_001, ReduceOp::Max);
        push_rounds::<f16>(&comm, &s, &mut seed, 400_000, ReduceOp::Min);
        push_rounds::<f32>(&comm, &s, &mut seed, 2_047, ReduceOp::Max);
        // misaligned operands: the reading two-shot runs instead, still exact
        let c = check_sym::<f32>(&comm, &s, &mut seed, (1, 1), 50_000, ReduceOp::Sum, false);
        assert_eq!(c.algorithm, Algorithm::TwoShot);
        let c = check_sym::<bf16>(&comm, &s, &mut seed, (3, 5), 50_000, ReduceOp::Sum, false);
        assert_eq!(c.algorithm, Algorithm::TwoShot);
    }
}

/// Push calls (many rounds, both slot parities) queued back to back with one-shot calls that use
/// the same staging slots, nothing synchronised in between: a slot reused too early shows as a
/// wrong element.
#[test]
fn write_only_two_shot_and_one_shot_share_the_staging_back_to_back() {
    let e = ar_env();
    let Some(comm) = small_stage_team(&e, 5) else {
        return;
    };
    let s = streams(&comm);
    let calls = 12usize;
    let region = 256 << 10;
    let inp = comm.alloc::<u8>(region * calls).unwrap();
    let mut out = comm.alloc::<u8>(region * calls).unwrap();
    let mut rng = Rng::new(123);
    let mut state = 123u64;
    let mut plan = Vec::new();
    for c in 0..calls {
        let dtype = DType::ALL[c % 3];
        let op = ReduceOp::ALL[(c / 3) % 3];
        // alternate: push (16 KiB .. 256 KiB), one-shot (<= 4 KiB)
        let bytes = if c % 2 == 0 {
            (16 << 10) + (rng.next_u64() % (240 << 10)) as usize
        } else {
            1024 + (rng.next_u64() % 3072) as usize
        };
        let count = bytes / dtype.size();
        let inputs: Vec<Vec<u8>> = (0..2)
            .map(|_| random_bytes(dtype, count, &mut state))
            .collect();
        plan.push((dtype, op, count, inputs));
    }
    for r in 0..2 {
        let mut all = vec![0u8; region * calls];
        for (c, (_, _, _, inputs)) in plan.iter().enumerate() {
            all[c * region..c * region + inputs[r].len()].copy_from_slice(&inputs[r]);
        }
        inp.write(r, 0, &all).unwrap();
    }
    for (c, (dtype, op, count, _)) in plan.iter().enumerate() {
        let (at, len) = (c * region, count * dtype.size());
        for (r, st) in s.iter().enumerate() {
            let got = comm
                .rank(r)
                .unwrap()
                .all_reduce_dyn(
                    *dtype,
                    inp.slice(at..at + len).unwrap(),
                    out.slice_mut(at..at + len).unwrap(),
                    *op,
                    st,
                )
                .unwrap();
            let want = if c % 2 == 0 {
                Algorithm::TwoShotPush
            } else {
                Algorithm::OneShot
            };
            assert_eq!(got.algorithm, want, "call {c}");
        }
    }
    sync(&s);
    comm.check().unwrap();
    for r in 0..2 {
        let all = out.to_vec(r).unwrap();
        for (c, (dtype, op, count, inputs)) in plan.iter().enumerate() {
            let want = reference_bytes(*dtype, *op, &refs(inputs));
            let got = &all[c * region..c * region + count * dtype.size()];
            if let Some(m) = first_mismatch_bytes(*dtype, got, &want) {
                panic!("call {c} ({count} x {dtype} {op}), rank {r}: {m}");
            }
        }
    }
}

fn ce_every_op<T: Elem>(comm: &Communicator, s: &[Stream], seed: &mut Rng) {
    let es = std::mem::size_of::<T>();
    for op in ReduceOp::ALL {
        for count in [5_000usize, 131_075] {
            let count = count.min((1 << 20) / es);
            // from ce_min_bytes (16 KiB) on
            let alg = if matches!(op, ReduceOp::Prod | ReduceOp::Avg) {
                // no write-only two-shot forms: the reading two-shot
                Algorithm::TwoShot
            } else if count * es >= 16 << 10 {
                Algorithm::TwoShotCe
            } else {
                Algorithm::TwoShotPush
            };
            let c = check_sym::<T>(comm, s, seed, (0, 0), count, op, true);
            assert_eq!(c.algorithm, alg, "{count} x {}", T::DTYPE);
            let c = check_sym::<T>(comm, s, seed, (8 / es * 2, 24 / es * 2), count, op, false);
            assert_eq!(c.algorithm, alg);
        }
    }
}

/// The copy-engine two-shot: chosen between `ce_min_bytes` and `ce_max_bytes`, exact for every
/// dtype and op in place and out of place with vector tails; misaligned operands fall back to
/// the reading two-shot; a forced call larger than the landing slots is refused.
#[test]
fn the_copy_engine_two_shot_is_chosen_up_to_its_limit_and_exact() {
    let e = ar_env();
    let Some(comm) = team_with(
        &e,
        "two_shot_ce",
        CommConfig {
            one_shot_max_bytes: Some(8 << 10),
            ll_max_bytes: 1 << 10,
            ce_max_bytes: 1 << 20,
            ce_min_bytes: 16 << 10,
            ..Default::default()
        },
    ) else {
        return;
    };
    let s = streams(&comm);
    let alg = |count| {
        comm.choice(DType::F32, ReduceOp::Sum, count, Operands::Symmetric)
            .unwrap()
            .algorithm
    };
    assert_eq!(alg(100_000), Algorithm::TwoShotCe);
    assert_eq!(alg(300_000), Algorithm::TwoShotPush);
    // below ce_min_bytes (16 KiB) but above the one-shot limit: the write-only two-shot
    assert_eq!(alg(3_000), Algorithm::TwoShotPush);
    let mut seed = Rng::new(4242);
    for dtype in DType::ALL {
        for_dtype!(dtype, ce_every_op(&comm, &s, &mut seed));
    }
    // misaligned: the reading two-shot
    let c = check_sym::<f32>(&comm, &s, &mut seed, (3, 3), 60_000, ReduceOp::Sum, false);
    assert_eq!(c.algorithm, Algorithm::TwoShot);
    // forced beyond the landing slots: refused before anything is queued
    let forced = team_with(
        &e,
        "two_shot_ce",
        CommConfig {
            algorithm: Some(Algorithm::TwoShotCe),
            ce_max_bytes: 64 << 10,
            ..Default::default()
        },
    )
    .unwrap();
    let mut big = forced.alloc::<f32>(200_000).unwrap();
    let before = launches(&e);
    let err = forced
        .rank(0)
        .unwrap()
        .all_reduce_in_place(&mut big, ReduceOp::Sum, &s[0])
        .unwrap_err();
    assert_eq!(invalid_arg(err), "count");
    assert_eq!(launches(&e), before);
}
